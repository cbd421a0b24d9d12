"""What the native engine needs to know of an HF decoder model, read from its config.

`ModelSpec.from_hf_config` accepts the Qwen2, Qwen3 and Llama families (one decoder
layer shape: RMSNorm, rotary attention with grouped KV heads, SwiGLU MLP) and refuses
anything else with a message that names the unsupported feature and the way out (the
``hf`` rollout engine runs any causal LM). `rotary_tables` computes the cos/sin tables
with the model's own transformers rotary class, so positions match transformers bit for
bit whatever the rope type (default, linear, llama3, yarn, ...).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["SUPPORTED_MODEL_TYPES", "ModelSpec", "UnsupportedModelError", "rotary_tables"]

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")
_HINT = "use actor_rollout_ref.rollout.name=hf, which runs any transformers causal LM"


class UnsupportedModelError(ValueError):
    """The model has a feature the native engine does not implement."""


@dataclass(frozen=True)
class ModelSpec:
    """Shapes and options of a supported decoder model."""

    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rms_eps: float
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    tie_embeddings: bool
    max_positions: int

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.heads // self.kv_heads

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V cache that one token takes over all layers."""
        return 2 * self.layers * self.kv_size * torch.empty((), dtype=dtype).element_size()

    @classmethod
    def from_hf_config(cls, config) -> ModelSpec:
        """Read a transformers config; raise `UnsupportedModelError` for other models."""
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"native rollout engine: model_type {model_type!r} is not supported (supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}); {_HINT}."
            )
        _refuse_unsupported(config, model_type)
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        bias = bool(getattr(config, "attention_bias", False))
        return cls(
            model_type=model_type,
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate=config.intermediate_size,
            vocab=config.vocab_size,
            rms_eps=config.rms_norm_eps,
            qkv_bias=True if model_type == "qwen2" else bias,
            o_bias=False if model_type == "qwen2" else bias,
            qk_norm=model_type == "qwen3",
            tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_positions=config.max_position_embeddings,
        )


def _refuse_unsupported(config, model_type: str) -> None:
    problems = []
    if getattr(config, "mlp_bias", False):
        problems.append("mlp_bias=True")
    if getattr(config, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={config.hidden_act!r} (only silu)")
    layer_types = getattr(config, "layer_types", None) or []
    if getattr(config, "use_sliding_window", False) or "sliding_attention" in layer_types:
        problems.append("sliding-window attention")
    rope = _rope_parameters(config)
    if rope.get("rope_type", "default") == "dynamic":
        problems.append("dynamic rope scaling (cos/sin depend on the sequence length)")
    if problems:
        raise UnsupportedModelError(
            f"native rollout engine: this {model_type} model uses {', '.join(problems)}, "
            f"which the engine does not implement; {_HINT}."
        )


def _rope_parameters(config) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    return dict(params or {})


def rotary_tables(config, max_positions: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """float32 ``cos, sin`` tables ``[max_positions, head_dim]`` as transformers computes them.

    Uses the model family's own rotary-embedding module (``<Family>RotaryEmbedding``), so
    inverse frequencies and any scaling come from transformers itself.
    """
    module = importlib.import_module(
        f"transformers.models.{config.model_type}.modeling_{config.model_type}"
    )
    classes = [getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding")]
    if not classes:
        raise UnsupportedModelError(
            f"native rollout engine: transformers has no rotary embedding for "
            f"{config.model_type!r}; {_HINT}."
        )
    rotary = classes[0](config)
    positions = torch.arange(max_positions, dtype=torch.int64).unsqueeze(0)
    probe = torch.zeros(1, dtype=torch.float32)
    with torch.no_grad():
        cos, sin = rotary(probe, positions)
    return cos[0].to(device).contiguous(), sin[0].to(device).contiguous()
