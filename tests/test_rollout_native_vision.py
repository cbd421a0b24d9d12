"""The native rollout engine on vision-language models (issue 48): a tiny Qwen2.5-VL and
a tiny Qwen2-VL, built by transformers from a config, with rows of one image, two
images (of other sizes) and none in one batch. Greedy tokens are transformers' own
generate()'s for each row alone, sampled tokens carry the model's own log-probs (its
images and M-RoPE positions; text-style positions would not), the prefix cache never
hands one image's KV blocks to another image, and a weight update reaches the vision
tower."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForImageTextToText

import rayrl.rollout.native.vision as native_vision
from rayrl.rollout.native.engine import NativeRolloutEngine
from rayrl.rollout.sampling import SamplingParams
from rayrl.rollout.service import RolloutService
from vision_cases import (
    greedy_alone,
    mixed_rows,
    png,
    prompts,
    qwen2_vl_model,
    reference_log_probs,
    row,
    sharp_vision_model,
)

NEW = 8
GREEDY = SamplingParams(n=2, temperature=0.0, do_sample=False, max_new_tokens=NEW, seed=1)
SAMPLED = SamplingParams(n=2, temperature=1.0, do_sample=True, max_new_tokens=NEW, seed=3)
FAMILIES = ("qwen2_5_vl", "qwen2_vl")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl-native")
    sharp = sharp_vision_model(root)
    return {"qwen2_5_vl": sharp, "qwen2_vl": qwen2_vl_model(root, sharp)}


@pytest.fixture(scope="module")
def models(model_dirs):
    return {k: AutoModelForImageTextToText.from_pretrained(d).eval() for k, d in model_dirs.items()}


def _engine(model_dir, **options) -> NativeRolloutEngine:
    options = {"max_num_seqs": 8, "max_model_len": 512, "cpu_cache_tokens": 4096, **options}
    return NativeRolloutEngine(model_path=str(model_dir), **options)


def _synced(model_dir, model) -> NativeRolloutEngine:
    """An engine that read only the config, its weights (tower included) then sent from
    the transformers model in memory, by its names there, as the actor's sync sends them."""
    engine = _engine(model_dir, load_weights=False)
    engine.update_weights((n, p.detach()) for n, p in model.named_parameters())
    return engine


def _alone(model, batch, i: int) -> list[int]:
    return greedy_alone(model, batch, i, NEW)


def _greedy_matches(model, batch, out) -> None:
    for i in range(len(batch)):
        expected = _alone(model, batch, i)
        for k in range(2):  # each prompt's samples adjacent
            length = int(out["response_mask"][2 * i + k].sum())
            assert out["responses"][2 * i + k, :length].tolist() == expected[:length], (i, k)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("weights", ["from disk", "synced from memory", "chunked prefill"])
def test_greedy_tokens_are_transformers_generate_for_each_row_alone(
    model_dirs, models, family, weights
):
    """Disk names (``visual.*``, ``model.layers.*``) or memory names (``model.visual.*``,
    ``model.language_model.*``); prefill steps of 16 tokens cut the images' placeholders
    (and their positions) between steps."""
    model_dir, model = model_dirs[family], models[family]
    if weights == "synced from memory":
        engine = _synced(model_dir, model)
    else:
        chunked = {"max_num_batched_tokens": 16} if weights == "chunked prefill" else {}
        engine = _engine(model_dir, **chunked)
    _, batch = prompts(model_dir, mixed_rows())
    assert batch["attention_mask"].sum(1).unique().numel() == 3  # three prompt lengths
    _greedy_matches(model, batch, engine.generate(batch, GREEDY))


@pytest.mark.parametrize("family", FAMILIES)
def test_sampled_tokens_carry_the_models_log_probs(model_dirs, models, family):
    model_dir, model = model_dirs[family], models[family]
    _, batch = prompts(model_dir, mixed_rows())
    out = _engine(model_dir).generate(batch, SAMPLED)
    for i in range(len(out)):
        expected = reference_log_probs(model, out, i, model.config.image_token_id)
        length = int(out["response_mask"][i].sum())
        got = out["rollout_log_probs"][i, :length]
        assert torch.allclose(got, expected[:length], atol=1e-4), i


def _text_positions(core, ids, placeholders, grid, attention_mask=None):
    """A text model's positions (0, 1, 2, ... on all three axes), no rope delta."""
    positions = torch.arange(ids.shape[1]).expand(3, ids.shape[0], -1)
    return positions, torch.zeros(ids.shape[0], 1, dtype=torch.long)


def test_text_style_positions_would_not_give_the_models_log_probs(model_dirs, models, monkeypatch):
    """The check above fails where the engine's positions are not the model's M-RoPE
    ones: the image rows' log-probs move, the text row's do not."""
    model_dir, model = model_dirs["qwen2_5_vl"], models["qwen2_5_vl"]
    _, batch = prompts(model_dir, mixed_rows())
    monkeypatch.setattr(native_vision, "rope_index", _text_positions)
    out = _engine(model_dir).generate(batch, SAMPLED)
    gaps = []
    for i in range(len(out)):
        expected = reference_log_probs(model, out, i, model.config.image_token_id)
        length = int(out["response_mask"][i].sum())
        gaps.append(float((out["rollout_log_probs"][i, :length] - expected[:length]).abs().max()))
    image_rows, text_rows = [0, 1, 4, 5], [2, 3]  # prompts 0 and 2 have images; n=2
    assert min(gaps[r] for r in image_rows) > 1e-3, gaps
    assert max(gaps[r] for r in text_rows) < 1e-4, gaps


