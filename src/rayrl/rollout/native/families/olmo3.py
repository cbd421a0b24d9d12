"""OLMo 3: OLMo 2's layer with sliding windows on the layers ``layer_types`` names (three
of every four), each layer type with its rotary table (`Family.rotary`)."""

from rayrl.rollout.native.families.base import FAMILIES, sliding_windows
from rayrl.rollout.native.families.olmo2 import Olmo2


@FAMILIES.register("olmo3")
class Olmo3(Olmo2):
    def variants(self, config) -> dict:
        return {**super().variants(config), "windows": sliding_windows(config)}
