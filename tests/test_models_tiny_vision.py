"""The tiny Qwen2.5-VL-style model directory: it loads offline as transformers' own
model, its tokenizer renders image parts with the vision tokens its config names, and one
spec always gives the same files."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

from rayrl.models.tiny import TinySpec
from rayrl.models.tiny_vision import (
    IMAGE_PAD,
    VISION_END,
    VISION_START,
    TinyVisionSpec,
    build_tiny_vision_model,
    mrope_sections,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_vision_model(tmp_path_factory.mktemp("vl") / "tiny-vl")


def test_the_directory_is_a_qwen25_vl_checkpoint(model_dir):
    config = AutoConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert config.model_type == "qwen2_5_vl"
    assert config.image_token_id == tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    assert config.vision_start_token_id == tokenizer.convert_tokens_to_ids(VISION_START)
    assert config.vision_config.out_hidden_size == config.text_config.hidden_size
    assert config.text_config.vocab_size >= len(tokenizer)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir)
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    processor = json.loads((model_dir / "preprocessor_config.json").read_text())
    assert processor["image_processor_type"] == "Qwen2VLImageProcessor"
    assert (processor["min_pixels"], processor["max_pixels"]) == (4 * 28 * 28, 64 * 28 * 28)


def test_the_chat_template_renders_image_parts_and_plain_text(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    parts = [
        {"type": "text", "text": "What is in "},
        {"type": "image"},
        {"type": "text", "text": "?"},
    ]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True
    )
    assert text == (
        f"<|im_start|>user\nWhat is in {VISION_START}{IMAGE_PAD}{VISION_END}?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tokenizer.convert_tokens_to_ids(IMAGE_PAD)) == 1  # one token, unsplit
    plain = tokenizer.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False)
    assert plain == "<|im_start|>user\n2+2?<|im_end|>\n"


def test_one_spec_gives_the_same_files(tmp_path, model_dir):
    again = build_tiny_vision_model(tmp_path / "again")
    for name in ("model.safetensors", "config.json", "tokenizer.json", "preprocessor_config.json"):
        assert (again / name).read_bytes() == (model_dir / name).read_bytes(), name


def test_spec_errors_say_what_to_fix():
    with pytest.raises(ValueError, match="vision_hidden=30 must be vision_heads=2 heads"):
        TinyVisionSpec(vision_hidden=30).validate()
    with pytest.raises(ValueError, match="language model of a Qwen2.5-VL-style model is qwen2"):
        TinyVisionSpec(text=TinySpec(family="llama")).validate()
    with pytest.raises(ValueError, match="min_pixels=5000 must be positive and at most"):
        TinyVisionSpec(min_pixels=5000, max_pixels=4000).validate()
    assert mrope_sections(128) == [16, 24, 24]  # Qwen2.5-VL's own split of its 128-wide heads
    assert sum(mrope_sections(16)) == 8