def test_the_prefix_cache_keys_blocks_by_the_images_too(model_dirs, models):
    """The same tokens with another image (of the same size) find none of the first
    image's KV blocks: the tokens are transformers' for the new image; the same image
    again finds them."""
    model_dir, model = model_dirs["qwen2_5_vl"], models["qwen2_5_vl"]
    first = [row("what <image> is", [png(100, 150, seed=0)])]
    other = [row("what <image> is", [png(100, 150, seed=7)])]
    _, a = prompts(model_dir, first)
    _, b = prompts(model_dir, other)
    assert torch.equal(a["input_ids"], b["input_ids"])
    engine = _engine(model_dir, enable_prefix_caching=True)
    out_a = engine.generate(a, GREEDY)
    assert engine.prefix is not None and engine.prefix.hit_tokens == 0
    out_b = engine.generate(b, GREEDY)
    assert engine.prefix.hit_tokens == 0  # nothing of the first image's blocks
    _greedy_matches(model, b, out_b)
    assert not torch.equal(out_a["responses"], out_b["responses"])
    engine.generate(a, GREEDY)
    assert engine.prefix.hit_tokens > 0  # the same image: its blocks again


def test_a_weight_update_reaches_the_vision_tower(model_dirs, models):
    """New tower weights (a trained tower's, merger included) change the tokens as
    they change transformers' own."""
    model_dir = model_dirs["qwen2_5_vl"]
    changed = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    with torch.no_grad():
        for name, param in changed.named_parameters():
            if ".visual." in f".{name}":
                param.mul_(-1.5)
    _, batch = prompts(model_dir, mixed_rows())
    engine = _engine(model_dir)
    before = engine.generate(batch, GREEDY)
    tower = [(n, p.detach()) for n, p in changed.named_parameters() if "visual." in n]
    assert engine.update_weights(tower) == len(tower)
    after = engine.generate(batch, GREEDY)
    _greedy_matches(changed, batch, after)
    assert not torch.equal(before["responses"][:2], after["responses"][:2])


def test_a_preempted_sample_is_recomputed_with_its_images_and_positions(model_dirs, models):
    """A KV cache too small for every sample: samples are preempted, recomputed from
    prompt + response (the images spliced again, the response's positions continued from
    the rope delta), and their log-probs are still the model's."""
    model_dir, model = model_dirs["qwen2_5_vl"], models["qwen2_5_vl"]
    _, batch = prompts(model_dir, mixed_rows())
    long = SamplingParams(n=2, temperature=1.0, max_new_tokens=24, seed=3, ignore_eos=True)
    engine = _engine(model_dir, cpu_cache_tokens=192, enable_prefix_caching=False)
    out = engine.generate(batch, long)
    assert engine.sched.preemptions > 0
    for i in range(len(out)):
        expected = reference_log_probs(model, out, i, model.config.image_token_id)
        assert torch.allclose(out["rollout_log_probs"][i], expected, atol=1e-4), i


def test_the_rollout_service_hands_the_images_to_the_engine(model_dirs, models):
    """The workers' path (`RolloutService.generate`: the engine's request API, the images
    with each prompt) gives the engine's own tokens and log-probs."""
    model_dir = model_dirs["qwen2_5_vl"]
    _, batch = prompts(model_dir, mixed_rows())
    engine = _engine(model_dir)
    served = RolloutService(engine).generate(batch, SAMPLED).batch
    direct = engine.generate(batch, SAMPLED)
    assert torch.equal(served["responses"], direct["responses"])
    assert torch.equal(served["rollout_log_probs"], direct["rollout_log_probs"])


def test_image_tokens_without_their_images_are_refused(model_dirs):
    model_dir = model_dirs["qwen2_vl"]
    _, batch = prompts(model_dir, mixed_rows())
    del batch.non_tensors["multi_modal_inputs"]
    with pytest.raises(ValueError, match="prompt 0 holds .* image tokens but no images"):
        _engine(model_dir).generate(batch, GREEDY)


def test_a_text_row_alone_runs_as_text(model_dirs, models):
    """A batch of text prompts on a vision-language model: no tower, no M-RoPE tables."""
    model_dir, model = model_dirs["qwen2_vl"], models["qwen2_vl"]
    _, batch = prompts(model_dir, [row("just some text here please")])
    engine = _engine(model_dir)
    images = engine.vision.prompt_images([np.asarray(batch["input_ids"][0])], [None])
    assert images == [None]
    _greedy_matches(model, batch, engine.generate(batch, GREEDY))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", FAMILIES)
def test_on_cuda_the_engine_draws_the_cpu_engines_tokens(model_dirs, models, family):
    """The CUDA path (Triton kernels, decode CUDA graphs whose positions carry each
    prompt's rope_delta, eager prefills with images) against the CPU engine, in fp32."""
    model_dir = model_dirs[family]
    _, batch = prompts(model_dir, mixed_rows())
    cpu = _engine(model_dir).generate(batch, GREEDY)
    gpu = _engine(model_dir, device="cuda", dtype=torch.float32).generate(batch, GREEDY)
    assert torch.equal(cpu["responses"], gpu["responses"].cpu())
    sampled = _engine(model_dir, device="cuda", dtype=torch.float32).generate(batch, SAMPLED)
    for i in range(len(sampled)):
        expected = reference_log_probs(
            models[family], sampled, i, models[family].config.image_token_id
        )
        length = int(sampled["response_mask"][i].sum())
        got = sampled["rollout_log_probs"][i, :length].cpu()
        assert torch.allclose(got, expected[:length], atol=1e-3), i
