"""Qwen2 and Qwen2.5 (and DeepSeek-R1's Qwen distillations): Llama's layer with biases on
q, k and v (not o), and sliding windows on the layers ``layer_types`` names."""

from rayrl.rollout.native.families.base import FAMILIES, sliding_windows
from rayrl.rollout.native.families.llama import Llama


@FAMILIES.register("qwen2")
class Qwen2(Llama):
    def variants(self, config) -> dict:
        return {
            "qkv_bias": True,
            "o_bias": False,
            "qk_norm": False,
            "windows": sliding_windows(config),
        }
