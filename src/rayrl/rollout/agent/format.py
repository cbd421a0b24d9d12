"""The tokens appended between two assistant turns, in the model's own chat format.

After an assistant turn, a multi-turn rollout appends the environment's answer (tool
responses, a user message) and the opening of the next assistant turn, as tokens, to
the very tokens the model sampled: nothing is ever re-tokenised. `TurnFormat` derives
the text around those messages from the tokenizer's chat template, once per shape of
observation (the sequence of roles): it renders a conversation whose assistant and
observation contents are marker strings, with the generation prompt, and cuts the
text after the assistant's marker at the other markers. For Qwen2.5's template and a
tool response, that is ``<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n``,
the response, ``\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n``.

The first piece closes the assistant turn. When the model ended its turn with an EOS
token whose text opens that piece (``<|im_end|>``), that text is dropped: the model
already wrote it. A turn that ended on a stop string instead gets the whole closing.

Each piece and each message's content is tokenised on its own, and a content longer
than the per-message token limit is cut (``left``, ``right`` or ``middle``, verl's
``tool_response_truncate_side``) with a ``(truncated)`` marker, so the limit is exact
in tokens.

A message may show images (a tool's or an environment's observation: content parts
``{"type": "image", "image": <PIL image>}`` beside text parts, as verl's tool responses
with an image). With the model's image processor (``vision``,
`rayrl.data.vision.VisionProcessor`) such a content is rendered as the chat template
renders an image part (the markup derived once from the template, e.g.
``<|vision_start|><|image_pad|><|vision_end|>``) and tokenised by the processor as the
data path does a prompt's: each placeholder expanded to the image's merged patch count,
its pixel inputs made; the observation carries them (`Observation.images`). Such a
content is never cut to the token limit (an image's tokens cannot be).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rayrl.rollout.text_codec import TextCodec
from rayrl.rollout.turns import TurnImages

__all__ = ["Observation", "TurnFormat", "TurnFormatError"]

_ASSISTANT = "RAYRLASSISTANTMARK"
_PROMPT = "RAYRLPROMPTMARK"
_CONTENT = "RAYRLCONTENTMARK{}END"
_BEFORE_IMAGE, _AFTER_IMAGE = "RAYRLBEFOREIMAGE", "RAYRLAFTERIMAGE"
TRUNCATE_SIDES = ("left", "right", "middle")
# Content longer than this many characters per allowed token is cut before tokenising.
_CHARS_PER_TOKEN_BOUND = 16


class TurnFormatError(ValueError):
    """The chat template cannot render the observation messages."""


@dataclass
class Observation:
    """The tokens appended after an assistant turn, and what they show.

    Attributes:
        tokens: every appended token, in order (closing, messages, next turn's opening).
        messages: the messages as the model sees them (contents after truncation).
        truncated: how many messages were cut to the token limit.
        images: the images the messages show, and where their placeholders sit in
            ``tokens`` (None: none).
    """

    tokens: list[int]
    messages: list[dict[str, Any]]
    truncated: int = 0
    images: TurnImages | None = None


class TurnFormat:
    """Observation tokens in a tokenizer's chat format (see the module docstring).

    Args:
        tokenizer: an HF tokenizer with a chat template.
        max_message_tokens: the most tokens of each observation message's content
            (None: no limit).
        truncate_side: which part of a long content to keep out: ``left`` keeps its end,
            ``right`` its start, ``middle`` both ends.
        template_kwargs: extra arguments for ``apply_chat_template`` (e.g.
            ``enable_thinking``).
        keep_special_tokens: `decode` keeps special tokens (for a parser that reads a
            format made of them, such as ``gpt-oss``'s harmony channels).
        vision: the model's image processor (`rayrl.data.vision.VisionProcessor`), for
            observations that show images (None: a message with an image is refused).
    """

    def __init__(
        self,
        tokenizer,
        *,
        max_message_tokens: int | None = None,
        truncate_side: str = "middle",
        template_kwargs: dict[str, Any] | None = None,
        keep_special_tokens: bool = False,
        vision: Any = None,
    ) -> None:
        if truncate_side not in TRUNCATE_SIDES:
            raise ValueError(
                f"tool_response_truncate_side={truncate_side!r} is not one of {TRUNCATE_SIDES}."
            )
        if max_message_tokens is not None and max_message_tokens < 1:
            raise ValueError(f"max_tool_response_tokens={max_message_tokens} must be >= 1.")
        self.tokenizer = tokenizer
        self.codec = TextCodec(tokenizer)
        self.max_message_tokens = max_message_tokens
        self.truncate_side = truncate_side
        self.template_kwargs = dict(template_kwargs or {})
        self.keep_special_tokens = keep_special_tokens
        self.vision = vision
        self._image_markup: str | None = None
        self._pieces: dict[tuple[str, ...], list[str]] = {}
        self._lock = threading.Lock()  # tokenizers are shared by the driver's threads
        self._marker_ids = {side: self._encode(_marker(side)) for side in TRUNCATE_SIDES}
        self._piece_ids: dict[str, list[int]] = {}

    # ----------------------------------------------------------------- text
    def decode(self, tokens: Sequence[int]) -> str:
        """The text of sampled tokens (what a parser reads), special tokens left out
        unless ``keep_special_tokens``."""
        with self._lock:
            return self.codec.decode(tokens, skip_special_tokens=not self.keep_special_tokens)

    def _encode(self, text: str) -> list[int]:
        if not text:
            return []
        with self._lock:
            return self.codec.encode(text)

    def _piece_tokens(self, piece: str) -> list[int]:
        """The tokens of a template piece (the same few strings every turn: cached)."""
        tokens = self._piece_ids.get(piece)
        if tokens is None:
            tokens = self._piece_ids[piece] = self._encode(piece)
        return tokens

    def token_text(self, token: int) -> str:
        with self._lock:
            return self.codec.decode([int(token)], skip_special_tokens=False)

    # ---------------------------------------------------------- observation
    def observation(
        self, messages: Sequence[dict[str, Any]], last_token: int | None
    ) -> Observation:
        """The tokens to append after an assistant turn that ended with ``last_token``."""
        messages = [dict(m) for m in messages]
        pieces = list(self.pieces(tuple(str(m.get("role", "user")) for m in messages)))
        if last_token is not None:
            closing = self.token_text(last_token)
            if closing and pieces[0].startswith(closing):
                pieces[0] = pieces[0][len(closing) :]
        tokens = list(self._piece_tokens(pieces[0]))
        shown, truncated = [], 0
        images: list[dict] = []
        offsets: list[np.ndarray] = []
        for message, after in zip(messages, pieces[1:], strict=True):
            shows = _images(message.get("content"))
            if shows:
                content, pixels = self._image_content(message.get("content"), shows)
                marks = np.flatnonzero(np.asarray(content) == self.vision.image_token_id)
                offsets.append(len(tokens) + marks)
                images.append(pixels)
                message["content"] = _shown(list(message.get("content") or []))
                cut = False
            else:
                content, cut = self._content_tokens(_text(message.get("content")))
            tokens += content + self._piece_tokens(after)
            truncated += cut
            if cut:
                with self._lock:
                    message["content"] = self.codec.decode(content, skip_special_tokens=False)
            shown.append(message)
        return Observation(tokens, shown, truncated, _turn_images(images, offsets))

    def _image_content(self, content: Any, images: list[Any]) -> tuple[list[int], dict]:
        """A content with images: its tokens, placeholders expanded, and its pixel inputs,
        by the image processor (module docstring)."""
        if self.vision is None:
            raise TurnFormatError(
                f"an observation shows {len(images)} image(s), but the rollout has no image "
                "processor (a text-only model); return text, or train a vision-language model"
            )
        markup = self._markup()
        text = "".join(markup if _is_image(p) else _text([p]) for p in content)
        with self._lock:
            return self.vision.inputs(text, images)

    def _markup(self) -> str:
        """How the chat template renders an image part (derived once, module docstring)."""
        if self._image_markup is None:
            parts = [
                {"type": "text", "text": _BEFORE_IMAGE},
                {"type": "image"},
                {"type": "text", "text": _AFTER_IMAGE},
            ]
            with self._lock:
                text = self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": parts}], tokenize=False, **self.template_kwargs
                )
            if _BEFORE_IMAGE not in text or _AFTER_IMAGE not in text:
                raise TurnFormatError(
                    "the chat template does not render a message's text parts verbatim, so "
                    "an image part's markup cannot be derived from it"
                )
            self._image_markup = text.split(_BEFORE_IMAGE, 1)[1].split(_AFTER_IMAGE, 1)[0]
        return self._image_markup

    def _content_tokens(self, text: str) -> tuple[list[int], bool]:
        limit = self.max_message_tokens
        if limit is None:
            return self._encode(text), False
        bound = limit * _CHARS_PER_TOKEN_BOUND
        if len(text) > 2 * bound:  # never tokenise megabytes to keep a few hundred tokens
            text = text[:bound] + text[-bound:]
        tokens = self._encode(text)
        if len(tokens) <= limit:
            return tokens, False
        marker = self._marker_ids[self.truncate_side]
        keep = max(0, limit - len(marker))
        if self.truncate_side == "left":
            return marker + tokens[len(tokens) - keep :], True
        if self.truncate_side == "right":
            return tokens[:keep] + marker, True
        head = keep - keep // 2
        return tokens[:head] + marker + tokens[len(tokens) - keep // 2 :], True

    def pieces(self, roles: tuple[str, ...]) -> list[str]:
        """The template text around observation messages of these roles: ``len(roles) + 1``
        pieces, the first closing the assistant turn, the last opening the next one."""
        with self._lock:
            cached = self._pieces.get(roles)
        if cached is None:
            cached = self._derive(roles)
            with self._lock:
                self._pieces[roles] = cached
        return cached

    def _derive(self, roles: tuple[str, ...]) -> list[str]:
        conversation = [
            {"role": "user", "content": _PROMPT},
            {"role": "assistant", "content": _ASSISTANT},
        ]
        markers = [_CONTENT.format(i) for i in range(len(roles))]
        conversation += [{"role": r, "content": m} for r, m in zip(roles, markers, strict=True)]
        try:
            with self._lock:
                text = self.tokenizer.apply_chat_template(
                    conversation, tokenize=False, add_generation_prompt=True, **self.template_kwargs
                )
        except Exception as err:
            raise TurnFormatError(
                f"the tokenizer's chat template cannot render {list(roles)} messages after an "
                f"assistant message ({type(err).__name__}: {err}); use a model whose template "
                "renders tool messages, or an environment that answers with 'user' messages."
            ) from err
        if text.count(_ASSISTANT) != 1:
            raise TurnFormatError(
                "the chat template does not render an assistant message's content verbatim, "
                "so the tokens between turns cannot be derived from it."
            )
        rest = text.split(_ASSISTANT, 1)[1]
        pieces = []
        for marker in markers:
            if rest.count(marker) != 1:
                raise TurnFormatError(
                    f"the chat template does not render each of the {list(roles)} messages "
                    "once and verbatim; the tokens between turns cannot be derived from it."
                )
            before, rest = rest.split(marker, 1)
            pieces.append(before)
        return [*pieces, rest]


def _marker(side: str) -> str:
    return {"left": "(truncated)...", "right": "...(truncated)", "middle": "...(truncated)..."}[
        side
    ]


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image"


def _images(content: Any) -> list[Any]:
    """The images of a content's image parts (each part's ``image``)."""
    if not isinstance(content, list):
        return []
    return [p["image"] for p in content if _is_image(p) and p.get("image") is not None]


def _shown(content: list) -> list[dict[str, Any]]:
    """A content with images as the trajectory keeps it: its image parts without pixels."""
    return [{"type": "image"} if _is_image(p) else dict(p) for p in content]


def _turn_images(images: list[dict], offsets: list[np.ndarray]) -> TurnImages | None:
    if not images:
        return None
    inputs = {k: torch.cat([torch.as_tensor(i[k]) for i in images]) for k in images[0]}
    return TurnImages(inputs, np.concatenate(offsets).astype(np.int64))


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: keep the text parts
        parts = [p.get("text", "") for p in content if isinstance(p, dict)]
        return "".join(str(p) for p in parts)
    return str(content)
