"""The HF rollout engine on a vision-language model (issue 48): each prompt row's images
go in with it (rows with one, two and no images left-padded in one batch), greedy
tokens are transformers' own generate()'s for the row alone, they follow the image, and
sampled tokens carry the model's own log-probs; the request path (multi-turn episodes,
asynchronous replicas) feeds the images alike."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

from rayrl.rollout.hf.engine import HFRolloutEngine
from rayrl.rollout.sampling import SamplingParams
from rayrl.rollout.service import RolloutService
from vision_cases import (
    greedy_alone,
    mixed_rows,
    png,
    prompts,
    reference_log_probs,
    row,
    sharp_vision_model,
)

NEW = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return sharp_vision_model(tmp_path_factory.mktemp("vl"))


@pytest.fixture(scope="module")
def model(model_dir):
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir).eval()


@pytest.fixture(scope="module")
def engine(model, model_dir):
    return HFRolloutEngine(model=model, tokenizer=AutoTokenizer.from_pretrained(model_dir))


def _alone(model, batch, i: int) -> list[int]:
    return greedy_alone(model, batch, i, NEW)


GREEDY = SamplingParams(n=2, temperature=0.0, do_sample=False, max_new_tokens=NEW, seed=1)


def test_greedy_tokens_are_transformers_generate_for_each_row_alone(model, model_dir, engine):
    _, batch = prompts(model_dir, mixed_rows())
    assert batch["attention_mask"].sum(1).unique().numel() == 3  # three prompt lengths
    out = engine.generate(batch, GREEDY)
    for i in range(3):
        expected = _alone(model, batch, i)
        for k in range(2):  # each prompt's samples adjacent
            length = int(out["response_mask"][2 * i + k].sum())
            assert out["responses"][2 * i + k, :length].tolist() == expected[:length]
    assert out.non_tensors["multi_modal_inputs"][0] is batch.non_tensors["multi_modal_inputs"][0]


def test_the_tokens_follow_the_image(model_dir, engine):
    rows = mixed_rows()
    _, batch = prompts(model_dir, rows)
    other = [row("what <image> is", [png(100, 150, seed=7)]), *rows[1:]]
    _, swapped = prompts(model_dir, other)
    assert torch.equal(batch["input_ids"], swapped["input_ids"])  # same size: same ids
    a, b = (engine.generate(x, GREEDY)["responses"] for x in (batch, swapped))
    assert not torch.equal(a[:2], b[:2])  # the row whose image changed
    assert torch.equal(a[2:], b[2:])  # the others did not


def test_sampled_tokens_carry_the_models_log_probs(model, model_dir, engine):
    _, batch = prompts(model_dir, mixed_rows())
    sampled = SamplingParams(n=2, temperature=1.0, do_sample=True, max_new_tokens=NEW, seed=3)
    out = engine.generate(batch, sampled)
    image_token = model.config.image_token_id
    for i in range(len(out)):
        expected = reference_log_probs(model, out, i, image_token)
        length = int(out["response_mask"][i].sum())
        got = out["rollout_log_probs"][i, :length]
        assert torch.allclose(got, expected[:length], atol=1e-4), i


def test_requests_feed_each_prompts_images_as_generate_does(model, model_dir, engine):
    """The request path (the one turn loop of multi-turn episodes, asynchronous replicas
    and the rollout service's single turns) feeds each prompt's images at its prefill,
    with the model's M-RoPE positions: greedy tokens are transformers' generate()'s for
    each row alone, and sampled ones (the same sampler keys) the batch path's."""
    assert engine.serves_requests
    _, batch = prompts(model_dir, mixed_rows())
    ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    lists = [r[m].tolist() for r, m in zip(ids, mask, strict=True)]
    images = list(batch.non_tensors["multi_modal_inputs"])
    out = engine.generate_token_ids(lists, GREEDY, images=images)
    for i in range(3):
        expected = _alone(model, batch, i)
        for k in range(2):
            length = int(out.lengths[2 * i + k])
            assert out.tokens[2 * i + k, :length].tolist() == expected[:length]
    sampled = SamplingParams(n=2, temperature=1.0, do_sample=True, max_new_tokens=NEW, seed=3)
    served = RolloutService(engine).generate(batch, sampled).batch
    direct = engine.generate(batch, sampled)
    assert torch.equal(served["responses"], direct["responses"])
    assert torch.allclose(served["rollout_log_probs"], direct["rollout_log_probs"], atol=1e-5)
