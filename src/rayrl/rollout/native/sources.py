"""Where a native engine's model comes from: its config, generation config, tokenizer,
device and dtype, from an HF module or an HF model directory."""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["engine_dtype", "engine_sources"]

WHERE = "NativeRolloutEngine"


def engine_dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def engine_sources(model, model_path, tokenizer, device, config_overrides=None):
    """(config, generation config, tokenizer, device) from a module or a directory (its
    config with ``config_overrides`` set on it)."""
    if model is not None:
        if device is None:
            device = next(iter(model.parameters())).device
        return model.config, getattr(model, "generation_config", None), tokenizer, device
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    try:
        config = AutoConfig.from_pretrained(model_path)
    except OSError as err:
        raise OSError(
            f"{WHERE}: cannot load a model config from {model_path!r} ({err}); pass a local HF "
            "model directory (config.json + safetensors weights)."
        ) from err
    from rayrl.models.config_overrides import apply_config_overrides

    apply_config_overrides(config, config_overrides, "model.override_config")
    gen_config = None
    if (Path(model_path) / "generation_config.json").exists():
        gen_config = GenerationConfig.from_pretrained(model_path)
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return config, gen_config, tokenizer, device
