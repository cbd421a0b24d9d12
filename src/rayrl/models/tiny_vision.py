"""A tiny Qwen2.5-VL-style vision-language model with random weights, built locally, for
tests and demos of the image data path (and, later, of vision-language training).

`build_tiny_vision_model` writes a directory as a Qwen2.5-VL checkpoint has it: a
`config.json` that transformers' `Qwen2_5_VLForConditionalGeneration` loads (a tiny
language model, `TinyVisionSpec.text`, and a tiny vision tower whose merger projects
onto it), its weights, the tiny tokenizer with Qwen-VL's vision tokens added and a chat
template that renders an image part as `<|vision_start|><|image_pad|><|vision_end|>`,
and a `preprocessor_config.json` of Qwen2-VL's image processor (type, patch and merge
sizes, pixel bounds) that the PIL image processor loads without torchvision and
`AutoProcessor` loads with it. Nothing is downloaded; one spec always gives the same files.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import AddedToken
from transformers import (
    PreTrainedTokenizerBase,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
)

from rayrl.models.tiny import (
    DTYPES,
    INIT_STD,
    ROPE_THETA,
    TOKENIZER_SEED,
    TinySpec,
    chat_generation_config,
    random_model,
    round_up,
    write_model_dir,
)
from rayrl.models.tokenizer import ENDOFTEXT, train_tokenizer

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, "<|vision_pad|>", IMAGE_PAD, VIDEO_PAD)
# CLIP's normalisation, which Qwen2-VL's image processor uses
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)

# ChatML (as the tiny text template) whose content may also be a list of parts: text
# parts as they are, an image part as Qwen-VL renders it, a video part likewise.
VISION_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'video' %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- else %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class TinyVisionSpec:
    """The shape of a tiny vision-language model: its language model (`text`, a Qwen2
    `TinySpec`) and its vision tower, plus the image processor's pixel bounds. The
    defaults make an image between 4 and 64 tokens."""

    text: TinySpec = field(default_factory=TinySpec)
    depth: int = 2
    vision_hidden: int = 32
    vision_heads: int = 2
    vision_intermediate: int = 64
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 4 * 28 * 28
    max_pixels: int = 64 * 28 * 28

    def validate(self) -> None:
        """Raise ValueError naming the first field that cannot make the model."""
        self.text.validate()
        if self.text.family != "qwen2":
            raise ValueError(
                f"TinyVisionSpec.text.family={self.text.family!r}: the language model of a "
                "Qwen2.5-VL-style model is qwen2"
            )
        if (self.text.hidden // self.text.heads) // 2 < 3:
            raise ValueError(
                "TinyVisionSpec.text: a head size of at least 6 is needed for the three "
                "M-RoPE sections (time, height, width); raise hidden or lower heads"
            )
        for name in ("depth", "vision_hidden", "vision_heads", "vision_intermediate"):
            if getattr(self, name) < 1:
                raise ValueError(f"TinyVisionSpec.{name}={getattr(self, name)} must be at least 1.")
        if self.vision_hidden % self.vision_heads or (self.vision_hidden // self.vision_heads) % 4:
            raise ValueError(
                f"TinyVisionSpec: vision_hidden={self.vision_hidden} must be vision_heads="
                f"{self.vision_heads} heads of a size divisible by 4 (2-D rotary embeddings)"
            )
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(
                f"TinyVisionSpec: min_pixels={self.min_pixels} must be positive and at most "
                f"max_pixels={self.max_pixels}"
            )

    def to_config(self, tokenizer: PreTrainedTokenizerBase) -> Qwen2_5_VLConfig:
        """The model's config; the vocabulary covers `tokenizer`, whose vision tokens it names."""
        self.validate()
        text = self.text
        eos = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
        return Qwen2_5_VLConfig(
            text_config=dict(
                vocab_size=max(text.vocab_size, round_up(len(tokenizer), 8)),
                hidden_size=text.hidden,
                intermediate_size=text.intermediate,
                num_hidden_layers=text.layers,
                num_attention_heads=text.heads,
                num_key_value_heads=text.kv_heads,
                max_position_embeddings=text.max_position,
                initializer_range=INIT_STD,
                rms_norm_eps=1e-6,
                rope_parameters={
                    "rope_type": "default",
                    "rope_theta": ROPE_THETA,
                    "mrope_section": mrope_sections(text.hidden // text.heads),
                },
                bos_token_id=eos,
                eos_token_id=eos,
                pad_token_id=eos,
                dtype=text.dtype,
            ),
            vision_config=dict(
                depth=self.depth,
                hidden_size=self.vision_hidden,
                intermediate_size=self.vision_intermediate,
                num_heads=self.vision_heads,
                out_hidden_size=text.hidden,
                patch_size=self.patch_size,
                spatial_merge_size=self.merge_size,
                temporal_patch_size=self.temporal_patch_size,
                window_size=self.patch_size * self.merge_size * 4,
                fullatt_block_indexes=[self.depth - 1],
                initializer_range=INIT_STD,
            ),
            image_token_id=ids[IMAGE_PAD],
            video_token_id=ids[VIDEO_PAD],
            vision_start_token_id=ids[VISION_START],
            vision_end_token_id=ids[VISION_END],
            tie_word_embeddings=text.tie_embeddings,
            dtype=text.dtype,
            architectures=["Qwen2_5_VLForConditionalGeneration"],
        )

    def processor_config(self) -> dict[str, object]:
        """`preprocessor_config.json` as Qwen2.5-VL ships it (pixel bounds both as
        `min_pixels`/`max_pixels` and as transformers' `size`)."""
        return {
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2_5_VLProcessor",
            "min_pixels": self.min_pixels,
            "max_pixels": self.max_pixels,
            "size": {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
            "patch_size": self.patch_size,
            "temporal_patch_size": self.temporal_patch_size,
            "merge_size": self.merge_size,
            "image_mean": list(IMAGE_MEAN),
            "image_std": list(IMAGE_STD),
            "do_convert_rgb": True,
            "do_normalize": True,
            "do_rescale": True,
            "do_resize": True,
            "rescale_factor": 1 / 255,
            "resample": 3,  # bicubic
        }

    def build(self, out_dir: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Write this model to `out_dir`; see `build_tiny_vision_model`."""
        return build_tiny_vision_model(out_dir, self, overwrite=overwrite)


def mrope_sections(head_dim: int) -> list[int]:
    """The (time, height, width) split of a head's rotary frequencies, as Qwen2.5-VL's
    [16, 24, 24] splits 64: a quarter for time, the rest halved."""
    half = head_dim // 2
    time = max(1, half // 4)
    height = (half - time) // 2
    return [time, height, half - time - height]


def vision_tokenizer(spec: TinyVisionSpec) -> PreTrainedTokenizerBase:
    """The tiny tokenizer (`train_tokenizer`) with Qwen-VL's vision tokens as special
    tokens and the chat template that renders image parts."""
    text = spec.text
    tokenizer = train_tokenizer(
        text.corpus,
        text.alphabet,
        vocab_size=text.vocab_size,
        seed=TOKENIZER_SEED,
        model_max_length=text.max_position,
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS],
        special_tokens=True,
    )
    tokenizer.chat_template = VISION_CHAT_TEMPLATE
    return tokenizer


def build_tiny_vision_model(
    out_dir: str | os.PathLike[str],
    spec: TinyVisionSpec | None = None,
    *,
    overwrite: bool = False,
) -> Path:
    """Build a random-weight Qwen2.5-VL-style model, its tokenizer and its image
    processor config in `out_dir` (module docstring); return its path. Written under a
    temporary name and renamed into place; an existing non-empty `out_dir` is an error
    unless `overwrite=True`."""
    spec = spec or TinyVisionSpec()
    spec.validate()
    out = Path(out_dir).absolute()
    tokenizer = vision_tokenizer(spec)
    model = random_model(
        spec.to_config(tokenizer),
        spec.text.seed,
        DTYPES[spec.text.dtype],
        Qwen2_5_VLForConditionalGeneration,
    )
    model.generation_config = chat_generation_config(tokenizer)

    def save(staging: Path) -> None:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        config = json.dumps(spec.processor_config(), indent=2) + "\n"
        (staging / "preprocessor_config.json").write_text(config)

    return write_model_dir(out, overwrite, save)
