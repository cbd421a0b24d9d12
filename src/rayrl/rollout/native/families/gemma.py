"""Gemma (1): Llama's layer with Gemma's RMSNorm (the float32 normed values times
``1 + weight``, rounded once), the embeddings times sqrt(hidden) (the factor rounded to
the model dtype first), a GELU-tanh gated MLP, and a tied head."""

from rayrl.rollout.native.families.base import FAMILIES
from rayrl.rollout.native.families.llama import Llama


@FAMILIES.register("gemma")
class Gemma(Llama):
    def variants(self, config) -> dict:
        return {
            **super().variants(config),
            "norm_offset": 1.0,
            "norm_in_float": True,
            "embed_scale": config.hidden_size**0.5,
            "embed_scale_in_dtype": True,
        }
