"""SFT with images (issue 48): (prompt-with-images, response) rows in verl's layout read
with a vision-language model's image processor, each image's tokens counted in the
prompt, each row's pixel inputs collated beside it; an SFT step on the tiny Qwen2.5-VL
learns from them (its loss falls), and the images are what the loss depends on: the same
tokens without their pixel inputs, or with another image, give another loss. The
synthetic visual task's demonstrations (`rayrl sft` with data.synthetic_task=colors)
carry their images, or none with data.synthetic_images=false."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from rayrl.config.sft import load_sft_config
from rayrl.data.sft import SFTDataset
from rayrl.data.synthetic_images import MISTAKES, image_demonstrations
from rayrl.data.vision import load_vision_processor
from rayrl.train.engine import TrainEngine
from rayrl.trainer.sft_data import load_sft_datasets
from rayrl.workers.losses import sft_loss_fn
from vision_cases import sharp_vision_model

IMAGE_TOKENS = 4  # a 56-pixel image: 2 x 2 merged patches


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return sharp_vision_model(tmp_path_factory.mktemp("vl-sft"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def vision(model_dir, tokenizer):
    return load_vision_processor(model_dir, tokenizer, backend="pil")


@pytest.fixture(scope="module")
def rows():
    return image_demonstrations("colors", 8, seed=0)


def _dataset(rows, tokenizer, vision=None) -> SFTDataset:
    return SFTDataset(rows, tokenizer, max_length=128, vision=vision)


def test_rows_with_images_count_their_image_tokens_and_carry_their_pixels(rows, tokenizer, vision):
    data = _dataset(rows, tokenizer, vision)
    assert len(data) == len(rows) and not data.rejected
    image_token = vision.image_token_id
    assert all(ids.count(image_token) == IMAGE_TOKENS for ids in data.prompt_ids)
    batch = data.collate([0, 1, 2])
    inputs = batch.non_tensors["multi_modal_inputs"]
    assert [tuple(x["image_grid_thw"][0].tolist()) for x in inputs] == [(1, 4, 4)] * 3
    # the answer is the response, the image token only in the prompt
    assert not (batch["responses"] == image_token).any()


def test_rows_whose_images_cannot_be_used_are_set_aside_with_the_reason(rows, tokenizer, vision):
    no_placeholder = {**rows[0], "question": rows[0]["question"].replace("<image>", "")}
    data = _dataset([no_placeholder, rows[1]], tokenizer, vision)
    assert len(data) == 1 and "placeholder" in data.rejected[0].reason
    text_model = _dataset(rows[:2], tokenizer)  # read without an image processor
    assert len(text_model) == 0 and "text-only model" in text_model.rejected[0].reason
    truncated = SFTDataset(rows[:1], tokenizer, max_length=8, truncation="left", vision=vision)
    assert len(truncated) == 0 and "not cut" in truncated.rejected[0].reason


def _engine(model_dir) -> TrainEngine:
    return TrainEngine(model_dir, device="cpu", mixed_precision=False, optim={"lr": 1e-2})


def test_an_sft_step_learns_from_the_images_and_the_loss_depends_on_them(
    model_dir, rows, tokenizer, vision
):
    data = _dataset(rows, tokenizer, vision)
    batch = data.collate(list(range(len(data))))
    engine, loss = _engine(model_dir), sft_loss_fn()

    def nll(b) -> float:
        out = engine.forward(b, micro_batch_size=4)["log_probs"]
        return float(-(out * b["response_mask"]).sum() / b["response_mask"].sum())

    blind = batch.index(list(range(len(batch))))
    blind.non_tensors.pop("multi_modal_inputs")  # the same tokens, no pixels
    other = batch.index(list(range(len(batch))))
    other.non_tensors["multi_modal_inputs"] = batch.non_tensors["multi_modal_inputs"][::-1]
    before = {name: nll(b) for name, b in (("images", batch), ("blind", blind), ("other", other))}
    assert len(set(before.values())) == 3, before  # the images enter the loss
    first = engine.train_step(batch, loss, micro_batch_size=4)["loss"]
    for _ in range(20):
        last = engine.train_step(batch, loss, micro_batch_size=4)["loss"]
    assert last < 0.5 * first, (first, last)
    after = {name: nll(b) for name, b in (("images", batch), ("blind", blind), ("other", other))}
    # what it learnt is in the images: without them, or with others, the answers are worse
    assert after["images"] + 0.1 < min(after["blind"], after["other"]), after


def test_the_synthetic_visual_task_gives_demonstrations_with_images_or_none(tokenizer, vision):
    overrides = [
        "data.synthetic_task=colors",
        "data.synthetic_size=16",
        "data.synthetic_val_size=8",
    ]
    cfg = load_sft_config(None, [*overrides, "data.synthetic_correct_rate=0.0"])
    train, val = load_sft_datasets(cfg, tokenizer, vision)
    assert len(train) == 16 and val is not None and len(val) > 0
    assert all(ids.count(vision.image_token_id) == IMAGE_TOKENS for ids in train.prompt_ids)
    demos = image_demonstrations("colors", 16, seed=cfg.trainer.seed, correct_rate=0.0)
    assert all(d["answer"] == MISTAKES[d["extra_info"]["ground_truth"]] for d in demos)
    blind = load_sft_config(None, [*overrides, "data.synthetic_images=false"])
    train, val = load_sft_datasets(blind, tokenizer, vision)
    assert len(train) == 16 and not train.image_prompts and val is not None
    assert all(vision.image_token_id not in ids for ids in train.prompt_ids)
    assert all("<image>" not in tokenizer.decode(ids) for ids in train.prompt_ids)
    assert train.collate([0, 1]).non_tensors["multi_modal_inputs"].tolist() == [{}, {}]


def test_preference_pairs_of_a_visual_task_are_refused():
    from rayrl.config.errors import ConfigError
    from rayrl.config.pref import load_pref_config
    from rayrl.trainer.names import check_pref_names, check_sft_names

    check_sft_names(load_sft_config(None, ["data.synthetic_task=colors"]))
    with pytest.raises(ConfigError, match="synthetic_task='colors' is not one of"):
        check_pref_names(load_pref_config("dpo", None, ["data.synthetic_task=colors"]))
