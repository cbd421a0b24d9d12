"""The model ``rayrl plan`` budgets for: the `ModelShape` of the config.json in
``actor_rollout_ref.model.path``.

A dense model's shape is read from the file's fields (`ModelShape.from_config`). A
mixture of experts (its config names ``num_experts`` or ``num_local_experts``) is read
by its model family (`rayrl.rollout.native.families`), the same reader the native
rollout engine uses: which layers are sparse (Qwen-MoE's ``decoder_sparse_step`` and
``mlp_only_layers``), the experts' width (``moe_intermediate_size``, Mixtral's
``intermediate_size``), the shared expert and its gate, through transformers' config
class of the ``model_type`` (its defaults and key aliases; a local file, no download).
"""

from __future__ import annotations

from typing import Any

from rayrl.config.expert_checks import model_experts
from rayrl.model_dirs import local_config
from rayrl.models.model_shape import ExpertShape, ModelShape

__all__ = ["experts_shape", "model_shape", "shape_of"]


def model_shape(path: str | None) -> ModelShape | str:
    """The shape of the model at ``path``, or why there is none (a line to print)."""
    config = local_config(path)
    if config is None:
        return f"no config.json in actor_rollout_ref.model.path={path!r}"
    if not model_experts(path):
        return ModelShape.from_config(config)
    return _experts_shape(str(path), config)


def _experts_shape(path: str, config: dict) -> ModelShape | str:
    """A mixture of experts' shape, read by its family (module docstring)."""
    from transformers import AutoConfig

    from rayrl.rollout.native.spec import UnsupportedModelError

    try:
        return experts_shape(AutoConfig.from_pretrained(path), config.get("architectures"))
    except (UnsupportedModelError, ValueError, KeyError) as err:
        return f"{path}/config.json does not read as a {config.get('model_type')} model: {err}"
    except LookupError as err:
        return f"the mixture of experts at {path} {err}"


def shape_of(hf_config: Any) -> ModelShape:
    """The shape of a transformers config object (a mixture of experts read by its
    family, as `model_shape` reads one from a directory)."""
    as_dict = hf_config.to_dict()
    if any(as_dict.get(key) for key in ("num_experts", "num_local_experts")):
        return experts_shape(hf_config, as_dict.get("architectures"))
    return ModelShape.from_config(as_dict)


def experts_shape(hf_config: Any, architectures: list[str] | None = None) -> ModelShape:
    """A mixture of experts' shape from its transformers config, read by its model
    family; LookupError when no family reads its experts."""
    from rayrl.rollout.native.families import FAMILIES, family_for

    model_type = hf_config.model_type
    moe_types = [n for n in FAMILIES.names() if FAMILIES.get(n).mlp_kind == "moe"]
    if model_type not in moe_types:
        raise LookupError(
            f"{model_type!r} has no family that reads its experts (mixtures of experts "
            f"read: {', '.join(moe_types)})"
        )
    spec = family_for(model_type).read(hf_config)
    assert spec.moe is not None  # a "moe" family's spec has one
    moe = spec.moe
    return ModelShape(
        hidden=spec.hidden,
        layers=spec.layers,
        heads=spec.heads,
        kv_heads=spec.kv_heads,
        intermediate=spec.intermediate,
        vocab=spec.vocab,
        tied=spec.tie_embeddings,
        name=(architectures or [model_type])[0],
        head_dim=spec.head_dim,
        qkv_bias=spec.qkv_bias,
        qk_norm=spec.qk_norm,
        experts=ExpertShape(
            experts=moe.experts,
            top_k=moe.top_k,
            intermediate=moe.intermediate,
            layers=moe.layers,
            shared=moe.shared or 0,
            shared_gate=moe.shared_gate,
        ),
    )
