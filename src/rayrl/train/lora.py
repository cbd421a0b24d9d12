"""LoRA through peft: adapters on a loaded model, the base model on demand, merged export.

Only adapter weights train (peft freezes the rest, and the optimizer takes only
parameters that require gradients). The reference policy is the same module with its
adapters disabled, so no second copy of the weights exists. For weight sync and the
Hugging Face export, `merged_state_dict` folds each adapter into its base weight
(W + B·A·alpha/r) under the base model's parameter names.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

ADAPTER = "default"
_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoraSpec:
    """LoRA settings, named as verl's model keys (``lora_rank``, ``lora_alpha``,
    ``target_modules``: a list of module names, or ``"all-linear"``; ``exclude_modules``:
    modules left without adapters, a regex over module names or a list of names, as
    peft's ``exclude_modules``)."""

    lora_rank: int
    lora_alpha: int = 16
    target_modules: str | tuple[str, ...] = "all-linear"
    dropout: float = 0.0
    exclude_modules: str | tuple[str, ...] | None = None

    @classmethod
    def from_model_config(cls, model: Any) -> LoraSpec | None:
        """From a config's model group; None when ``lora_rank`` is 0 (LoRA off)."""
        if model.lora_rank <= 0:
            return None
        modules = model.target_modules
        exclude = getattr(model, "exclude_modules", None)
        return cls(
            lora_rank=int(model.lora_rank),
            lora_alpha=int(model.lora_alpha),
            target_modules=modules if isinstance(modules, str) else tuple(modules),
            exclude_modules=exclude
            if exclude is None or isinstance(exclude, str)
            else tuple(exclude),
        )


def apply_lora(model: nn.Module, lora: LoraSpec, seed: int = 0) -> nn.Module:
    """Wrap `model` with LoRA adapters, their random matrices drawn from `seed` (the
    run's): the same on every rank and in every run of the seed (the process's own
    random state, which a load may or may not have drawn from, would make each run's
    adapters, and so its gradients, its own)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError(
            "actor_rollout_ref.model.lora_rank > 0 needs peft: pip install 'rayrl[peft]'"
        ) from exc
    modules, exclude = lora.target_modules, lora.exclude_modules
    config = LoraConfig(
        exclude_modules=exclude if exclude is None or isinstance(exclude, str) else list(exclude),
        r=int(lora.lora_rank),
        lora_alpha=int(lora.lora_alpha),
        lora_dropout=float(lora.dropout),
        target_modules=modules if isinstance(modules, str) else list(modules),
        bias="none",
    )
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):  # wherever the model is, seeded
        torch.manual_seed(seed)
        return get_peft_model(model, config)


def is_lora(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run the base model: every adapter switched off inside the block."""
    if not is_lora(model):
        raise ValueError(
            "adapters_disabled needs a LoRA model (actor_rollout_ref.model.lora_rank > 0)"
        )
    with model.disable_adapter():
        yield


def lora_scaling(model: nn.Module) -> float:
    config = model.peft_config[ADAPTER]
    return float(config.lora_alpha) / float(config.r)


def merged_state_dict(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A PeftModel's full state dict with adapters merged, under the base model's names."""
    merged: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if ".lora_" in name:
            continue
        base = name.removeprefix(_PREFIX).replace(".base_layer.", ".")
        if name.endswith(".base_layer.weight"):
            stem = name.removesuffix(".base_layer.weight")
            a = state[f"{stem}.lora_A.{ADAPTER}.weight"]
            b = state[f"{stem}.lora_B.{ADAPTER}.weight"]
            delta = (b.float() @ a.float()) * scaling
            tensor = (tensor.float() + delta).to(tensor.dtype)
        merged[re.sub(r"\.base_layer\.", ".", base)] = tensor
    return merged


def value_head_module(model: nn.Module) -> nn.Module:
    """The one-label head of a token- or sequence-classification model (``score``, or
    ``classifier``), through a peft wrapper."""
    inner = model.get_base_model() if is_lora(model) else model
    for name in ("score", "classifier"):
        head = getattr(inner, name, None)
        if isinstance(head, nn.Module):
            return head
    raise ValueError(f"{type(inner).__name__} has no 'score' or 'classifier' head")
