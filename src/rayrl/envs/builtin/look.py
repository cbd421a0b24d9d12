"""The ``look`` tool: shows a vision-language model a part of an image, zoomed.

The episode's image comes from the row's ``tools_kwargs.look.create_kwargs.image``: PNG
or JPEG bytes, or ``{"bytes": ...}`` as a row's image column holds them (a
`rayrl.data.synthetic_images` row's image, say); without one the tool looks at a
built-in gradient, so it always has something to show. A call names a ``region``
(``all``, ``left``, ``right``, ``top``, ``bottom``); the answer is that part of the
image, resized to `SIDE` x `SIDE` pixels, with a line of text naming it
(`rayrl.envs.tool.ToolResult` with ``images``): the multi-turn rollout feeds it through
the model's image processor, its placeholder expanded as a prompt's. It needs Pillow
(the ``vision`` extra), as every image does.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

from rayrl.envs.registry import TOOLS
from rayrl.envs.tool import Tool, ToolResult

__all__ = ["Look"]

SIDE = 56  # pixels: four merged patches of a Qwen2.5-VL (28-pixel merged patches)
REGIONS = ("all", "left", "right", "top", "bottom")


@TOOLS.register("look")
class Look(Tool):
    """Shows a region of the episode's image (module docstring)."""

    name = "look"
    description = "Look closer at a region of the image: all, left, right, top or bottom."
    parameters = {
        "type": "object",
        "properties": {
            "region": {
                "type": "string",
                "enum": list(REGIONS),
                "description": "Which part of the image to look at.",
            }
        },
        "required": ["region"],
    }

    def create(self, create_kwargs: Mapping[str, Any]) -> Any:
        """The episode's image (an RGB PIL image)."""
        return _image(create_kwargs.get("image"))

    def execute(self, arguments: dict[str, Any], state: Any) -> ToolResult | str:
        region = str(arguments["region"])
        if region not in REGIONS:
            return f"Error: region {region!r} is not one of {', '.join(REGIONS)}."
        width, height = state.size
        boxes = {
            "all": (0, 0, width, height),
            "left": (0, 0, max(1, width // 2), height),
            "right": (width // 2, 0, width, height),
            "top": (0, 0, width, max(1, height // 2)),
            "bottom": (0, height // 2, width, height),
        }
        crop = state.crop(boxes[region]).resize((SIDE, SIDE))
        return ToolResult(f"the {region} of the image", images=[crop])


def _image(entry: Any) -> Any:
    """An RGB image from an entry (bytes, ``{"bytes": ...}``, a PIL image) or the
    built-in gradient when there is none."""
    from PIL import Image

    if isinstance(entry, Mapping):
        entry = entry.get("bytes")
    if isinstance(entry, bytes | bytearray):
        return Image.open(io.BytesIO(bytes(entry))).convert("RGB")
    if isinstance(entry, Image.Image):
        return entry.convert("RGB")
    if entry is not None:
        raise ValueError(
            f"look: create_kwargs.image is a {type(entry).__name__}; give the image's bytes "
            "or {'bytes': ...} (as a row's image column holds it)"
        )
    pixels = bytearray()
    for y in range(SIDE):
        for x in range(SIDE):
            pixels += bytes((x * 4 % 256, y * 4 % 256, 128))
    return Image.frombytes("RGB", (SIDE, SIDE), bytes(pixels))
