"""A model family of the native engine: the contract each family file fills, and its registry.

A `Family` is everything the engine knows of one transformers ``model_type``:

- its **config reader** (`read`): the `ModelSpec`, shapes and layer variants, or an
  `UnsupportedModelError` naming the feature the engine lacks (`problems`);
- its **weight-name map** (`layer_names`, `norm_names`, `fused`): which HF tensor fills
  which rows of the engine's fused weights (`rayrl.rollout.native.weights`);
- its **MLP kind** (`mlp_kind`): ``"dense"``, or ``"moe"`` for a mixture of experts,
  whose config the family reads (`moe`: the spec's `MoESpec`) and whose per-expert
  checkpoint names it declares (`expert_names`); the names, the TP plan and the op
  (`rayrl.rollout.native.moe`) are shared by every MoE family;
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
import re
from typing import Any, NamedTuple

import torch
from torch import Tensor

from rayrl.registry import Registry
from rayrl.rollout.native.spec import (
    HINT,
    NORM_LAYOUTS,
    ModelSpec,
    MoESpec,
    UnsupportedModelError,
)

__all__ = [
    "FAMILIES",
    "QWEN_EXPERTS",
    "ExpertNames",
    "Family",
    "check_longrope",
    "family_for",
    "moe_layers",
    "moe_problems",
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
# A mixture-of-experts layer's TP plan (`shards._SPLITS`): every expert's gate and up rows
# and down columns split as a dense MLP's, in memory's fused 3-D tensors (the gate and up
# parts of ``gate_up_proj``, `moe_names`) and in checkpoints' per-expert ones (``*``: the
# expert); the shared expert as a dense MLP of its width; the router and the shared
# expert's gate whole on every rank.
MOE_TP_PLAN = {
    "mlp.experts.gate_proj": "experts_rows",
    "mlp.experts.up_proj": "experts_rows",
    "mlp.experts.down_proj": "experts_cols",
    "mlp.shared_expert.gate_proj.weight": "shared_rows",
    "mlp.shared_expert.up_proj.weight": "shared_rows",
    "mlp.shared_expert.down_proj.weight": "shared_cols",
}
# A layer's weight-name map: HF name -> (the engine's slot, the index of the slot's view
# the tensor fills: rows, or an expert, or a tuple of both; None: all of it).
Index = slice | int | tuple[slice | int, ...] | None


class ExpertNames(NamedTuple):
    """How checkpoints on disk name a layer's experts, one tensor per expert: the router
    ``{block}.gate.weight``, expert e's ``{block}.experts.{e}.{gate|up|down}.weight``.
    (transformers 5 fuses them into 3-D tensors on load and splits them again on save.)"""

    block: str
    gate: str
    up: str
    down: str


QWEN_EXPERTS = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")


def family_for(model: Any) -> Family:
    """The family of ``model`` (a transformers config, a `ModelSpec`, or a model_type)."""
    model_type = model if isinstance(model, str) else getattr(model, "model_type", None)
    if not isinstance(model_type, str) or model_type not in FAMILIES:
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
    # The MLP: "dense" (a SwiGLU or GELU-gated MLP) or "moe" (a mixture of experts on
    # the layers `moe` names, in transformers 5's names, and `expert_names` on disk).
    mlp_kind: str = "dense"
    expert_names: ExpertNames = QWEN_EXPERTS

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
            moe=self.moe(config) if self.mlp_kind == "moe" else None,
            **self.variants(config),
        )

    def moe(self, config) -> MoESpec:
        """The mixture of experts of ``config`` (an ``mlp_kind="moe"`` family's)."""
        raise NotImplementedError(f"{type(self).__name__} declares mlp_kind='moe' but no moe()")

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
    def layer_names(self, spec: ModelSpec, layer: int) -> dict[str, tuple[str, Index]]:
        """Layer ``layer``'s HF tensors (names after ``model.layers.N.``) -> (the engine's
        slot, the index of the slot's view the tensor fills: rows; None: all)."""
        q, kv = spec.q_size, spec.kv_size
        out: dict[str, tuple[str, Index]] = {
            f"{hf}.weight": (slot, None) for hf, slot in self.norm_names.items()
        }
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
        return {**out, **self.mlp_names(spec, layer)}

    def mlp_names(self, spec: ModelSpec, layer: int) -> dict[str, tuple[str, Index]]:
        """Layer ``layer``'s MLP tensors: a dense MLP's, or a mixture of experts' (with
        its shared expert in the dense MLP's slots)."""
        width, moe = spec.mlp_width(layer), spec.layer_moe(layer)
        out: dict[str, tuple[str, Index]] = {}
        prefix = "mlp.shared_expert." if moe is not None else "mlp."
        if width:
            out[f"{prefix}gate_proj.weight"] = ("gate_up", slice(0, width))
            out[f"{prefix}up_proj.weight"] = ("gate_up", slice(width, None))
            out[f"{prefix}down_proj.weight"] = ("down", None)
        if moe is not None:
            out.update(moe_names(moe, self.expert_names))
        return out

    def layer_fused(self, spec: ModelSpec, layer: int) -> dict[str, tuple[int, tuple[str, ...]]]:
        """Layer ``layer``'s HF tensors that concatenate others: name -> (the dim they
        are concatenated along, the parts in order): `fused` (rows), and a mixture of
        experts' ``gate_up_proj`` ``[experts, 2 * width, hidden]`` (gate, then up)."""
        out = {name: (0, parts) for name, parts in self.fused.items()}
        if spec.is_moe(layer):
            out["mlp.experts.gate_up_proj"] = (1, ("mlp.experts.gate_proj", "mlp.experts.up_proj"))
        return out

    def layer_aliases(self, spec: ModelSpec, layer: int) -> dict[str, str]:
        """Layer ``layer``'s checkpoint names that fill part of another name's tensor: the
        per-expert tensors on disk (`expert_names`) -> transformers' fused tensor."""
        moe = spec.layer_moe(layer)
        if moe is None:
            return {}
        n = self.expert_names
        out: dict[str, str] = {}
        if n.block != "mlp":
            out[f"{n.block}.gate.weight"] = "mlp.gate.weight"
        for e in range(moe.experts):
            prefix = f"{n.block}.experts.{e}."
            out[f"{prefix}{n.gate}.weight"] = "mlp.experts.gate_up_proj"
            out[f"{prefix}{n.up}.weight"] = "mlp.experts.gate_up_proj"
            out[f"{prefix}{n.down}.weight"] = "mlp.experts.down_proj"
        return out

    # ------------------------------------------------------------------ tensor parallelism
    def tp_kind(self, name: str) -> str | None:
        """How HF tensor ``name`` splits over TP ranks (None: every rank holds it whole)."""
        if name in VOCAB_NAMES:
            return "vocab"
        key = name.partition(".layers.")[2].partition(".")[2]
        if self.mlp_kind == "moe":
            key = re.sub(r"\.experts\.\d+\.", ".experts.*.", key)
            return self.tp_plan.get(key) or moe_tp_plan(self.expert_names).get(key)
        return self.tp_plan.get(key)

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

    def mrope_rotary(self, config, device) -> torch.nn.Module:
        """A family whose positions have three axes (`ModelSpec.mrope`: Qwen2-VL's) returns
        its transformers rotary module, which takes them; others have none."""
        raise UnsupportedModelError(
            f"native rollout engine: {config.model_type} has no multimodal (M-RoPE) positions"
        )

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


def moe_names(moe: MoESpec, names: ExpertNames) -> dict[str, tuple[str, Index]]:
    """A mixture-of-experts layer's tensors (its shared expert's aside): transformers 5's
    router and fused experts (``gate_up_proj``'s gate and up parts: `Family.layer_fused`),
    and the per-expert tensors of checkpoints on disk (`ExpertNames`), each a view of the
    engine's ``experts_gate_up`` ``[experts, 2 * width, hidden]`` / ``experts_down``
    ``[experts, hidden, width]``."""
    width, whole = moe.intermediate, slice(None)
    out: dict[str, tuple[str, Index]] = {
        "mlp.gate.weight": ("router", None),
        "mlp.experts.gate_proj": ("experts_gate_up", (whole, slice(0, width))),
        "mlp.experts.up_proj": ("experts_gate_up", (whole, slice(width, None))),
        "mlp.experts.down_proj": ("experts_down", None),
    }
    if moe.shared_gate:
        out["mlp.shared_expert_gate.weight"] = ("shared_gate", None)
    out[f"{names.block}.gate.weight"] = ("router", None)
    for e in range(moe.experts):
        prefix = f"{names.block}.experts.{e}."
        out[f"{prefix}{names.gate}.weight"] = ("experts_gate_up", (e, slice(0, width)))
        out[f"{prefix}{names.up}.weight"] = ("experts_gate_up", (e, slice(width, None)))
        out[f"{prefix}{names.down}.weight"] = ("experts_down", e)
    return out


def moe_tp_plan(names: ExpertNames) -> dict[str, str]:
    """`MOE_TP_PLAN` with the per-expert checkpoint names (``*``: any expert)."""
    prefix = f"{names.block}.experts.*."
    return {
        **MOE_TP_PLAN,
        f"{prefix}{names.gate}.weight": "expert_rows",
        f"{prefix}{names.up}.weight": "expert_rows",
        f"{prefix}{names.down}.weight": "expert_cols",
    }


def moe_layers(config, experts: int) -> tuple[bool, ...]:
    """Each layer's MLP is a mixture of experts (Qwen-MoE's rule: not in
    ``mlp_only_layers``, and every ``decoder_sparse_step``-th layer)."""
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    step = getattr(config, "decoder_sparse_step", None) or 1
    return tuple(
        i not in dense and experts > 0 and (i + 1) % step == 0
        for i in range(config.num_hidden_layers)
    )


def moe_problems(experts: int, top_k: int) -> list[str]:
    """What of a mixture of experts' config the engine does not run (empty: none)."""
    if experts and not 0 < top_k <= experts:
        return [f"num_experts_per_tok={top_k} of {experts} experts"]
    return []


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
