"""Qwen1.5-MoE and Qwen2-MoE: Qwen2's attention (q, k and v biases, ``qkv_bias``) with a
mixture of experts as the MLP of the layers ``decoder_sparse_step`` and
``mlp_only_layers`` leave sparse (the others keep a dense MLP of ``intermediate_size``):
``num_experts_per_tok`` of ``num_experts`` experts per token, renormalised with
``norm_topk_prob``, beside a shared expert scaled by ``sigmoid(shared_expert_gate)``."""

from rayrl.rollout.native.families.base import FAMILIES, moe_layers, moe_problems
from rayrl.rollout.native.families.qwen2 import Qwen2
from rayrl.rollout.native.spec import MoESpec


@FAMILIES.register("qwen2_moe")
class Qwen2Moe(Qwen2):
    mlp_kind = "moe"

    def variants(self, config) -> dict:
        bias = bool(getattr(config, "qkv_bias", True))
        return {**super().variants(config), "qkv_bias": bias}

    def moe(self, config) -> MoESpec:
        return MoESpec(
            experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            intermediate=config.moe_intermediate_size,
            layers=moe_layers(config, config.num_experts),
            norm_topk=bool(config.norm_topk_prob),
            shared=config.shared_expert_intermediate_size,
            shared_gate=True,
        )

    def problems(self, config) -> list[str]:
        top_k = config.num_experts_per_tok
        return super().problems(config) + moe_problems(config.num_experts, top_k)
