"""Qwen3-MoE (30B-A3B, 235B-A22B): Qwen3's attention (an RMSNorm on each head's q and k)
with a mixture of experts as the MLP of the layers ``decoder_sparse_step`` and
``mlp_only_layers`` leave sparse (the others keep a dense MLP): ``num_experts_per_tok``
of ``num_experts`` experts per token, renormalised with ``norm_topk_prob``; no shared
expert."""

from rayrl.rollout.native.families.base import FAMILIES, moe_layers, moe_problems
from rayrl.rollout.native.families.qwen3 import Qwen3
from rayrl.rollout.native.spec import MoESpec


@FAMILIES.register("qwen3_moe")
class Qwen3Moe(Qwen3):
    mlp_kind = "moe"

    def moe(self, config) -> MoESpec:
        return MoESpec(
            experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            intermediate=config.moe_intermediate_size,
            layers=moe_layers(config, config.num_experts),
            norm_topk=bool(config.norm_topk_prob),
        )

    def problems(self, config) -> list[str]:
        top_k = config.num_experts_per_tok
        return super().problems(config) + moe_problems(config.num_experts, top_k)
