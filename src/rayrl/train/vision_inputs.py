"""Images in the training engine's forwards: a micro-batch's pixels beside its token
stream, spliced into its prompts' image placeholders inside the model's own forward,
with the M-RoPE positions the model computes.

The actor's and reference's passes run the exact token stream a sample was generated
as (prompt + response); a row's images, its ``multi_modal_inputs`` (`pixel_values`,
`image_grid_thw`), travel beside it (`rayrl.data.dataset`). Per micro-batch
(`image_inputs`):

- the rows' images concatenated in row order (`rayrl.models.vision_language.stack_images`):
  the order of their placeholders in the flattened ids, the order the model's vision
  tower and its position rule read them in;
- the placeholders: the image tokens of the *prompts*, and in a multi-turn episode's
  response the columns its observations' images were appended at (the row's
  ``multi_modal_inputs`` name them: `rayrl.models.vision_language.RESPONSE_IMAGES`;
  their images follow the prompt's in the row's pixels). A response may hold a
  sampled ``<|image_pad|>`` (a random tiny policy draws one now and then): generation
  fed it to the model as a token, so the training forward does too (transformers' own
  forward would count it as an image's and refuse the micro-batch);
- the positions: the model's ``get_rope_index`` over prompt and response, the prompts'
  placeholders marked as image tokens, so that a response's positions continue from its
  prompt's last one as generation's did: ``[3, b, L]`` for padded rows; for a packed
  row ``[4, 1, T]``, each sequence's own, under a first row of text positions that
  restart per sequence (the layout transformers takes for packed M-RoPE rows).

`install_image_splice` registers a forward pre-hook on the model's multimodal core
(`rayrl.models.vision_language.multimodal_core`). Handed an `ImageSplice` under the
keyword `SPLICE_KEY`, it embeds the ids, runs the vision tower once on the micro-batch's
pixels, puts the features at the placeholders, and passes the embeddings on in place of
the ids; without one (generation, a text micro-batch) the model runs its own path. It
runs inside the root's forward, on the parameters FSDP2 gathered for it. On a sharded
engine every micro-batch runs the vision tower (the tower's FSDP units gather on every
rank alike): one without images runs it on a blank image, its output added times zero.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from rayrl.batch import Batch
from rayrl.models.vision_language import (
    IMAGE_COLUMN,
    RESPONSE_IMAGES,
    image_features,
    multimodal_core,
    rope_index,
    splice_image_features,
    stack_images,
)

__all__ = [
    "IMAGE_COLUMN",
    "SPLICE_KEY",
    "ImageSplice",
    "VisionModel",
    "image_inputs",
    "install_image_splice",
    "packed_image_inputs",
]

SPLICE_KEY = "rayrl_images"  # the forward keyword the splice hook takes (and removes)


@dataclass
class ImageSplice:
    """A forward's images for the splice hook: pixels and grids in placeholder order,
    and where the placeholders are (bool, shaped like the forward's ``input_ids``).
    ``blank``: no images, run the tower on a blank one (a sharded engine)."""

    pixel_values: Tensor | None
    image_grid_thw: Tensor | None
    placeholders: Tensor
    blank: bool = False

    def to(self, device: torch.device) -> ImageSplice:
        move: Callable[[Tensor | None], Tensor | None] = (  # noqa: E731
            lambda t: None if t is None else t.to(device, non_blocking=True)
        )
        return ImageSplice(
            move(self.pixel_values), move(self.image_grid_thw), move(self.placeholders), self.blank
        )


@dataclass(frozen=True)
class VisionModel:
    """What the engine knows of a vision-language model's images: its multimodal core,
    its image token, and whether every micro-batch runs the tower (``sharded``)."""

    core: nn.Module
    image_token_id: int
    sharded: bool

    @classmethod
    def of(cls, model: nn.Module, sharded: bool) -> VisionModel | None:
        """None for a text-only model."""
        core = multimodal_core(model)
        if core is None:
            return None
        return cls(core, int(core.config.image_token_id), sharded)


@dataclass
class ImageInputs:
    """A padded micro-batch's image side: positions ``[3, b, L]`` and the splice."""

    position_ids: Tensor
    splice: ImageSplice


def image_inputs(vision: VisionModel, micro: Batch, response_len: int) -> ImageInputs | None:
    """The image side of a padded micro-batch (module docstring); None when it has no
    images and the engine need not run the tower (text rows take the text path)."""
    ids, mask = micro["input_ids"], micro["attention_mask"].bool()
    rows = micro[IMAGE_COLUMN] if IMAGE_COLUMN in micro else [None] * len(micro)
    images = stack_images(rows)
    if images is None:
        if not vision.sharded:
            return None
        blank = ImageSplice(None, None, torch.zeros_like(mask), blank=True)
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0) * mask
        return ImageInputs(positions.unsqueeze(0).expand(3, -1, -1), blank)
    placeable = torch.zeros_like(mask)  # the prompts, and the observations' image columns
    start = ids.shape[1] - response_len
    placeable[:, :start] = True
    for row, inputs in enumerate(rows):
        columns = (inputs or {}).get(RESPONSE_IMAGES)
        if columns is not None and len(columns):
            placeable[row, start + torch.as_tensor(columns, dtype=torch.long)] = True
    placeholders = (ids == vision.image_token_id) & mask & placeable
    _check_counts(vision, placeholders, images["image_grid_thw"])
    positions, _ = rope_index(vision.core, ids, placeholders, images["image_grid_thw"], mask.long())
    splice = ImageSplice(images["pixel_values"], images["image_grid_thw"], placeholders)
    return ImageInputs(positions, splice)


