"""Mixtral (8x7B, 8x22B): Mistral's layer (a ``sliding_window`` on every layer where the
config sets one) with a mixture of experts as every layer's MLP: ``num_experts_per_tok``
of ``num_local_experts`` experts per token, their softmax probabilities always
renormalised, the routing weights applied in float32. Its checkpoints on disk name the
block ``block_sparse_moe`` and the experts' gate, down and up ``w1``, ``w2``, ``w3``."""

from rayrl.rollout.native.families.base import FAMILIES, ExpertNames, moe_problems
from rayrl.rollout.native.families.mistral import Mistral
from rayrl.rollout.native.spec import MoESpec


@FAMILIES.register("mixtral")
class Mixtral(Mistral):
    mlp_kind = "moe"
    expert_names = ExpertNames("block_sparse_moe", "w1", "w3", "w2")

    def moe(self, config) -> MoESpec:
        return MoESpec(
            experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            intermediate=config.intermediate_size,
            layers=(True,) * config.num_hidden_layers,
            norm_topk=True,
            weights_in_float=True,
        )

    def problems(self, config) -> list[str]:
        top_k = config.num_experts_per_tok
        return super().problems(config) + moe_problems(config.num_local_experts, top_k)
