"""The images of a prompt row, as verl's datasets hold them: a column of entries and
`<image>` placeholders in the prompt's messages.

The image column (`data.image_key`, `images` by default) holds a list of entries
(`rayrl.data.images`), one per `<image>` in the text of the prompt's messages, in order.
A message whose content has placeholders becomes, for the chat template, a list of
parts: `{"type": "text", "text": ...}` and `{"type": "image"}` where each `<image>` was,
as verl builds them (messages with no placeholder keep their string). A row with no
images is a text prompt, `<image>` in its text included (verl leaves it as text too).

A row is set aside, with the reason, when its images cannot be used: the count of
entries and of placeholders differ, an entry does not decode (`images.open_image`), the
prompts are read without an image processor (a text-only model), or it has videos (the
column `data.video_key`, `videos` by default): rayrl does not read videos yet.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rayrl.data.errors import DataError
from rayrl.data.images import ImageEntryError, open_image
from rayrl.data.vision import PromptImageError, VisionProcessor

IMAGE = "<image>"
VIDEO = "<video>"
_PLACEHOLDER = re.compile(f"({re.escape(IMAGE)})")


class RowImageError(ValueError):
    """A row whose images cannot be used; the message is the reason it is set aside."""


class PromptImages:
    """The image side of prompt rows: their entries, their messages for the chat
    template, their token ids and pixel inputs through `vision` (None: text prompts
    only, and a row with images is set aside)."""

    def __init__(
        self,
        vision: VisionProcessor | None = None,
        image_key: str = "images",
        video_key: str = "videos",
    ) -> None:
        self.vision = vision
        self.image_key = image_key
        self.video_key = video_key

    def entries(self, row: dict[str, Any]) -> list[Any]:
        """The row's image entries (none when the column is missing or null)."""
        return _column(row, self.image_key)

    def problem(self, row: dict[str, Any], prompt_key: str) -> str | None:
        """Why the row's media cannot be read, or None (also for a row without images)."""
        try:
            videos, images = _column(row, self.video_key), self.entries(row)
        except RowImageError as err:
            return str(err)
        if videos:
            return (
                f"the row has {len(videos)} video(s) in column '{self.video_key}', and rayrl "
                "reads no videos yet (images only); set the row's videos aside or drop them"
            )
        if not images:
            return None
        if self.vision is None:
            return (
                f"the row has {len(images)} image(s) in column '{self.image_key}', but the "
                "prompts are read without an image processor (a text-only model); use a "
                "vision-language model, or drop the images (data.image_key names the column)"
            )
        placed = sum(_text(m).count(IMAGE) for m in row[prompt_key])
        if placed != len(images):
            return (
                f"the row has {len(images)} image(s) in column '{self.image_key}' but "
                f"{placed} {IMAGE} placeholder(s) in '{prompt_key}'; put one {IMAGE} in the "
                "messages' text where each image goes"
            )
        return None

    def messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages for the chat template: each `<image>` an image part (module docstring)."""
        out = []
        for message in messages:
            text = _text(message)
            if IMAGE not in text:
                out.append(message)
                continue
            parts = [p for p in _PLACEHOLDER.split(text) if p]
            content = [
                {"type": "image"} if p == IMAGE else {"type": "text", "text": p} for p in parts
            ]
            out.append({**message, "content": content})
        return out

    def open(self, row: dict[str, Any], base_dir: Path) -> list[Any]:
        """The row's images as the processor gets them; a RowImageError names the first
        entry that cannot be used and why."""
        vision = self._vision()
        images = []
        for k, entry in enumerate(self.entries(row)):
            try:
                image, bounds = open_image(entry, base_dir)
                images.append(vision.prepare(image, bounds))
            except ImageEntryError as err:
                raise RowImageError(f"image {k} in column '{self.image_key}' {err}") from None
        return images

    def encode(self, text: str, row: dict[str, Any], base_dir: Path) -> list[int]:
        """The token ids of the row's rendered prompt `text`, placeholders expanded."""
        images = self.open(row, base_dir)
        try:
            return self._vision().encode(text, images)
        except PromptImageError as err:
            raise RowImageError(str(err)) from None

    def inputs(
        self, text: str, row: dict[str, Any], base_dir: Path
    ) -> tuple[list[int], dict[str, torch.Tensor]]:
        """The token ids and pixel inputs of the row's rendered prompt `text`."""
        images = self.open(row, base_dir)
        try:
            return self._vision().inputs(text, images)
        except PromptImageError as err:
            raise RowImageError(str(err)) from None

    def pixel_inputs(
        self, text: str, row: dict[str, Any], base_dir: Path, ids: list[int], where: str
    ) -> dict[str, torch.Tensor]:
        """The pixel inputs of a row read at load as `ids` (its rendered prompt `text`),
        made now; a DataError names the row when its images no longer give those ids."""
        try:
            now, inputs = self.inputs(text, row, base_dir)
        except RowImageError as err:
            raise DataError(
                f"{where}: {err} (it read well at load: did its files change?)"
            ) from None
        if now != ids:
            raise DataError(
                f"{where}: its images give other prompt ids now ({len(now)} tokens) than at "
                f"load ({len(ids)}); were its image files changed during the run?"
            )
        return inputs

    def image_tokens(self, ids: list[int]) -> int:
        """How many of a prompt's `ids` are its images' tokens."""
        return self._vision().image_tokens(ids)

    def _vision(self) -> VisionProcessor:
        if self.vision is None:
            raise RuntimeError("PromptImages reads images only with a vision processor")
        return self.vision


def _column(row: dict[str, Any], key: str) -> list[Any]:
    value = row.get(key)
    if value is None:
        return []
    if isinstance(value, list | tuple | np.ndarray):
        return list(value)
    raise RowImageError(
        f"column '{key}' holds a {type(value).__name__}, not a list of entries (one per "
        "placeholder)"
    )


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else ""
