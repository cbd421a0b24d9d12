"""OLMo 2 (AllenAI): norms after each sublayer instead of before (``post_attention_layernorm``
on the attention output, ``post_feedforward_layernorm`` on the MLP's, then the residual
add), an RMSNorm over all heads' q and over all heads' k (``q_norm`` / ``k_norm`` of the
whole projection), the norm weight applied in float32.

Tensor parallelism would split those whole-projection norms over ranks: refused.
"""

from rayrl.rollout.native.families.base import FAMILIES
from rayrl.rollout.native.families.llama import Llama
from rayrl.rollout.native.spec import ModelSpec


@FAMILIES.register("olmo2")
class Olmo2(Llama):
    norm_names = {
        "post_attention_layernorm": "attn_out_norm",
        "post_feedforward_layernorm": "mlp_out_norm",
    }

    def variants(self, config) -> dict:
        return {
            **super().variants(config),
            "qk_norm": True,
            "qk_norm_per_head": False,
            "norm_in_float": True,
        }

    def tp_problems(self, spec: ModelSpec, size: int) -> list[str]:
        if size == 1:
            return []
        return [
            f"{spec.model_type}'s q and k norms span all heads, which the ranks would split "
            "(use tensor_model_parallel_size=1, or the hf engine)"
        ]
