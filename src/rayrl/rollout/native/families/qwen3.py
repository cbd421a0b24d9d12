"""Qwen3 (dense): Llama's layer with an RMSNorm on each head's q and k before the rotary
embedding, and sliding windows on the layers ``layer_types`` names."""

from rayrl.rollout.native.families.base import FAMILIES, sliding_windows
from rayrl.rollout.native.families.llama import Llama


@FAMILIES.register("qwen3")
class Qwen3(Llama):
    def variants(self, config) -> dict:
        return {**super().variants(config), "qk_norm": True, "windows": sliding_windows(config)}
