"""Sharded checkpoints (torch.distributed.checkpoint) and Hugging Face export.

`save_sharded` / `load_sharded` write and read one directory with every rank's shard
of the model and optimizer state plus small engine values (LR scheduler, counters);
all ranks call them together (a rank with a large state on a GPU writes a file per
tensor, which bounds the host memory a save takes: `ONE_FILE_MAX_BYTES`). A checkpoint
written with N ranks loads with M ranks: DCP reshards on load. `export_hf` gathers the full weights to rank 0 and writes a
directory that ``transformers`` loads directly (config, safetensors, generation
config, tokenizer).
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from rayrl.models.vision_language import copy_processor_files

if TYPE_CHECKING:
    from transformers import GenerationConfig, PretrainedConfig

__all__ = [
    "export_hf",
    "full_model_state_dict",
    "load_sharded",
    "quiet_dcp",
    "save_sharded",
    "write_hf_dir",
]


# A rank's state with more than this many bytes on an accelerator is written one file
# per tensor instead of one file per rank: torch's FileSystemWriter keeps the host copy
# of every device tensor of a file until the file is done, so one file held the rank's
# whole state in host memory again (a 7B save ran its host out of memory:
# docs/benchmarks.md).
ONE_FILE_MAX_BYTES = 4 * 2**30


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _distributed() -> bool:
    distributed: bool = dist.is_available() and dist.is_initialized()
    return distributed


def _barrier() -> None:
    if _distributed():
        dist.barrier()


@contextmanager
def quiet_dcp() -> Iterator[None]:
    """Silence DCP's warnings about what is intended here: running in one process
    without torch.distributed, and overwriting an existing checkpoint directory."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*unavailable")
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
        yield


def save_sharded(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any],
) -> None:
    """Write model, optimizer and ``extra`` (picklable values) to the directory ``path``.

    Every rank must call it; each writes its own shard.
    """
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "extra": extra}
    writer = dcp.FileSystemWriter(
        str(path), overwrite=True, single_file_per_rank=_device_bytes(state) <= ONE_FILE_MAX_BYTES
    )
    with quiet_dcp():
        dcp.save(state, storage_writer=writer, no_dist=not _distributed())
    _barrier()


def _device_bytes(state: Any) -> int:
    """Bytes of the accelerator tensors in a (nested) state dict (a DTensor: its shard)."""
    leaves = torch.utils._pytree.tree_leaves(state)
    local = (t.to_local() if hasattr(t, "to_local") else t for t in leaves if torch.is_tensor(t))
    return sum(t.numel() * t.element_size() for t in local if t.device.type != "cpu")


def load_sharded(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    extra_template: dict[str, Any],
) -> dict[str, Any]:
    """Load a `save_sharded` directory in place; returns the saved ``extra`` values.

    ``extra_template`` must have the keys that were saved (e.g. the current values).
    """
    if not (Path(path) / ".metadata").is_file():
        raise FileNotFoundError(
            f"{path} is not a rayrl engine checkpoint (no .metadata file); pass the "
            "directory written by TrainEngine.save."
        )
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "extra": copy.deepcopy(extra_template)}
    with quiet_dcp():
        dcp.load(state, checkpoint_id=str(path), no_dist=not _distributed())
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    _barrier()
    extra: dict[str, Any] = state["extra"]
    return extra


def full_model_state_dict(model: nn.Module, cpu_offload: bool = True) -> dict[str, torch.Tensor]:
    """Unsharded weights. With ``cpu_offload`` only rank 0 gets them (on CPU; other
    ranks get an empty dict); without, every rank gets them on the device."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)
    full: dict[str, torch.Tensor] = get_model_state_dict(model, options=options)
    return full


def export_hf(
    model: nn.Module,
    out_dir: str | os.PathLike[str],
    *,
    config: PretrainedConfig,
    architecture: str,
    tokenizer_dir: str | os.PathLike[str] | None = None,
    generation_config: GenerationConfig | None = None,
    dtype: torch.dtype | None = None,
    state: dict[str, torch.Tensor] | None = None,
    processor_dir: str | os.PathLike[str] | None = None,
) -> Path | None:
    """Write a Hugging Face model directory from a (possibly sharded) model.

    Every rank must call it (the weights are gathered collectively); rank 0 writes
    under a temporary name and renames into place, replacing an existing directory.

    Args:
        config: the model's ``PretrainedConfig``; copied with ``architectures`` set.
        architecture: the model class name to record (``Qwen2ForCausalLM``).
        tokenizer_dir: where to load the tokenizer to save beside the weights.
        generation_config: saved when given.
        dtype: cast floating weights to it (default: keep the training dtype).
        state: the full weights, when the caller gathered (and transformed) them.
        processor_dir: where a vision-language model's processor files are, to copy
            beside the weights (`rayrl.models.vision_language.PROCESSOR_FILES`).

    Returns:
        The directory on rank 0, None on other ranks.
    """
    if state is None:
        state = full_model_state_dict(model, cpu_offload=True)
    out = Path(out_dir).absolute()
    if _rank() == 0:
        write_hf_dir(
            state, out, config, architecture, tokenizer_dir, generation_config, dtype, processor_dir
        )
    _barrier()
    return out if _rank() == 0 else None


def write_hf_dir(
    state: dict[str, torch.Tensor],
    out: Path,
    config: PretrainedConfig,
    architecture: str,
    tokenizer_dir: str | os.PathLike[str] | None,
    generation_config: GenerationConfig | None,
    dtype: torch.dtype | None,
    processor_dir: str | os.PathLike[str] | None = None,
) -> None:
    """Write `state` as an HF model directory at `out` (staged, then renamed into place):
    config with `architectures`, safetensors (cast to `dtype`; a tied lm_head left
    out), generation config, tokenizer and processor files when given."""
    from huggingface_hub import save_torch_state_dict

    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    if getattr(config, "tie_word_embeddings", False):
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        config = copy.deepcopy(config)
        config.architectures = [architecture]
        if dtype is not None:
            config.dtype = dtype
        config.save_pretrained(staging)
        save_torch_state_dict(state, staging)
        if generation_config is not None:
            generation_config.save_pretrained(staging)
        if tokenizer_dir is not None:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(staging)
        if processor_dir is not None:
            copy_processor_files(processor_dir, staging)
        staging.chmod(0o755)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
