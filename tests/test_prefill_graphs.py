"""Small prefill steps in padded token-count buckets (`PrefillGraphs`): on CPU the
padded inputs run eagerly (the same staging and padding as a CUDA graph's replay, no
capture), and the episodes' tokens are those of plain prefill steps; on CUDA the
buckets are captured and replayed, with the same tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from native_toys import InstantTurns, perturbed
from rayrl.models.tiny import build_tiny_model
from rayrl.rollout import NativeRolloutEngine, SamplingParams
from rayrl.rollout.native.prefill_graphs import (
    CAPTURE_AFTER,
    PrefillGraphs,
    prefill_buckets,
)
from rayrl.rollout.native.runner import _prefill_inputs, _tiles
from rayrl.rollout.native.scheduler import Chunk, Job

TINY = dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab_size=320)
TEXTS = ["1 + 2 =", "the answer is", "Tom has 3 apples. How many are left?", "x", "what is 9"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("prefill") / "tiny", **TINY)
    perturbed(AutoModelForCausalLM.from_pretrained(path)).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def prompts(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer.encode(t) for t in TEXTS]


def test_buckets_cover_every_size_up_to_the_limit():
    assert prefill_buckets(2048) == [16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
    assert prefill_buckets(100) == [16, 32, 64, 96, 100]
    assert prefill_buckets(16) == [16]


def test_padding_does_no_work_and_writes_nothing(model_dir):
    """The staged buffer of a step: its own values first, then padding that writes no
    cache slot (-1), gives the padded sequences no queries and no context, and points
    the padded attention tiles at a padded sequence."""
    engine = NativeRolloutEngine(model_path=model_dir, device="cpu", block_size=4)
    graphs = PrefillGraphs(engine.runner, 64, max_seqs=8, capture=False)
    rng = np.random.default_rng(0)
    table = rng.permutation(200).astype(np.int32).reshape(5, 40)
    jobs = [Job(rng.integers(0, 99, n), [i]) for i, n in enumerate((30, 7))]
    host = _prefill_inputs([Chunk(jobs[0], 21, 9, 3), Chunk(jobs[1], 0, 5, 0)], table, 4)
    tiles = _tiles(host["q_start"])
    size = graphs.bucket(14)
    layout = graphs.layouts[size]
    graphs._stage(size, host, tiles)
    step = graphs._step(size)
    assert size == 16 and layout.seqs == 9 and layout.logits == 8
    assert step.slot_mapping[:14].tolist() == host["slot_mapping"].tolist()
    assert step.slot_mapping[14:].tolist() == [-1, -1]
    assert step.q_start.tolist() == [0, 9, 14] + [14] * 7
    assert step.seq_lens.tolist() == [30, 5] + [0] * 7
    assert step.logits_rows.tolist() == [8] + [0] * 7  # the second chunk does not complete
    pairs = [tuple(t) for t in step.tiles.tolist()]
    assert pairs[:2] == [(0, 0), (1, 0)] and set(pairs[2:]) == {(layout.seqs - 1, 0)}


def test_padded_prefill_steps_give_the_same_episodes(model_dir, prompts):
    """Multi-turn episodes (resumed turns prefilled onto their own cache) and chunked
    prompts: with the padded steps the tokens are those of plain prefill steps."""
    sampling = SamplingParams(n=3, max_new_tokens=40, seed=5, stop_token_ids=list(range(3, 320, 6)))
    outs, used = [], None
    for padded in (False, True):
        engine = NativeRolloutEngine(
            model_path=model_dir, device="cpu", block_size=4, max_num_batched_tokens=24
        )
        if padded:
            used = engine.runner.prefill_graphs = PrefillGraphs(
                engine.runner, 24, engine.max_num_seqs, capture=False
            )
        outs.append(engine.generate_token_ids(prompts, sampling, turns=InstantTurns(40)))
    assert engine.last_stats["resumed_turns"] > len(prompts)
    assert sum(used.seen.values()) == engine.last_stats["prefill_steps"]  # every step padded
    assert len(used.seen) > 1 and used.captures == 0
    for field in ("tokens", "lengths", "stopped"):
        assert torch.equal(getattr(outs[0], field), getattr(outs[1], field)), field
    assert torch.allclose(outs[0].log_probs, outs[1].log_probs, atol=1e-5)


def test_steps_too_large_for_a_bucket_run_as_before(model_dir, prompts):
    engine = NativeRolloutEngine(model_path=model_dir, device="cpu", block_size=4)
    graphs = engine.runner.prefill_graphs = PrefillGraphs(
        engine.runner, 16, engine.max_num_seqs, capture=False
    )
    engine.generate_token_ids(prompts, SamplingParams(max_new_tokens=4))
    assert sum(map(len, prompts)) > 16 and not graphs.seen  # one 40-token step: eager
    with pytest.raises(ValueError, match="prefill_graph_tokens"):
        NativeRolloutEngine(model_path=model_dir, device="cpu", prefill_graph_tokens=-1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prefill_graphs_on_cuda_replay_with_the_same_tokens(model_dir, prompts):
    """On CUDA the resumed turns' prefill steps are captured per bucket (from the
    `CAPTURE_AFTER`-th step of a bucket, the first where the cache keeps its address) and
    replayed; float32, so that the padded
    buckets' matmuls agree with the plain steps' to rounding: the same tokens."""
    sampling = SamplingParams(n=3, max_new_tokens=40, seed=5, stop_token_ids=list(range(3, 320, 6)))
    outs, stats = [], []
    for tokens in (0, 64):
        engine = NativeRolloutEngine(
            model_path=model_dir, device="cuda", dtype="float32", prefill_graph_tokens=tokens
        )
        outs.append(engine.generate_token_ids(prompts, sampling, turns=InstantTurns(40)))
        stats.append(engine.last_stats)
        if tokens:
            graphs = engine.runner.prefill_graphs
            assert graphs.captures >= 1 and max(graphs.seen.values()) >= graphs.capture_after
            assert graphs.capture_after == (1 if engine.cache.fixed_address else CAPTURE_AFTER)
            engine.sleep()  # the graphs stay where the cache keeps its address
            kept = graphs if engine.cache.fixed_address else None
            assert engine.runner.prefill_graphs is kept
    assert stats[0]["prefill_graph_steps"] == 0 and stats[1]["prefill_graph_steps"] > 0
    assert stats[1]["graph_captures"] > 0 and stats[1]["graph_capture_s"] > 0
    for field in ("tokens", "lengths", "stopped"):
        assert torch.equal(getattr(outs[0], field), getattr(outs[1], field)), field
    assert torch.allclose(outs[0].log_probs, outs[1].log_probs, atol=1e-4)
