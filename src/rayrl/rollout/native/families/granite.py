"""Granite (IBM Granite 3.x dense): Llama's layer with four scalars: the embeddings times
``embedding_multiplier``, each sublayer's output times ``residual_multiplier`` before the
residual add, ``attention_multiplier`` as the softmax scale, the logits divided by
``logits_scaling``."""

from rayrl.rollout.native.families.base import FAMILIES
from rayrl.rollout.native.families.llama import Llama


@FAMILIES.register("granite")
class Granite(Llama):
    def variants(self, config) -> dict:
        return {
            **super().variants(config),
            "embed_scale": float(config.embedding_multiplier),
            "residual_scale": float(config.residual_multiplier),
            "attn_scale": float(config.attention_multiplier),
            "logits_divisor": float(config.logits_scaling),
        }
