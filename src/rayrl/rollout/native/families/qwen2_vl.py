"""Qwen2-VL and Qwen2.5-VL: the language model of the vision-language model, a Qwen2
decoder (`text_config`), whose rotary positions have three axes (M-RoPE: time, height,
width, each rotating its ``mrope_section`` of a head's frequencies).

The vision tower is not the family's: the engine runs transformers' own
(`rayrl.rollout.native.vision`). The weights are transformers' names, in memory
(``model.language_model.layers.N...``) and on disk (``model.layers.N...``): the
engine's `vision.VisionEncoder` maps the first onto the second. A text token's three
positions are equal, and then the rotation is the one-axis table's, which the decode
steps (and CUDA graphs) use at ``position + rope_delta``; `mrope_rotary` is the
model's own rotary module, which gives a prefill with images its per-token tables.
"""

from __future__ import annotations

import dataclasses
import importlib

import torch
from torch import Tensor, nn

from rayrl.rollout.native.families.base import FAMILIES, check_longrope
from rayrl.rollout.native.families.qwen2 import Qwen2
from rayrl.rollout.native.spec import ModelSpec

__all__ = ["Qwen2VL", "Qwen25VL"]


@FAMILIES.register("qwen2_vl")
class Qwen2VL(Qwen2):
    modeling = "transformers.models.qwen2_vl.modeling_qwen2_vl"
    rotary_name = "Qwen2VLRotaryEmbedding"

    def read(self, config) -> ModelSpec:
        """The language model's spec (`text_config`), M-RoPE on; the tying of the
        embeddings is the outer config's."""
        text = config.text_config
        spec = super().read(text)
        tied = getattr(config, "tie_word_embeddings", None)
        if tied is None:
            tied = getattr(text, "tie_word_embeddings", False)
        return dataclasses.replace(
            spec, model_type=config.model_type, tie_embeddings=bool(tied), mrope=True
        )

    def problems(self, config) -> list[str]:
        problems = super().problems(config)
        params = getattr(config, "rope_parameters", None) or {}
        if "mrope_section" not in params:
            problems.append("rope parameters without mrope_section")
        return problems

    def mrope_rotary(self, config, device) -> nn.Module:
        """transformers' rotary module of the language model: ``(x, positions [3, b, T])
        -> cos, sin [b, T, dims]``."""
        module = importlib.import_module(self.modeling)
        return getattr(module, self.rotary_name)(config.text_config).to(device)

    def rotary(self, config, max_positions: int, device) -> tuple[Tensor, Tensor]:
        """One table ``[1, max_positions, dims]``: a text token's rotation, its three
        positions equal (`mrope_rotary` at ``[p, p, p]``)."""
        check_longrope(config.text_config, max_positions)
        rotary = self.mrope_rotary(config, "cpu")
        positions = torch.arange(max_positions, dtype=torch.int64)[None, None].expand(3, 1, -1)
        with torch.no_grad():
            cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
        return cos.to(device).contiguous(), sin.to(device).contiguous()


@FAMILIES.register("qwen2_5_vl")
class Qwen25VL(Qwen2VL):
    modeling = "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl"
    rotary_name = "Qwen2_5_VLRotaryEmbedding"
