"""Seed-OSS (ByteDance): Llama's layer with separate switches for the q/k/v biases
(``attention_bias``) and the output projection's (``attention_out_bias``)."""

from rayrl.rollout.native.families.base import FAMILIES
from rayrl.rollout.native.families.llama import Llama


@FAMILIES.register("seed_oss")
class SeedOss(Llama):
    def variants(self, config) -> dict:
        return {
            "qkv_bias": bool(getattr(config, "attention_bias", False)),
            "o_bias": bool(getattr(config, "attention_out_bias", False)),
            "qk_norm": False,
        }
