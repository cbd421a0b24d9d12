"""A row's image entries opened as RGB images, in the forms verl's datasets store them.

An entry of the image column (`data.image_key`, `images` by default) is one of:
- the image file's bytes (Parquet `binary`);
- a file path, absolute or relative to the data file's folder (`file://` allowed), or a
  `data:image/...;base64,` URI;
- a dict as Hugging Face `datasets` stores an `Image` feature, `{"bytes": ..., "path":
  ...}` (bytes win when both are set), or as verl's rows hold one, `{"image": ...}` with
  any of the above inside; a dict may also carry verl's per-image `min_pixels` and
  `max_pixels` (`ImageBounds`);
- a PIL image (rows built in memory).

Each image is decoded in full when it is opened, so a truncated file fails here, with
the reason, not later in a batch. Images with transparency are laid on white before
they lose their alpha channel, as verl's vision utilities do; every other mode is
converted to RGB. Pillow is the optional extra `vision`; without it `require_pillow`
says how to install it. No image is fetched over the network.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VISION_EXTRA = "pip install 'rayrl[vision]'"
URL_PREFIXES = ("http://", "https://")


class ImageEntryError(ValueError):
    """An image entry that cannot be used; the message is the reason, for the row set aside."""


@dataclass(frozen=True)
class ImageBounds:
    """An image's own pixel bounds (verl's per-image `min_pixels` / `max_pixels`); None
    where the entry sets none and the processor's bound applies."""

    min_pixels: int | None = None
    max_pixels: int | None = None


def require_pillow() -> Any:
    """The `PIL.Image` module, or an ImportError saying which extra installs it."""
    try:
        from PIL import Image
    except ImportError as exc:
        raise ImportError(
            f"reading images needs Pillow, which is not installed: {VISION_EXTRA}"
        ) from exc
    return Image


def open_image(entry: object, base_dir: Path) -> tuple[Any, ImageBounds]:
    """The RGB image an entry holds, decoded in full, and its own pixel bounds; an
    ImageEntryError with the reason when it holds none. Relative paths are read from
    `base_dir` (the data file's folder)."""
    pil = require_pillow()
    bounds = ImageBounds()
    if isinstance(entry, dict):
        bounds = _bounds_of(entry)
        entry = _dict_payload(entry)
    if isinstance(entry, pil.Image):
        return _rgb(entry), bounds
    if isinstance(entry, bytes | bytearray | memoryview):
        return _decode(bytes(entry), f"{len(entry)} bytes"), bounds
    if isinstance(entry, str) and entry.startswith("data:"):
        return _decode(_data_uri(entry), "a data: URI"), bounds
    if isinstance(entry, str | os.PathLike):
        path = _local_path(entry, base_dir)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise ImageEntryError(f"names file {path}, which does not exist") from None
        except OSError as err:
            raise ImageEntryError(
                f"names file {path}, which cannot be read ({err.strerror})"
            ) from None
        return _decode(data, f"file {path}"), bounds
    raise ImageEntryError(
        f"is a {type(entry).__name__}, not image bytes, a file path or a dict of them "
        "({'bytes': ...} or {'path': ...})"
    )


def _dict_payload(entry: dict[str, Any]) -> object:
    """What an image dict holds: `image`, else `bytes`, else `path`."""
    for key in ("image", "bytes", "path"):
        if entry.get(key) is not None:
            return entry[key]
    raise ImageEntryError(
        f"is a dict with no image in it (keys: {', '.join(map(str, entry)) or 'none'}); "
        "give 'bytes', 'path' or 'image'"
    )


def _bounds_of(entry: dict[str, Any]) -> ImageBounds:
    values = {}
    for key in ("min_pixels", "max_pixels"):
        value = entry.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 1:
            raise ImageEntryError(f"has {key}={value!r}; give a positive number of pixels")
        values[key] = int(value)
    return ImageBounds(**values)


def _local_path(entry: str | os.PathLike[str], base_dir: Path) -> Path:
    text = os.fspath(entry)
    if text.startswith(URL_PREFIXES):
        raise ImageEntryError(
            f"is a URL ({text[:80]}); rayrl reads images from bytes or local files only: "
            "download the images and give their paths"
        )
    path = Path(text.removeprefix("file://")).expanduser()
    return path if path.is_absolute() else base_dir / path


def _data_uri(text: str) -> bytes:
    head, _, payload = text.partition(",")
    if not head.endswith(";base64"):
        raise ImageEntryError(f"is a data: URI that is not base64 ({head[:40]})")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageEntryError("is a data: URI whose base64 payload does not decode") from None


def _decode(data: bytes, what: str) -> Any:
    pil = require_pillow()
    try:
        image = pil.open(io.BytesIO(data))
        image.load()
    except pil.UnidentifiedImageError:
        raise ImageEntryError(f"is not in an image format Pillow can decode ({what})") from None
    except Exception as err:  # noqa: BLE001 - Pillow raises many kinds for broken files
        raise ImageEntryError(f"failed to decode ({what}): {type(err).__name__}: {err}") from None
    return _rgb(image)


def _rgb(image: Any) -> Any:
    """`image` in RGB; transparent pixels become white, as verl's vision utilities make them."""
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        pil = require_pillow()
        rgba = image.convert("RGBA")
        white = pil.new("RGBA", rgba.size, (255, 255, 255, 255))
        return pil.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")
