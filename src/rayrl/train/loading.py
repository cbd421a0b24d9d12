"""Building a Hugging Face model for training: policy or value model.

A causal LM (a vision-language model's generating class, `causal_lm_class`), or the
same weights under a one-label token-classification head (a critic built from a policy
checkpoint), with the requested dtype and attention
implementation, dropout switched off. Two ways:

* `build_empty_model`: the model's structure from its config, parameters on the meta
  device (no memory), buffers real (the rotary tables are not in checkpoints). The
  training engine shards it and fills it from one read of the checkpoint
  (`rayrl.train.load_once`): the way every engine loads.
* `load_hf_model`: transformers' ``from_pretrained`` in this process, the whole model in
  host memory: kept for LoRA (peft wraps a loaded model) and for checkpoints whose
  tensor names do not map onto the model's.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from rayrl.models.vision_language import causal_lm_class

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["DTYPES", "build_empty_model", "has_tokenizer", "load_hf_model", "pick_device"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(device: str | torch.device | None) -> torch.device:
    """``device`` if given, else the current CUDA device, else CPU."""
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def has_tokenizer(path: str) -> bool:
    """Whether ``path`` holds tokenizer files."""
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    return any(os.path.isfile(os.path.join(path, n)) for n in names)


def load_config(
    path: str,
    dtype: str,
    trust_remote_code: bool = False,
    config_overrides: dict[str, Any] | None = None,
) -> tuple[PretrainedConfig, torch.dtype]:
    """The model directory's config, with verl's ``override_config`` values set on it
    (`rayrl.models.config_overrides`), and the torch dtype of ``dtype`` ("auto": float32)."""
    from transformers import AutoConfig

    from rayrl.models.config_overrides import apply_config_overrides

    if dtype == "auto":
        dtype = "float32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)} (or 'auto').")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(
            f"{path} has no config.json; pass a Hugging Face model directory "
            "(`rayrl models tiny` builds one)."
        )
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    apply_config_overrides(config, config_overrides, "model.override_config")
    return config, DTYPES[dtype]


def build_empty_model(
    path: str,
    value_head: bool,
    dtype: str,
    attn_implementation: str,
    trust_remote_code: bool = False,
    config_overrides: dict[str, Any] | None = None,
) -> nn.Module:
    """The model of ``path``'s config (``config_overrides`` set on it) with its parameters
    on the meta device (``dtype``) and its buffers in host memory; dropout off, as `load_hf_model`'s. Its generation
    config is the directory's, when it has one."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForTokenClassification, GenerationConfig

    config, torch_dtype = load_config(path, dtype, trust_remote_code, config_overrides)
    kwargs = {
        "dtype": torch_dtype,
        "attn_implementation": attn_implementation,
        "trust_remote_code": trust_remote_code,
    }
    if value_head:
        config.num_labels = 1
        config.classifier_dropout = 0.0
    auto = AutoModelForTokenClassification if value_head else causal_lm_class(config)
    with init_empty_weights(include_buffers=False):
        model = auto.from_config(config, **kwargs)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()  # parameters made on meta one by one come untied
    if os.path.isfile(os.path.join(path, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(path)
    return _for_training(model)


def load_hf_model(
    path: str,
    value_head: bool,
    dtype: str,
    attn_implementation: str,
    seed: int,
    trust_remote_code: bool = False,
    config_overrides: dict[str, Any] | None = None,
) -> nn.Module:
    """A causal LM, or a one-label token-classification model (``value_head``), on CPU,
    built from ``path``'s config with ``config_overrides`` set on it.

    Dropout is switched off (RL needs the same log-probs in every pass); a value head
    missing from the checkpoint is initialised from ``seed``, so every rank and every
    run draws the same one.
    """
    from transformers import AutoModelForTokenClassification

    config, torch_dtype = load_config(path, dtype, trust_remote_code, config_overrides)
    kwargs = {
        "config": config,
        "dtype": torch_dtype,
        "attn_implementation": attn_implementation,
        "trust_remote_code": trust_remote_code,
    }
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if value_head:
            config.num_labels = 1
            config.classifier_dropout = 0.0
            model = AutoModelForTokenClassification.from_pretrained(path, **kwargs)
        else:
            model = causal_lm_class(config).from_pretrained(path, **kwargs)
    return _for_training(model)


def _for_training(model: nn.Module) -> nn.Module:
    """No KV cache in forward passes, every dropout off."""
    model.config.use_cache = False
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    return model
