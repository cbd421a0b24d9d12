"""Seeded sampling for rollout engines: the hash, the noise, logit processing, Gumbel-max."""

from __future__ import annotations

import random

import pytest
import torch

from rayrl.rollout.sampling import (
    SamplingParams,
    mix64,
    process_logits,
    reference_sample_tokens,
    sample_keys,
    sample_tokens,
    uniform_noise,
)

M64 = (1 << 64) - 1


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _mix64_reference(x: int) -> int:
    """splitmix64's finaliser on Python ints (unsigned 64-bit)."""
    x &= M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def test_mix64_matches_unsigned_reference():
    rng = random.Random(0)
    values = [0, 1, -1, 2**63 - 1, -(2**63)] + [rng.getrandbits(64) for _ in range(500)]
    values = [_signed(v & M64) for v in values]
    got = mix64(torch.tensor(values, dtype=torch.int64)).tolist()
    assert got == [_signed(_mix64_reference(v)) for v in values]


def test_keys_are_pinned_and_distinct():
    # Pinned values: a change here breaks replay of every recorded run.
    keys = sample_keys(7, 3, ["a/0", "a/1", "b/0"])
    assert keys.dtype == torch.int64
    assert len(set(keys.tolist())) == 3
    assert torch.equal(keys, sample_keys(7, 3, ["a/0", "a/1", "b/0"]))
    assert not torch.equal(keys, sample_keys(7, 4, ["a/0", "a/1", "b/0"]))
    assert not torch.equal(keys, sample_keys(8, 3, ["a/0", "a/1", "b/0"]))
    assert sample_keys(0, 0, ["x/0"]).tolist() == [PINNED_KEY]
    noise = uniform_noise(sample_keys(0, 0, ["x/0"]), 5, 4)
    assert noise.tolist() == [PINNED_NOISE]


PINNED_KEY = 2262026279861212772
PINNED_NOISE = [0.0401747359780365, 0.8917500734504789, 0.5089046225140574, 0.8721911315546356]


def test_noise_depends_only_on_key_position_token():
    keys = sample_keys(1, 2, [f"u{i}/0" for i in range(6)])
    full = uniform_noise(keys, 4, 50)
    assert full.dtype == torch.float64 and full.shape == (6, 50)
    assert bool(((full > 0) & (full < 1)).all())
    perm = torch.tensor([5, 2, 0, 4, 1, 3])
    assert torch.equal(uniform_noise(keys[perm], 4, 50), full[perm])
    assert torch.equal(uniform_noise(keys[:2], 4, 50), full[:2])
    per_row = uniform_noise(keys, torch.tensor([4, 4, 9, 4, 4, 4]), 50)
    assert torch.equal(per_row[[0, 1, 3]], full[[0, 1, 3]])
    assert not torch.equal(per_row[2], full[2])
    # A longer vocabulary extends the row; it does not reshuffle it.
    assert torch.equal(uniform_noise(keys, 4, 80)[:, :50], full)


def test_noise_looks_uniform():
    keys = sample_keys(0, 0, [f"s{i}" for i in range(64)])
    u = uniform_noise(keys, 0, 1024).flatten()
    assert abs(u.mean().item() - 0.5) < 0.01
    assert abs(u.var().item() - 1 / 12) < 0.005
    hist = torch.histc(u.float(), bins=10, min=0, max=1) / u.numel()
    assert bool(((hist - 0.1).abs() < 0.01).all())


def _frequencies(logits: torch.Tensor, params: SamplingParams, keys: torch.Tensor) -> torch.Tensor:
    tokens, _ = sample_tokens(logits.expand(len(keys), -1), keys, 0, params)
    return torch.bincount(tokens, minlength=logits.shape[-1]).double() / len(keys)


def test_gumbel_max_matches_the_processed_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    draws = 10000
    keys = sample_keys(0, 0, [f"d{i}" for i in range(draws)])
    for params in (
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=1.3, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.8),
    ):
        expected = torch.softmax(process_logits(logits, params), dim=-1)[0].double()
        freq = _frequencies(logits, params, keys)
        std = (expected * (1 - expected) / draws).sqrt()
        assert bool(((freq - expected).abs() <= 5 * std + 1e-9).all()), (params, freq, expected)
        assert bool((freq[expected == 0] == 0).all())


def test_noise_chunks_do_not_change_samples(monkeypatch):
    import rayrl.rollout.sampling as sampling

    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(10, 64, generator=gen)
    keys = sample_keys(3, 1, [str(i) for i in range(10)])
    params = SamplingParams(temperature=1.2)
    whole, _ = sample_tokens(logits, keys, torch.arange(10), params)
    for elements in (3 * 64, 48, 7):  # several rows, one row, part of a row per chunk
        monkeypatch.setitem(sampling._NOISE_CHUNK_ELEMENTS, "cpu", elements)
        chunked, _ = sample_tokens(logits, keys, torch.arange(10), params)
        assert torch.equal(whole, chunked), elements
    assert not torch.equal(whole, sample_tokens(logits, keys, 0, params)[0])


