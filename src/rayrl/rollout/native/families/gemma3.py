"""Gemma 3, text only (``Gemma3ForCausalLM``, model_type ``gemma3_text``): Gemma 2's layer
with Gemma's RMSNorm on each head's q and k, and two rotary tables: the local one
(``rope_local_base_freq``) for sliding-window layers, the global one (with its scaling)
for full-attention layers (`Family.rotary` builds one per layer type). Soft-capping only
where the config sets it (none by default). The multimodal ``gemma3`` model is not this
family: the ``hf`` engine runs it."""

from rayrl.rollout.native.families.base import FAMILIES
from rayrl.rollout.native.families.gemma2 import Gemma2


@FAMILIES.register("gemma3_text")
class Gemma3Text(Gemma2):
    modeling = "transformers.models.gemma3.modeling_gemma3"

    def variants(self, config) -> dict:
        return {**super().variants(config), "qk_norm": True}
