"""Vision-language models: how rayrl tells one from a text-only model, which of them it
runs, the transformers class that builds one, and the pieces of one the layers above read.

A model is vision-language when its config has a vision tower (`vision_config`, as
Qwen2-VL, Qwen2.5-VL and Qwen3-VL have). rayrl rolls out and trains the families of
`SUPPORTED`: a multimodal core (``model.model``) that owns the vision tower
(``visual``), the language model, ``get_image_features`` and ``get_rope_index``
(M-RoPE positions from ``mm_token_type_ids``). Qwen3-VL feeds its vision features to
several decoder layers (deepstack), which the training engine's splice of image
features (`rayrl.train.vision_inputs`) does not do: it is refused, named.

transformers builds such a model with ``AutoModelForImageTextToText``
(``AutoModelForCausalLM`` does not map it), `causal_lm_class`. A row's images travel as
its ``multi_modal_inputs`` (`rayrl.data.dataset`); `stack_images` concatenates those of
several rows, in row order, as the model takes them. The row of a multi-turn episode also
holds the images its observations showed (after the prompt's, in order) and, under
`RESPONSE_IMAGES`, the response columns of their placeholder tokens (a sampled image
token is no placeholder: only these columns of a response are).
`splice_image_features` puts an image's vision features at its placeholders.

A leaf module: it imports no transformers model class at import, and of rayrl only
`rayrl.model_dirs` (what a model directory's config.json says, which the config checks
read too).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from rayrl.model_dirs import is_vision_language, local_config

__all__ = [
    "IMAGE_COLUMN",
    "IMAGE_INPUTS",
    "PROCESSOR_FILES",
    "RESPONSE_IMAGES",
    "SUPPORTED",
    "causal_lm_class",
    "copy_processor_files",
    "image_features",
    "is_vision_language",
    "local_config",
    "multimodal_core",
    "rope_index",
    "splice_image_features",
    "stack_images",
    "unsupported_reason",
    "vision_tower",
]

IMAGE_COLUMN = "multi_modal_inputs"  # a Batch's non-tensor column of each row's images

# model_type -> family name, for the messages
SUPPORTED = {"qwen2_5_vl": "Qwen2.5-VL", "qwen2_vl": "Qwen2-VL"}
UNSUPPORTED = {
    "qwen3_vl": "its vision features also enter several decoder layers (deepstack), "
    "which rayrl's training forward does not feed yet",
    "qwen3_vl_moe": "its vision features also enter several decoder layers (deepstack), "
    "which rayrl's training forward does not feed yet",
}
# What a row's multi_modal_inputs hold for the supported families (images only)
IMAGE_INPUTS = ("pixel_values", "image_grid_thw")
# A multi-turn row's response columns holding its observations' image placeholders
RESPONSE_IMAGES = "response_image_columns"
# A model directory's processor files: an export carries them beside the tokenizer
PROCESSOR_FILES = (
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "chat_template.json",
)


def unsupported_reason(config: Any) -> str | None:
    """Why rayrl cannot roll out and train this vision-language model, or None."""
    model_type = (
        config.get("model_type") if isinstance(config, Mapping) else config.model_type
    ) or "?"
    if model_type in SUPPORTED:
        return None
    families = ", ".join(SUPPORTED.values())
    why = UNSUPPORTED.get(model_type, "its vision inputs are not wired into rayrl's training")
    return f"model_type {model_type!r} is not one rayrl trains yet ({why}); it trains {families}"


def causal_lm_class(config: Any) -> Any:
    """The transformers auto class that builds ``config``'s generating model."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM


def multimodal_core(model: nn.Module) -> nn.Module | None:
    """The module that owns the vision tower, ``get_image_features`` and
    ``get_rope_index`` (a Qwen-VL model's ``model.model``; under peft, deeper), or None
    for a text-only model."""
    for module in model.modules():
        if hasattr(module, "visual") and hasattr(module, "get_rope_index"):
            return module
    return None


def vision_tower(model: nn.Module) -> nn.Module | None:
    """The model's vision tower (patch embedding, blocks and merger), or None."""
    core = multimodal_core(model)
    return None if core is None else core.visual


def image_features(core: nn.Module, pixel_values: Tensor, grid: Tensor) -> Tensor:
    """The vision tower's merged features of every image, in order: ``[tokens, hidden]``
    (the multimodal ``core``'s own ``get_image_features``: patch embedding, blocks,
    merger)."""
    return torch.cat(core.get_image_features(pixel_values, grid).pooler_output)


def rope_index(
    core: nn.Module,
    ids: Tensor,
    placeholders: Tensor,
    grid: Tensor,
    attention_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The model's M-RoPE positions ``[3, b, L]`` of ``ids`` ``[b, L]`` whose image tokens
    are ``placeholders`` (bool, shaped like ``ids``), and each row's ``rope_deltas``
    ``[b, 1]`` (a text token after the sequence sits at its index plus the delta on all
    three axes): the ``core``'s own ``get_rope_index``."""
    positions, deltas = core.get_rope_index(
        ids,
        mm_token_type_ids=placeholders.int(),
        image_grid_thw=grid,
        attention_mask=attention_mask,
    )
    return positions, deltas


def stack_images(rows: Iterable[Mapping[str, Tensor] | None]) -> dict[str, Tensor] | None:
    """The images of ``rows`` (each a row's ``multi_modal_inputs``; empty or None for a
    row without images) as one model input: ``pixel_values`` and ``image_grid_thw``
    concatenated in row order (the order of their placeholders in the flattened ids);
    None when no row has images. A ValueError names an input it cannot take."""
    parts: dict[str, list[Tensor]] = {key: [] for key in IMAGE_INPUTS}
    for i, row in enumerate(rows):
        if not row:
            continue
        extra = sorted(set(row) - {*IMAGE_INPUTS, RESPONSE_IMAGES})
        if extra:
            raise ValueError(
                f"row {i}'s multi_modal_inputs hold {', '.join(extra)} beside "
                f"{', '.join(IMAGE_INPUTS)}: rayrl feeds images only (videos and other "
                "inputs are not read yet)"
            )
        for key in IMAGE_INPUTS:
            parts[key].append(torch.as_tensor(row[key]))
    if not parts["pixel_values"]:
        return None
    return {key: torch.cat(values) for key, values in parts.items()}


def splice_image_features(
    core: nn.Module, ids: Tensor, pixel_values: Tensor, grid: Tensor, placeholders: Tensor
) -> Tensor:
    """The embeddings of ``ids`` with the vision tower's merged features of the images
    (``pixel_values``, ``image_grid_thw`` = ``grid``, in placeholder order) put at the
    ``placeholders`` (bool, shaped like ``ids``), in row-major order."""
    embeds = core.get_input_embeddings()(ids)
    features = image_features(core, pixel_values, grid)
    where = placeholders.unsqueeze(-1).expand_as(embeds)
    return embeds.masked_scatter(where, features.to(embeds.dtype))


def copy_processor_files(
    model_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str]
) -> list[str]:
    """Copy the processor files of `PROCESSOR_FILES` that ``model_dir`` has into
    ``out_dir``; the names copied."""
    copied = []
    for name in PROCESSOR_FILES:
        source = Path(model_dir) / name
        if source.is_file():
            shutil.copyfile(source, Path(out_dir) / name)
            copied.append(name)
    return copied
