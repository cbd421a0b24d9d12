"""Ministral (8B): Mistral's layer, with sliding windows on the layers ``layer_types``
names (`sliding_windows` reads them)."""

from rayrl.rollout.native.families.base import FAMILIES
from rayrl.rollout.native.families.mistral import Mistral


@FAMILIES.register("ministral")
class Ministral(Mistral):
    pass