def packed_image_inputs(
    found: ImageInputs, attention_mask: Tensor, text_positions: Tensor
) -> ImageInputs:
    """`image_inputs` of a micro-batch packed into one row (`rayrl.train.packing`: the
    rows' real tokens in row order): positions ``[4, 1, T]`` (``text_positions``, the
    packed row's restarting ones, first) and the placeholders ``[1, T]``."""
    real = attention_mask.bool()
    mrope = found.position_ids[:, real].unsqueeze(1)
    positions = torch.cat([text_positions.reshape(1, 1, -1).to(mrope.dtype), mrope])
    s = found.splice
    splice = ImageSplice(s.pixel_values, s.image_grid_thw, s.placeholders[real][None], s.blank)
    return ImageInputs(positions, splice)


def _check_counts(vision: VisionModel, placeholders: Tensor, grid: Tensor) -> None:
    merge = int(vision.core.config.vision_config.spatial_merge_size)
    features = int(grid.prod(-1).sum()) // merge**2
    found = int(placeholders.sum())
    if found != features:
        raise ValueError(
            f"the micro-batch's prompts hold {found} image placeholder tokens but their "
            f"images make {features} features: a row's multi_modal_inputs are not the "
            "images its prompt ids were made with (were the rows cut or reordered apart "
            "from that column?)"
        )


# ------------------------------------------------------------------ the splice hook
def install_image_splice(model: nn.Module) -> RemovableHandle | None:
    """Register the splice hook (module docstring) on ``model``'s multimodal core; None
    for a text-only model."""
    core = multimodal_core(model)
    if core is None:
        return None
    return core.register_forward_pre_hook(_splice, with_kwargs=True)


def _splice(
    core: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The core's inputs with the images spliced in (module docstring)."""
    request: ImageSplice | None = kwargs.pop(SPLICE_KEY, None)
    if request is None:
        return None
    ids = kwargs.pop("input_ids", None)
    if ids is None and args:
        ids, args = args[0], args[1:]
    if request.blank:
        embeds = core.get_input_embeddings()(ids)
        features = image_features(core, *_blank_image(core, embeds))
        embeds = embeds + features.sum() * 0.0  # the tower ran; nothing of it is used
    else:
        assert request.pixel_values is not None and request.image_grid_thw is not None
        embeds = splice_image_features(
            core, ids, request.pixel_values, request.image_grid_thw, request.placeholders
        )
    kwargs.update(input_ids=None, inputs_embeds=embeds, pixel_values=None, image_grid_thw=None)
    return args, kwargs


def _blank_image(core: nn.Module, like: Tensor) -> tuple[Tensor, Tensor]:
    """The smallest image the tower takes (one merged token), all zeros, and its grid."""
    v = core.config.vision_config
    merge = int(v.spatial_merge_size)
    width = int(v.in_channels) * int(v.temporal_patch_size) * int(v.patch_size) ** 2
    pixels = torch.zeros(merge * merge, width, dtype=like.dtype, device=like.device)
    grid = torch.tensor([[1, merge, merge]], device=like.device)
    return pixels, grid
