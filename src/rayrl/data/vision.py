"""A vision-language model's image processor, loaded from its directory, and what it
makes of a prompt with images: the token ids, placeholders expanded, and the pixel inputs.

Two kinds, one contract (`VisionProcessor`):
- `FullProcessor`, the model's own processor (`AutoProcessor`), used where torchvision
  imports: it renders nothing itself, it expands the placeholders and makes the pixel
  inputs of any family transformers knows (the GPU machines).
- `PilProcessor`, used without torchvision (transformers 5.17 builds Qwen2.5-VL's
  processor and its fast image processor only with it): the checkpoint's
  `preprocessor_config.json` loaded into the PIL image processor of its type (Qwen2-VL's,
  which Qwen2.5-VL and Qwen3-VL use too), the tokenizer, and the expansion those
  processors do, each image token the chat template rendered (`<|image_pad|>`) becoming
  grid_t * grid_h * grid_w // merge_size**2 copies of itself. At load it counts an image's
  tokens from its size with the image processor's own rule (no pixels are made).

Pixel bounds, last one wins: the processor config's min/max pixels (`size.shortest_edge`
/ `longest_edge`, or the older top-level `min_pixels` / `max_pixels`); `min_pixels` /
`max_pixels` in `data.mm_processor_kwargs` (verl's key; its other entries go to the
processor call as they are); an image entry's own (`rayrl.data.images.ImageBounds`),
which resize that image first, on the processor's grid, as verl's vision utilities do.

The pixel inputs of a prompt are a dict of tensors, `pixel_values` (its images' patches)
and `image_grid_thw` (one row per image), plus whatever else the full processor makes
for images: `rayrl.data.dataset` keeps one such dict per row.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch

from rayrl.data.errors import DataError
from rayrl.data.images import ImageBounds, ImageEntryError, require_pillow

IMAGE_TOKEN = "<|image_pad|>"  # the Qwen-VL placeholder, when a tokenizer names none
TEXT_OUTPUTS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")
BACKENDS = ("auto", "processor", "pil")


class PromptImageError(ValueError):
    """A prompt whose images the processor cannot take; the message is the reason, for
    the row set aside."""


class VisionProcessor(ABC):
    """Token ids and pixel inputs of prompts with images (module docstring)."""

    backend = ""

    def __init__(
        self, tokenizer: Any, image_processor: Any, options: dict[str, Any] | None
    ) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.merge_size = int(getattr(image_processor, "merge_size", 1) or 1)
        patch = getattr(image_processor, "patch_size", None)
        self.factor = int(patch) * self.merge_size if patch else None
        self.options = _pixel_options(image_processor, dict(options or {}))
        self.image_token = str(getattr(tokenizer, "image_token", None) or IMAGE_TOKEN)
        self.image_token_id = _token_id(tokenizer, self.image_token)

    @property
    def min_pixels(self) -> int:
        return int(self.options["min_pixels"])

    @property
    def max_pixels(self) -> int:
        return int(self.options["max_pixels"])

    def prepare(self, image: Any, bounds: ImageBounds) -> Any:
        """The image the processor gets: resized first to its own bounds, where it has any."""
        if bounds == ImageBounds():
            return image
        if self.factor is None:
            raise ImageEntryError(
                "sets its own min_pixels/max_pixels, which this image processor (no "
                "patch grid) cannot apply"
            )
        low = bounds.min_pixels or self.min_pixels
        high = bounds.max_pixels or self.max_pixels
        height, width = _grid_size(image.height, image.width, self.factor, low, high)
        if (height, width) == (image.height, image.width):
            return image
        return image.resize((width, height), require_pillow().Resampling.BICUBIC)

    @abstractmethod
    def encode(self, text: str, images: list[Any]) -> list[int]:
        """The prompt's token ids, each image's placeholder expanded (at load)."""

    @abstractmethod
    def inputs(self, text: str, images: list[Any]) -> tuple[list[int], dict[str, torch.Tensor]]:
        """The prompt's token ids and its pixel inputs (when a batch is made)."""

    def image_tokens(self, ids: list[int]) -> int:
        """How many of `ids` are image tokens."""
        return sum(1 for token in ids if token == self.image_token_id)


