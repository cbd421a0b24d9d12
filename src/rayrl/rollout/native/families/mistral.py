"""Mistral (7B v0.1 to v0.3, Nemo, Small): Llama's layer; a config's ``sliding_window``
(v0.1: 4096) limits every layer's attention to that many last tokens."""

from rayrl.rollout.native.families.base import FAMILIES, sliding_windows
from rayrl.rollout.native.families.llama import Llama


@FAMILIES.register("mistral")
class Mistral(Llama):
    def variants(self, config) -> dict:
        return {**super().variants(config), "windows": sliding_windows(config)}
