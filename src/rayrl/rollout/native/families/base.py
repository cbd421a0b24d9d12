"""A model family of the native engine: the contract each family file fills, and its registry.

A `Family` is everything the engine knows of one transformers ``model_type``:

- its **config reader** (`read`): the `ModelSpec`, shapes and layer variants, or an
  `UnsupportedModelError` naming the feature the engine lacks (`problems`);
- its **weight-name map** (`layer_names`, `norm_names`, `fused`): which HF tensor fills
  which rows of the engine's fused weights (`rayrl.rollout.native.weights`);
- its **tensor-parallel plan** (`tp_kind`, `tp_problems`): how each HF tensor splits over
  TP ranks (`rayrl.rollout.native.shards`), and which sizes cannot split the model;
- its **rotary tables** (`rotary`): cos/sin from the family's own transformers rotary
  class, so every rope type and scaling is transformers' own.

The defaults are Llama's layer (pre-norms, RMSNorm, rotary attention with grouped KV heads,
SwiGLU MLP, the usual HF names, Megatron-style splits). A family file subclasses `Family`
(or a family close to it), overrides what differs, and registers itself in `FAMILIES`
under its ``model_type``; every module of the package is imported with it, so adding a
family is one file. `family_for` finds a config's family.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import Tensor

from rayrl.registry import Registry
from rayrl.rollout.native.spec import HINT, NORM_LAYOUTS, ModelSpec, UnsupportedModelError

__all__ = [
    "FAMILIES",
    "Family",
    "check_longrope",
    "family_for",
    "rope_layer_types",
    "rope_parameters",
    "rope_tables",
    "rotary_table",
    "sliding_windows",
]

FAMILIES: Registry[type[Family]] = Registry("model family of the native rollout engine")

ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
VOCAB_NAMES = ("model.embed_tokens.weight", "lm_head.weight")
# The standard TP plan: HF tensor (within a layer) -> how it splits (`shards.TPShard.part`).
TP_PLAN = {
    "self_attn.q_proj.weight": "q_rows",
    "self_attn.q_proj.bias": "q_rows",
    "self_attn.k_proj.weight": "kv_rows",
    "self_attn.k_proj.bias": "kv_rows",
    "self_attn.v_proj.weight": "kv_rows",
    "self_attn.v_proj.bias": "kv_rows",
    "self_attn.o_proj.weight": "q_cols",
    "mlp.gate_proj.weight": "mlp_rows",
    "mlp.up_proj.weight": "mlp_rows",
    "mlp.down_proj.weight": "mlp_cols",
}


def family_for(model: Any) -> Family:
    """The family of ``model`` (a transformers config, a `ModelSpec`, or a model_type)."""
    model_type = model if isinstance(model, str) else getattr(model, "model_type", None)
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"native rollout engine: model_type {model_type!r} is not supported (supported: "
            f"{', '.join(FAMILIES.names())}); {HINT}."
        )
    return FAMILIES.get(model_type)()


class Family:
    """Llama's layer; subclasses override what their family does differently."""

    # The family's transformers modeling module (its rotary class); default from model_type.
    modeling: str = ""
    # A layer's norms: HF module name -> the engine's slot (spec.NORM_LAYOUTS).
    norm_names: dict[str, str] = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "mlp_norm",
    }
    # HF tensors that concatenate standard ones (rows, in order): Phi-3's qkv_proj.
    fused: dict[str, tuple[str, ...]] = {}
    tp_plan: dict[str, str] = TP_PLAN

    # ------------------------------------------------------------------ config reader
    def read(self, config) -> ModelSpec:
        """The spec of ``config``'s model; `UnsupportedModelError` for what the engine lacks."""
        problems = self.problems(config)
        if problems:
            raise UnsupportedModelError(
                f"native rollout engine: this {config.model_type} model uses "
                f"{', '.join(problems)}, which the engine does not implement; {HINT}."
            )
        heads = config.num_attention_heads
        return ModelSpec(
            model_type=config.model_type,
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate=config.intermediate_size,
            vocab=config.vocab_size,
            rms_eps=config.rms_norm_eps,
            tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_positions=config.max_position_embeddings,
            norm_layout=self.norm_layout(),
            activation=ACTIVATIONS[self.activation_name(config)],
            rope_tables=rope_tables(config),
            **self.variants(config),
        )

    def variants(self, config) -> dict[str, Any]:
        """The spec's variant fields for ``config`` (`ModelSpec`'s defaults otherwise)."""
        bias = bool(getattr(config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False}

    def problems(self, config) -> list[str]:
        """The features of ``config`` the engine does not implement (empty: none)."""
        problems = []
        if getattr(config, "mlp_bias", False):
            problems.append("mlp_bias=True")
        act = self.activation_name(config)
        if act not in ACTIVATIONS:
            problems.append(f"the activation {act!r} (only {', '.join(ACTIVATIONS)})")
        if "dynamic" in _rope_types(config):
            problems.append("dynamic rope scaling (cos/sin depend on the sequence length)")
        return problems

    def activation_name(self, config) -> str:
        return getattr(config, "hidden_act", "silu")

    def norm_layout(self) -> str:
        slots = set(self.norm_names.values())
        return next(k for k, v in NORM_LAYOUTS.items() if set(v) == slots)

    # ------------------------------------------------------------------ weight names
    def layer_names(self, spec: ModelSpec) -> dict[str, tuple[str, slice | None]]:
        """A layer's HF tensors (names after ``model.layers.N.``) -> (the engine's slot,
        the rows of it the tensor fills; None: all)."""
        q, kv, inter = spec.q_size, spec.kv_size, spec.intermediate
        out = {f"{hf}.weight": (slot, None) for hf, slot in self.norm_names.items()}
        for name, rows in (("q", slice(0, q)), ("k", slice(q, q + kv)), ("v", slice(q + kv, None))):
            out[f"self_attn.{name}_proj.weight"] = ("qkv", rows)
            if spec.qkv_bias:
                out[f"self_attn.{name}_proj.bias"] = ("qkv_bias", rows)
        out["self_attn.o_proj.weight"] = ("o", None)
        if spec.o_bias:
            out["self_attn.o_proj.bias"] = ("o_bias", None)
        if spec.qk_norm:
            out["self_attn.q_norm.weight"] = ("q_norm", None)
            out["self_attn.k_norm.weight"] = ("k_norm", None)
        out["mlp.gate_proj.weight"] = ("gate_up", slice(0, inter))
        out["mlp.up_proj.weight"] = ("gate_up", slice(inter, None))
        out["mlp.down_proj.weight"] = ("down", None)
        return out

    # ------------------------------------------------------------------ tensor parallelism
    def tp_kind(self, name: str) -> str | None:
        """How HF tensor ``name`` splits over TP ranks (None: every rank holds it whole)."""
        if name in VOCAB_NAMES:
            return "vocab"
        return self.tp_plan.get(name.partition(".layers.")[2].partition(".")[2])

    def tp_problems(self, spec: ModelSpec, size: int) -> list[str]:
        """Why ``size`` ranks cannot split this family's model, beyond the shapes."""
        return []

    # ------------------------------------------------------------------ rotary
    def rotary(self, config, max_positions: int, device) -> tuple[Tensor, Tensor]:
        """``cos, sin`` float32 ``[tables, max_positions, rotary dims]`` from transformers:
        one table, or one per layer type that has rope parameters of its own (Gemma 3's
        local and global, OLMo 3's), in `rope_layer_types` order."""
        check_longrope(config, max_positions)
        rotary = self.rotary_class(config)(config)
        kinds = [{"layer_type": t} for t in rope_layer_types(config)] or [{}]
        pairs = [rotary_table(rotary, max_positions, **kind) for kind in kinds]
        cos = torch.stack([c for c, _ in pairs]).to(device).contiguous()
        return cos, torch.stack([s for _, s in pairs]).to(device).contiguous()

    def rotary_class(self, config) -> type:
        """The family's ``<Family>RotaryEmbedding`` class."""
        name = (
            self.modeling or f"transformers.models.{config.model_type}.modeling_{config.model_type}"
        )
        module = importlib.import_module(name)
        classes = [getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding")]
        if not classes:
            raise UnsupportedModelError(
                f"native rollout engine: transformers has no rotary embedding for "
                f"{config.model_type!r}; {HINT}."
            )
        return classes[0]


def rotary_table(rotary, max_positions: int, **kwargs) -> tuple[Tensor, Tensor]:
    positions = torch.arange(max_positions, dtype=torch.int64).unsqueeze(0)
    probe = torch.zeros(1, dtype=torch.float32)
    with torch.no_grad():
        cos, sin = rotary(probe, positions, **kwargs)
    return cos[0], sin[0]


def rope_parameters(config) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    return dict(params or {})


def rope_layer_types(config) -> tuple[str, ...]:
    """The layer types with rope parameters of their own (Gemma 3, OLMo 3), sorted as
    transformers sorts them; () where the model has one rotary table."""
    params = rope_parameters(config)
    types = sorted(set(getattr(config, "layer_types", None) or ()))
    return tuple(types) if types and all(isinstance(params.get(t), dict) for t in types) else ()


def rope_tables(config) -> tuple[int, ...]:
    """Each layer's rotary table (`rope_layer_types` index); () for one table."""
    kinds = rope_layer_types(config)
    return tuple(kinds.index(t) for t in config.layer_types) if kinds else ()


def _rope_types(config) -> set[str]:
    """Every rope type of the config (Gemma 3 has one per layer type)."""
    params = rope_parameters(config)
    nested = [p for p in params.values() if isinstance(p, dict)]
    return {p.get("rope_type", "default") for p in nested or [params]}


def check_longrope(config, max_positions: int) -> None:
    """Longrope's tables change with the sequence's length (transformers takes the long
    factors past ``original_max_position_embeddings``): refuse longer sequences."""
    params = rope_parameters(config)
    if params.get("rope_type") != "longrope":
        return
    original = params.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None
    )
    if original and max_positions > original:
        raise UnsupportedModelError(
            f"native rollout engine: this {config.model_type} model's longrope scaling switches "
            f"to its long factors past {original} positions, and the engine keeps one table; "
            f"set max_model_len (rollout.max_model_len) to at most {original}, or {HINT}."
        )


def sliding_windows(config) -> tuple[int, ...]:
    """Each layer's sliding window (0: none), as transformers reads it: from
    ``layer_types`` where the config has them, else ``sliding_window`` on every layer."""
    window = getattr(config, "sliding_window", None) or 0
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        windows = tuple(window if t == "sliding_attention" else 0 for t in layer_types)
    else:
        windows = (window,) * config.num_hidden_layers
    return windows if any(windows) else ()
