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

from rayrl.config.expert_checks import model_experts
from rayrl.model_dirs import local_config
from rayrl.models.model_shape import ExpertShape, ModelShape

__all__ = ["model_shape"]


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

    from rayrl.rollout.native.families import FAMILIES, family_for
    from rayrl.rollout.native.spec import UnsupportedModelError

    model_type = config.get("model_type")
    moe_types = [n for n in FAMILIES.names() if FAMILIES.get(n).mlp_kind == "moe"]
    if model_type not in moe_types:
        return (
            f"the mixture of experts {model_type!r} at {path} has no family that reads its "
            f"experts (mixtures of experts read: {', '.join(moe_types)})"
        )
    try:
        spec = family_for(model_type).read(AutoConfig.from_pretrained(path))
    except (UnsupportedModelError, ValueError, KeyError) as err:
        return f"{path}/config.json does not read as a {model_type} model: {err}"
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
        name=(config.get("architectures") or [model_type])[0],
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