class PilProcessor(VisionProcessor):
    """The PIL image processor, the tokenizer and the Qwen-VL expansion (module docstring)."""

    backend = "pil"

    def encode(self, text: str, images: list[Any]) -> list[int]:
        bounds = {"min_pixels": self.min_pixels, "max_pixels": self.max_pixels}
        counts = []
        for k, image in enumerate(images):
            try:
                patches = self.image_processor.get_number_of_image_patches(
                    image.height, image.width, bounds
                )
            except ValueError as err:  # e.g. an aspect ratio the resize rule refuses
                raise PromptImageError(
                    f"image {k} cannot be resized for the model: {err}"
                ) from None
            counts.append(int(patches) // self.merge_size**2)
        return self._expanded(text, counts)

    def inputs(self, text: str, images: list[Any]) -> tuple[list[int], dict[str, torch.Tensor]]:
        out = self.image_processor(images, return_tensors="pt", **self.options)
        grid = out["image_grid_thw"]
        counts = (grid.prod(-1) // self.merge_size**2).tolist()
        pixels = {"pixel_values": out["pixel_values"], "image_grid_thw": grid}
        return self._expanded(text, counts), pixels

    def _expanded(self, text: str, counts: list[int]) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return expand_image_tokens(ids, self.image_token_id, counts, self.image_token)


class FullProcessor(VisionProcessor):
    """The model's own processor (`AutoProcessor`): its expansion, its pixel inputs."""

    backend = "processor"

    def __init__(self, processor: Any, tokenizer: Any, options: dict[str, Any] | None) -> None:
        processor.tokenizer = tokenizer  # one tokenizer: the run's (its chat template too)
        super().__init__(tokenizer, processor.image_processor, options)
        self.processor = processor
        self.image_token = str(getattr(processor, "image_token", None) or self.image_token)
        self.image_token_id = _token_id(tokenizer, self.image_token)

    def encode(self, text: str, images: list[Any]) -> list[int]:
        return self.inputs(text, images)[0]

    def inputs(self, text: str, images: list[Any]) -> tuple[list[int], dict[str, torch.Tensor]]:
        try:
            out = self.processor(text=[text], images=images, return_tensors="pt", **self.options)
        except ValueError as err:
            raise PromptImageError(f"the model's processor refused the prompt: {err}") from None
        ids = [int(t) for t in out["input_ids"][0].tolist()]
        if self.image_tokens(ids) == 0 and images:
            raise PromptImageError(
                f"the chat template rendered no {self.image_token} for the prompt's "
                f"{len(images)} image(s); it must render one per image entry"
            )
        return ids, {k: v for k, v in out.items() if k not in TEXT_OUTPUTS}


def expand_image_tokens(ids: list[int], token_id: int, counts: list[int], token: str) -> list[int]:
    """`ids` with the k-th image token repeated `counts[k]` times; a PromptImageError
    when the template rendered another number of image tokens than there are images."""
    found = sum(1 for t in ids if t == token_id)
    if found != len(counts):
        raise PromptImageError(
            f"the chat template rendered {found} {token} for the prompt's {len(counts)} "
            "image(s); it must render one per image entry"
        )
    out: list[int] = []
    pending = iter(counts)
    for t in ids:
        out.extend([t] * next(pending) if t == token_id else [t])
    return out


def load_vision_processor(
    model_dir: str | Path,
    tokenizer: Any,
    *,
    mm_processor_kwargs: dict[str, Any] | None = None,
    backend: str = "auto",
) -> VisionProcessor:
    """The image processor of the model directory `model_dir`: the full processor where
    torchvision imports (`backend="auto"`), else the PIL one; `backend` = "processor" or
    "pil" picks one. A DataError names the directory when it has no image processor."""
    require_pillow()
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; choose one of {', '.join(BACKENDS)}")
    config = Path(model_dir) / "preprocessor_config.json"
    if not config.is_file():
        raise DataError(
            f"{model_dir} has no preprocessor_config.json, so no image processor: rows with "
            "images need a vision-language model's directory (its processor files included)"
        )
    if backend == "processor" or (backend == "auto" and torchvision_imports()):
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(str(model_dir))
        if getattr(processor, "image_processor", None) is None:
            raise DataError(f"{model_dir}: AutoProcessor found no image processor there")
        return FullProcessor(processor, tokenizer, mm_processor_kwargs)
    return PilProcessor(tokenizer, _pil_image_processor(config), mm_processor_kwargs)


def torchvision_imports() -> bool:
    """Whether torchvision imports here (a wheel built for another torch fails to)."""
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install raises more than ImportError
        return False
    return True


def _pil_image_processor(config: Path) -> Any:
    """The PIL image processor of the type `config` names (e.g. Qwen2VLImageProcessor's
    Qwen2VLImageProcessorPil), loaded from it."""
    from transformers.models.auto.image_processing_auto import (
        get_image_processor_class_from_name,
    )

    settings = json.loads(config.read_text())
    name = str(settings.get("image_processor_type") or "")
    pil_name = name if name.endswith("Pil") else f"{name}Pil"
    cls = get_image_processor_class_from_name(pil_name) if name else None
    if cls is None or not hasattr(cls, "get_number_of_image_patches"):
        raise DataError(
            f"{config} names image processor {name or 'none'}, which has no PIL counterpart "
            "that counts image tokens; without torchvision rayrl reads the Qwen2-VL "
            "image processor (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): install torchvision to "
            "use this model's own processor"
        )
    # A config with top-level min_pixels/max_pixels and no `size` (as Qwen2.5-VL ships it):
    # transformers 5.17 would write them into the class's own default `size`, for every
    # later processor of the process; a copy takes them instead.
    own = {} if "size" in settings else {"size": dict(cls.size)}
    return cls.from_pretrained(str(config.parent), **own)


def _token_id(tokenizer: Any, token: str) -> int:
    """`token`'s id; a DataError when the tokenizer does not know it as one token."""
    found = tokenizer.convert_tokens_to_ids(token)
    if found is None or found == getattr(tokenizer, "unk_token_id", None):
        raise DataError(
            f"the tokenizer has no image token {token}: give the vision-language model's "
            "own tokenizer (actor_rollout_ref.model.tokenizer_path), which has it"
        )
    return int(found)


def _pixel_options(image_processor: Any, options: dict[str, Any]) -> dict[str, Any]:
    """The processor call's options: `options` with min_pixels and max_pixels both set
    (the processor's own where `options` has none; transformers applies them only together)."""
    size = getattr(image_processor, "size", None)
    own = {
        "min_pixels": getattr(size, "shortest_edge", None)
        or getattr(image_processor, "min_pixels", None),
        "max_pixels": getattr(size, "longest_edge", None)
        or getattr(image_processor, "max_pixels", None),
    }
    for key, value in own.items():
        if options.get(key) is None:
            if value is None:
                raise DataError(
                    f"the image processor sets no {key}; give it in data.mm_processor_kwargs"
                )
            options[key] = int(value)
    if options["min_pixels"] > options["max_pixels"]:
        raise DataError(
            f"min_pixels={options['min_pixels']} is over max_pixels={options['max_pixels']} "
            "(the processor config and data.mm_processor_kwargs together)"
        )
    return options


def _grid_size(height: int, width: int, factor: int, low: int, high: int) -> tuple[int, int]:
    """(height, width) resized to multiples of `factor` within [low, high] pixels, by the
    image processor's own rule."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    try:
        resized: tuple[int, int] = smart_resize(
            height, width, factor=factor, min_pixels=low, max_pixels=high
        )
    except ValueError as err:
        raise ImageEntryError(f"cannot be resized for the model: {err}") from None
    return resized
