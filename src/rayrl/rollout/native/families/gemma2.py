"""Gemma 2: Gemma's norms, embedding scale and GELU-tanh MLP, with sandwich norms (each
sublayer's output normed again before the residual add), sliding windows on the layers
``layer_types`` names, soft-capped attention scores (``attn_logit_softcapping``) and
logits (``final_logit_softcapping``), and ``query_pre_attn_scalar`` ** -0.5 as the
softmax scale."""

from rayrl.rollout.native.families.base import FAMILIES, sliding_windows
from rayrl.rollout.native.families.gemma import Gemma


@FAMILIES.register("gemma2")
class Gemma2(Gemma):
    norm_names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "attn_out_norm",
        "pre_feedforward_layernorm": "mlp_norm",
        "post_feedforward_layernorm": "mlp_out_norm",
    }

    def variants(self, config) -> dict:
        return {
            **super().variants(config),
            "windows": sliding_windows(config),
            "attn_scale": config.query_pre_attn_scalar**-0.5,
            "attn_softcap": float(config.attn_logit_softcapping or 0.0),
            "final_softcap": float(config.final_logit_softcapping or 0.0),
        }

    def activation_name(self, config) -> str:
        return config.hidden_activation