SAMPLERS = [
    SamplingParams(do_sample=False),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.1, top_k=7),
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(temperature=1.0, top_p=0.3),
    SamplingParams(temperature=0.9, top_k=40, top_p=0.8),
    SamplingParams(temperature=1.0, top_k=1000),  # k past the vocabulary: no filter
]


@pytest.mark.parametrize("params", SAMPLERS, ids=repr)
def test_cheap_sampler_equals_the_reference_definition(params, monkeypatch):
    import rayrl.rollout.sampling as sampling

    monkeypatch.setitem(sampling._NOISE_CHUNK_ELEMENTS, "cpu", 1000)  # several chunks a row
    gen = torch.Generator().manual_seed(7)
    keys = sample_keys(1, 2, [f"r{i}" for i in range(24)])
    positions = torch.arange(24) % 5
    for scale in (0.5, 3.0, 8.0):  # near-uniform to peaked: top-p windows of all widths
        logits = torch.randn(24, 700, generator=gen) * scale
        logits[3, 100:110] = logits[3].max() + 1  # tied best scores in one row
        tokens, log_probs = sample_tokens(logits, keys, positions, params)
        ref_tokens, ref_log_probs = reference_sample_tokens(logits, keys, positions, params)
        assert torch.equal(tokens, ref_tokens), (scale, params)
        torch.testing.assert_close(log_probs, ref_log_probs, atol=1e-5, rtol=1e-5)


def test_top_k_with_ties_at_the_kth_score_keeps_them_all():
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, -1.0]]).expand(400, -1)
    keys = sample_keys(0, 0, [str(i) for i in range(400)])
    params = SamplingParams(top_k=2)
    tokens, _ = sample_tokens(logits, keys, 0, params)
    assert torch.equal(tokens, reference_sample_tokens(logits, keys, 0, params)[0])
    assert set(tokens.tolist()) == {0, 1, 2, 3}  # the reference keeps every tie at the k-th


def test_process_logits_filters():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    top_k = process_logits(logits, SamplingParams(top_k=2))
    assert torch.isinf(top_k[0, 2:]).all() and torch.isfinite(top_k[0, :2]).all()
    top_p = process_logits(logits, SamplingParams(top_p=0.7))  # 0.5 + 0.25 reaches 0.7
    assert torch.isfinite(top_p[0, :2]).all() and torch.isinf(top_p[0, 2:]).all()
    tiny_p = process_logits(logits, SamplingParams(top_p=0.01))
    assert torch.isfinite(tiny_p[0, 0]) and torch.isinf(tiny_p[0, 1:]).all()
    hot = process_logits(logits, SamplingParams(temperature=2.0))
    assert torch.allclose(hot, logits / 2)


def test_greedy_and_top_k_one_pick_the_argmax():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 100, generator=gen)
    keys = sample_keys(0, 0, [str(i) for i in range(32)])
    greedy, greedy_lp = sample_tokens(logits, keys, 0, SamplingParams(do_sample=False))
    assert torch.equal(greedy, logits.argmax(-1))
    expected_lp = torch.log_softmax(logits, -1).gather(-1, greedy[:, None])[:, 0]
    assert torch.allclose(greedy_lp, expected_lp)
    top1, top1_lp = sample_tokens(logits, keys, 3, SamplingParams(top_k=1, temperature=0.9))
    assert torch.equal(top1, greedy)
    assert torch.allclose(top1_lp, torch.zeros(32))
    zero_t, _ = sample_tokens(logits, keys, 3, SamplingParams(temperature=0.0))
    assert torch.equal(zero_t, greedy)


def test_log_probs_are_under_the_processed_distribution():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 40, generator=gen)
    keys = sample_keys(5, 1, [str(i) for i in range(16)])
    params = SamplingParams(temperature=0.7, top_k=10)
    tokens, log_probs = sample_tokens(logits, keys, 2, params)
    processed = torch.log_softmax(process_logits(logits, params), -1)
    assert torch.allclose(log_probs, processed.gather(-1, tokens[:, None])[:, 0])
    assert bool(torch.isfinite(log_probs).all())


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"n": 0}, "n=0"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"stop": ("",)}, "stop strings"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)


def test_sampling_params_normalise():
    params = SamplingParams(stop="###", stop_token_ids=[3, 4])
    assert params.stop == ("###",) and params.stop_token_ids == (3, 4)
    assert SamplingParams(temperature=0).greedy and SamplingParams(do_sample=False).greedy
    assert not SamplingParams().greedy


def test_rollout_ignore_eos_reaches_training_sampling_only():
    """`actor_rollout_ref.rollout.ignore_eos` (verl's key) makes training responses run
    to max_response_length; validation still stops at EOS."""
    from types import SimpleNamespace

    from rayrl.config.load import load_config
    from rayrl.workers.actor import ActorRolloutRefWorker

    def params(overrides, validate):
        worker = SimpleNamespace(cfg=load_config("grpo", overrides))
        return ActorRolloutRefWorker.sampling_params(worker, "validate" if validate else "train")

    assert not params([], validate=False).ignore_eos
    assert params(["actor_rollout_ref.rollout.ignore_eos=true"], validate=False).ignore_eos
    assert not params(["actor_rollout_ref.rollout.ignore_eos=true"], validate=True).ignore_eos
