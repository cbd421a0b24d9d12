"""A Hugging Face model directory from a sharded training checkpoint, offline.

Beside its DCP shards, every actor checkpoint keeps what an export needs: the model's
config, generation config, tokenizer and a vision-language model's processor files
(`huggingface/`), and `hf_meta.json` (the architecture, the training dtype, the LoRA
scaling when adapters are trained). `export_checkpoint` reads only the model weights
from the shards (no optimizer state, no Ray, no torch.distributed), folds LoRA adapters
into their base weights, casts to the training dtype and writes a directory that
`AutoModelForCausalLM.from_pretrained` (a vision-language model:
`AutoModelForImageTextToText`) and `AutoTokenizer.from_pretrained` load: what `rayrl
export` runs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from rayrl.models.vision_language import copy_processor_files
from rayrl.train.checkpoint_io import quiet_dcp, write_hf_dir
from rayrl.train.loading import DTYPES
from rayrl.train.lora import merged_state_dict

__all__ = ["export_checkpoint", "find_engine_dir", "write_hf_meta"]

META = "hf_meta.json"
HF_DIR = "huggingface"


def write_hf_meta(engine: Any, path: str | os.PathLike[str]) -> None:
    """Write `huggingface/` (config, generation config, tokenizer) and `hf_meta.json`
    for `engine` (a TrainEngine) into the checkpoint directory `path`; call on rank 0."""
    from transformers import AutoTokenizer

    from rayrl.train.loading import has_tokenizer
    from rayrl.train.lora import lora_scaling

    path = Path(path)
    hf = path / HF_DIR
    hf.mkdir(parents=True, exist_ok=True)
    config = engine.config
    config.architectures = [engine.architecture]
    config.save_pretrained(hf)
    if engine.generation_config is not None:
        engine.generation_config.save_pretrained(hf)
    if has_tokenizer(engine.tokenizer_path):
        AutoTokenizer.from_pretrained(engine.tokenizer_path).save_pretrained(hf)
    copy_processor_files(engine.model_path, hf)  # a vision-language model's
    meta = {
        "architecture": engine.architecture,
        "dtype": engine.training_dtype,
        "lora_scaling": lora_scaling(engine.model) if engine.lora else None,
    }
    (path / META).write_text(json.dumps(meta, indent=2) + "\n")


def find_engine_dir(path: str | os.PathLike[str], role: str = "actor") -> Path:
    """The engine checkpoint inside `path`: `path` itself, or `path/<role>` (a step dir)."""
    path = Path(path)
    for candidate in (path, path / role):
        if (candidate / META).is_file() and (candidate / ".metadata").is_file():
            return candidate
    raise FileNotFoundError(
        f"{path} holds no {role} checkpoint (no {META} and .metadata in it or in {path / role}); "
        "pass a checkpoint directory such as OUTPUT_DIR/checkpoints/global_step_N"
    )


def _model_template(engine_dir: Path) -> dict[str, torch.Tensor]:
    """Empty tensors for every model weight in the checkpoint, by flattened name."""
    meta = dcp.FileSystemReader(str(engine_dir)).read_metadata()
    template = {}
    for key, item in meta.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(item, TensorStorageMetadata):
            template[key.removeprefix("model.")] = torch.empty(
                item.size, dtype=item.properties.dtype
            )
    if not template:
        raise ValueError(f"{engine_dir} has no model weights (keys 'model.*')")
    return template


def load_model_weights(engine_dir: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The model weights of an engine checkpoint, unsharded, on CPU, under their names."""
    engine_dir = Path(engine_dir)
    state = {"model": _model_template(engine_dir)}
    with quiet_dcp():
        dcp.load(state, checkpoint_id=str(engine_dir), no_dist=True)
    return state["model"]


def export_checkpoint(
    path: str | os.PathLike[str], out_dir: str | os.PathLike[str], dtype: str | None = None
) -> Path:
    """Write an HF model directory from the actor checkpoint in `path`.

    `dtype` defaults to the training dtype recorded at save time; LoRA adapters are
    merged into the base weights. Returns the output directory.
    """
    from transformers import AutoConfig, GenerationConfig

    engine_dir = find_engine_dir(path)
    meta = json.loads((engine_dir / META).read_text())
    dtype = dtype or meta["dtype"]
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    state = load_model_weights(engine_dir)
    if meta.get("lora_scaling") is not None:
        state = merged_state_dict(state, float(meta["lora_scaling"]))
    hf = engine_dir / HF_DIR
    config = AutoConfig.from_pretrained(hf)
    try:
        generation = GenerationConfig.from_pretrained(hf)
    except OSError:
        generation = None
    tokenizer = hf if (hf / "tokenizer_config.json").is_file() else None
    out = Path(out_dir).absolute()
    architecture = meta["architecture"]
    write_hf_dir(state, out, config, architecture, tokenizer, generation, DTYPES[dtype], hf)
    return out
