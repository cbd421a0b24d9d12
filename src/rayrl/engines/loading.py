"""Loading a Hugging Face model directory for training: policy or value model.

`load_hf_model` reads a causal LM, or the same weights under a one-label
token-classification head (a critic built from a policy checkpoint), with the
requested dtype and attention implementation, and switches dropout off.
"""

from __future__ import annotations

import os

import torch
from torch import nn

__all__ = ["DTYPES", "has_tokenizer", "load_hf_model", "pick_device"]

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


def load_hf_model(
    path: str,
    value_head: bool,
    dtype: str,
    attn_implementation: str,
    seed: int,
    trust_remote_code: bool = False,
) -> nn.Module:
    """A causal LM, or a one-label token-classification model (``value_head``), on CPU.

    Dropout is switched off (RL needs the same log-probs in every pass); a value head
    missing from the checkpoint is initialised from ``seed``, so every rank and every
    run draws the same one.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

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
    kwargs = {
        "config": config,
        "dtype": DTYPES[dtype],
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
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    model.config.use_cache = False
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    return model
