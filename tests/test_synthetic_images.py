"""The synthetic visual tasks (issue 48): rows with an image each, the same for a seed,
read by a vision-language model's processor, a held-out split of other images, and
scorers that tell the right answer from a wrong one."""

from __future__ import annotations

import io

import pytest
from PIL import Image
from transformers import AutoTokenizer

from rayrl.data import PromptDataset, synthetic_rows
from rayrl.data.synthetic import held_out_rows
from rayrl.data.synthetic_images import COLORS, MAX_SQUARES, image_rows
from rayrl.data.vision import load_vision_processor
from rayrl.models.tiny_vision import build_tiny_vision_model
from rayrl.rewards.registry import compute_score


def _image(row: dict) -> Image.Image:
    return Image.open(io.BytesIO(row["images"][0]["bytes"])).convert("RGB")


def test_rows_are_the_same_for_a_seed_and_their_images_show_the_answer():
    rows = synthetic_rows("count_squares", 6, seed=1)
    assert rows == image_rows("count_squares", 6, seed=1) != image_rows("count_squares", 6, 2)
    for row in rows:
        assert row["prompt"][0]["content"].startswith("<image>")
        image = _image(row)
        dark = sum(1 for p in image.tobytes()[::3] if p == 0)  # red channel: black only
        assert dark == int(row["reward_model"]["ground_truth"]) * 8 * 8  # its squares
        assert 1 <= int(row["reward_model"]["ground_truth"]) <= MAX_SQUARES
    for row in synthetic_rows("colors", 6, seed=0):
        name = row["reward_model"]["ground_truth"]
        shade = _image(row).getpixel((0, 0))
        assert all(abs(a - b) <= 12 for a, b in zip(shade, COLORS[name], strict=True))


def test_a_vision_language_models_processor_reads_them(tmp_path):
    model = build_tiny_vision_model(tmp_path / "vl")
    tokenizer = AutoTokenizer.from_pretrained(model)
    vision = load_vision_processor(model, tokenizer, backend="pil")
    data = PromptDataset(
        synthetic_rows("colors", 4), tokenizer, max_prompt_length=64, vision=vision
    )
    assert len(data) == 4 and not data.rejected
    images = data.collate([0, 1]).non_tensors["multi_modal_inputs"]
    assert [m["image_grid_thw"].tolist() for m in images] == [[[1, 4, 4]]] * 2  # 4 tokens each


def test_the_held_out_split_shows_other_images():
    train = {_image(r).tobytes() for r in synthetic_rows("count_squares", 16)}
    held = held_out_rows("count_squares", 16, 8, seed=0)
    assert held and not {_image(r).tobytes() for r in held} & train


@pytest.mark.parametrize(
    "source, response, truth, score",
    [
        ("colors", "It is Red", "red", 1.0),
        ("colors", "blue", "red", 0.1),
        ("colors", "42", "red", 0.0),
        ("count_squares", "there are 3", "3", 1.0),
        ("count_squares", "4", "3", 0.1),
    ],
)
def test_the_scorers_tell_right_from_wrong(source, response, truth, score):
    assert compute_score(source, response, truth)["score"] == score
