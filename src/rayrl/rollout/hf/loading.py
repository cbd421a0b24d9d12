"""Loading the HF rollout engine's own copy of a model: a directory's generating model
(a vision-language model's too: `rayrl.models.vision_language.causal_lm_class`) and its
tokenizer, its config with ``model.override_config`` set on it; or, when the weights
come later from the training engine (`HFRolloutEngine.update_weights`), only its
structure, parameters allocated and not read, buffers computed as a load computes them.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from rayrl import reads
from rayrl.models.config_overrides import apply_config_overrides
from rayrl.models.vision_language import causal_lm_class

__all__ = ["empty_model", "load_model"]


def load_model(path: str, tokenizer, dtype, device, config_overrides=None, load_weights=True):
    """An HF causal LM (and its tokenizer unless given) from a directory, its config with
    ``config_overrides`` set on it; without ``load_weights`` its parameters are
    allocated, not read (its buffers computed as a load computes them)."""
    from transformers import AutoConfig, AutoTokenizer

    from rayrl.train.load_once import weight_file_bytes

    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        config = AutoConfig.from_pretrained(path)
        apply_config_overrides(config, config_overrides, "model.override_config")
        if load_weights:
            auto = causal_lm_class(config)
            model = auto.from_pretrained(path, config=config, dtype=dtype or "auto")
            reads.count(weight_file_bytes(path))
        else:
            model = empty_model(path, config, dtype, device)
    except OSError as err:
        raise OSError(
            f"HFRolloutEngine: cannot load a model from {path!r} ({err}); pass a local HF "
            "model directory (config.json + weights)."
        ) from err
    model.to(device).eval()
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def empty_model(path: str, config, dtype, device) -> nn.Module:
    """``config``'s causal LM with its parameters allocated on ``device``, uninitialised
    (in ``dtype``, else the dtype the config names), its buffers as built (the rotary
    tables), and the directory's generation config."""
    from accelerate import init_empty_weights
    from transformers import GenerationConfig

    from rayrl.train.load_once import materialize

    if dtype in (None, "auto"):
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype or torch.float32
    with init_empty_weights(include_buffers=False):
        model = causal_lm_class(config).from_config(config, dtype=dtype)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()  # parameters made on meta one by one come untied
    materialize(model, torch.device(device))  # the rotary tables kept as computed
    if os.path.isfile(os.path.join(path, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model
