"""NativeRolloutEngine on CPU (torch kernels, float32): greedy tokens against transformers'
``generate()`` with continuous batching, chunked prefill and preemption; the output
contract; seeded sampling the same as the HF engine's and independent of the batch;
stop tokens and strings; n samples sharing one prefill; sleep/wake; weight updates."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    Qwen3Config,
)

from native_toys import InstantTurns, gpt2_config, perturbed
from rayrl.batch import Batch
from rayrl.models.tiny import build_tiny_model
from rayrl.rollout import (
    ROLLOUT_ENGINES,
    HFRolloutEngine,
    NativeRolloutEngine,
    SamplingParams,
    UnknownNameError,
    make_rollout_engine,
    positions_from_mask,
)
from rayrl.rollout.native.spec import UnsupportedModelError

TINY = dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab_size=320)
TEXTS = [
    "1 + 2 =",
    "the answer is",
    "Tom has 3 apples. How many does he have after eating one?",
    "x",
    "12 * 13 = 156, and 7 + 8 = 15, so",
    "hello there",
    "what is 9 - 4",
]
R = 10
# Few slots and blocks, a small prefill budget: continuous batching, chunked prefill.
SMALL = dict(device="cpu", block_size=4, max_num_seqs=3, max_num_batched_tokens=8)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("native") / "tiny", **TINY)
    model = perturbed(AutoModelForCausalLM.from_pretrained(path))
    model.save_pretrained(path)  # the perturbed weights, loaded by model_path below
    return str(path)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def engine(model_dir):
    return NativeRolloutEngine(model_path=model_dir, **SMALL)


def hf_greedy(model, prompt: list[int], new: int) -> list[int]:
    """transformers' greedy ``generate()``, never stopping early (EOS may be generated)."""
    saved, model.generation_config = model.generation_config, GenerationConfig()
    config = GenerationConfig(
        do_sample=False, max_new_tokens=new, eos_token_id=None, pad_token_id=0
    )
    try:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), generation_config=config)
    finally:
        model.generation_config = saved
    return out[0, len(prompt) :].tolist()


def make_prompts(tokenizer, texts=TEXTS, step=0) -> Batch:
    enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
    uids = [f"p{i}" for i in range(len(texts))]
    columns = {**enc, "position_ids": positions_from_mask(enc["attention_mask"])}
    return Batch.from_dict({**columns, "uid": uids, "tag": list(texts)}, meta={"step": step})


def test_greedy_matches_transformers_with_continuous_batching(engine, hf_model, tokenizer):
    prompts = [tokenizer.encode(t) for t in TEXTS]
    assert max(map(len, prompts)) > SMALL["max_num_batched_tokens"]  # some prompts chunk
    params = SamplingParams(do_sample=False, max_new_tokens=R, ignore_eos=True)
    out = engine.generate_token_ids(prompts, params)
    expected = [hf_greedy(hf_model, p, R) for p in prompts]
    assert out.tokens.tolist() == expected
    assert out.lengths.tolist() == [R] * len(prompts)
    # 7 prompts through 3 slots: prefill steps interleave with decode steps.
    assert engine.last_stats["prefill_steps"] >= len(prompts) // 3 + 1


def test_preemption_recomputes_and_keeps_outputs(model_dir, hf_model, tokenizer):
    prompts = [tokenizer.encode(t) for t in TEXTS[:4]]
    tight = NativeRolloutEngine(
        model_path=model_dir, device="cpu", block_size=4, max_num_seqs=4, cpu_cache_tokens=48
    )
    out = tight.generate_token_ids(prompts, SamplingParams(do_sample=False, max_new_tokens=R))
    assert tight.last_stats["preemptions"] > 0
    for row, prompt, length in zip(out.tokens, prompts, out.lengths.tolist(), strict=True):
        assert row[:length].tolist() == hf_greedy(hf_model, prompt, R)[:length]


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_other_families_match_transformers(family, tokenizer):
    common = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    if family == "qwen3":
        config = Qwen3Config(head_dim=16, **common)
    else:  # Llama 3 rope scaling and attention biases
        rope = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        config = LlamaConfig(attention_bias=True, rope_parameters=rope, **common)
    torch.manual_seed(0)
    model = perturbed(AutoModelForCausalLM.from_config(config), seed=1)
    engine = NativeRolloutEngine(model=model, tokenizer=tokenizer, **SMALL)
    prompts = [tokenizer.encode(t) for t in TEXTS[:4]]
    out = engine.generate_token_ids(prompts, SamplingParams(do_sample=False, max_new_tokens=8))
    assert out.tokens.tolist() == [hf_greedy(model, p, 8) for p in prompts]


def test_output_contract_and_sampling_match_the_hf_engine(engine, model_dir, tokenizer):
    prompts = make_prompts(tokenizer, step=2)
    hf = HFRolloutEngine(model_path=model_dir, device="cpu")
    for params in (
        SamplingParams(n=3, max_new_tokens=R, seed=1, ignore_eos=True),
        SamplingParams(n=2, max_new_tokens=R, seed=4, temperature=0.8, top_p=0.9, top_k=40),
        SamplingParams(n=1, max_new_tokens=R, do_sample=False),
    ):
        out, ref = engine.generate(prompts, params), hf.generate(prompts, params)
        assert set(out.keys()) == set(ref.keys()) and out.meta == {"step": 2}
        for key in ref.tensors:
            assert out[key].shape == ref[key].shape and out[key].dtype == ref[key].dtype, key
        # Same logits up to float rounding and the same seeded draws: the same samples.
        for key in ("responses", "response_mask", "input_ids", "attention_mask", "position_ids"):
            assert torch.equal(out[key], ref[key]), (key, params)
        for key in ("sample_uid", "finish_reason", "uid", "tag"):
            assert list(out[key]) == list(ref[key]), key
        torch.testing.assert_close(
            out["rollout_log_probs"], ref["rollout_log_probs"], atol=1e-4, rtol=1e-4
        )


def test_sampling_does_not_depend_on_the_batch(engine, model_dir, tokenizer):
    prompts = make_prompts(tokenizer, step=5)
    params = SamplingParams(n=2, max_new_tokens=R, seed=11, temperature=0.9, ignore_eos=True)
    full = engine.generate(prompts, params)
    perm = [4, 2, 0, 6, 1, 5, 3]
    permuted = engine.generate(prompts[perm], params)
    rows = torch.tensor([2 * i + k for i in perm for k in range(2)])
    assert torch.equal(permuted["responses"], full["responses"][rows])
    roomy = NativeRolloutEngine(model_path=model_dir, device="cpu", max_num_seqs=64)
    halves = [roomy.generate(prompts[s], params) for s in (slice(0, 3), slice(3, 7))]
    assert torch.equal(Batch.concat(halves)["responses"], full["responses"])
    other = engine.generate(make_prompts(tokenizer, step=6), params)
    assert not torch.equal(other["responses"], full["responses"])


def test_stop_tokens_strings_and_eos(engine, tokenizer):
    prompts = [tokenizer.encode(t) for t in TEXTS]
    free = engine.generate_token_ids(
        prompts, SamplingParams(do_sample=False, max_new_tokens=R, ignore_eos=True)
    ).tokens
    stop = int(free[0, 2])
    out = engine.generate_token_ids(
        prompts,
        SamplingParams(do_sample=False, max_new_tokens=R, ignore_eos=True, stop_token_ids=(stop,)),
    )
    for row, length, stopped, tokens in zip(
        free, out.lengths, out.stopped, out.tokens, strict=True
    ):
        hits = (row == stop).nonzero()
        want = int(hits[0]) + 1 if len(hits) else R
        assert (int(length), bool(stopped)) == (want, bool(len(hits)))
        assert tokens[:want].tolist() == row[:want].tolist()
    text = tokenizer.decode(free[1, 1:3])
    out = engine.generate_token_ids(
        prompts, SamplingParams(do_sample=False, max_new_tokens=R, ignore_eos=True, stop=(text,))
    )
    length = int(out.lengths[1])
    assert bool(out.stopped[1]) and length <= 3 and text in tokenizer.decode(free[1, :length])
    assert text not in tokenizer.decode(free[1, : length - 1])
    eos_out = engine.generate_token_ids(  # without ignore_eos the model's EOS ids stop too
        prompts, SamplingParams(do_sample=False, max_new_tokens=R, stop_token_ids=(stop,))
    )
    enders = {stop, *engine.eos_ids}
    want = [next((i + 1 for i, t in enumerate(row) if t in enders), R) for row in free.tolist()]
    assert eos_out.lengths.tolist() == want and want != out.lengths.tolist()


@pytest.mark.parametrize("cache_tokens", [65536, 64], ids=["roomy", "preempting"])
def test_overlapped_decode_matches_the_synchronous_path(model_dir, tokenizer, cache_tokens):
    """Decode steps launched before the last one's commit (input tokens fed on the device,
    stops found a step late, the extra token dropped) give exactly the synchronous outputs:
    greedy and seeded sampling, stop tokens, stop strings, per-row length limits, and
    preemption (which falls back to the synchronous path)."""
    prompts = [tokenizer.encode(t) for t in TEXTS]
    kw = dict(
        model_path=model_dir,
        tokenizer=tokenizer,
        device="cpu",
        block_size=4,
        max_num_seqs=16,
        max_num_batched_tokens=8,
        cpu_cache_tokens=cache_tokens,
        enable_prefix_caching=False,  # both engines compute every prompt in full
    )
    sync = NativeRolloutEngine(overlap_decode=False, **kw)
    overlap = NativeRolloutEngine(**kw)
    free = sync.generate_token_ids(
        prompts, SamplingParams(do_sample=False, max_new_tokens=R, ignore_eos=True)
    ).tokens
    limits = [R - i % 4 for i in range(2 * len(prompts))]
    drawn = SamplingParams(n=2, max_new_tokens=R, seed=3, temperature=0.9)
    sampled = sync.generate_token_ids(prompts, drawn).tokens
    text = tokenizer.decode(sampled[3, 2:4])  # sample 3 stops at its 4th token (or before)
    cases = [
        (
            SamplingParams(do_sample=False, max_new_tokens=R, stop_token_ids=(int(free[0, 2]),)),
            None,
        ),
        (dataclasses.replace(drawn, stop=(text,)), limits),
        (SamplingParams(n=2, max_new_tokens=R, seed=4, ignore_eos=True), limits),
    ]
    dropped = overlapped = 0
    for params, max_new in cases:
        want = sync.generate_token_ids(prompts, params, max_new_tokens=max_new)
        got = overlap.generate_token_ids(prompts, params, max_new_tokens=max_new)
        for key in ("tokens", "lengths", "log_probs", "stopped"):
            assert torch.equal(getattr(got, key), getattr(want, key)), (key, params)
        assert sync.last_stats["overlapped_steps"] == 0
        overlapped += overlap.last_stats["overlapped_steps"]
        dropped += overlap.last_stats["dropped_tokens"]
        assert want.stopped.any() or params.ignore_eos
    tight = cache_tokens == 64
    assert overlapped > 0 and (dropped > 0 or tight)  # roomy: some stops found a step late
    assert (overlap.last_stats["preemptions"] > 0) == tight


def test_prompts_seen_before_prefill_only_what_the_prefix_cache_lacks(model_dir, tokenizer):
    """A second call with the same prompts claims their cached full blocks: fewer
    prefilled tokens, the same tokens drawn (log-probs equal up to the prefill's
    chunking); new weights forget the cache, and a preempted sample recomputed finds
    its own blocks again."""
    prompts = [tokenizer.encode(t) for t in TEXTS]
    params = SamplingParams(n=2, max_new_tokens=R, seed=2)
    cached = NativeRolloutEngine(model_path=model_dir, device="cpu", block_size=4)
    plain = NativeRolloutEngine(
        model_path=model_dir, device="cpu", block_size=4, enable_prefix_caching=False
    )
    want = plain.generate_token_ids(prompts, params)
    first = cached.generate_token_ids(prompts, params)
    assert first.tokens.equal(want.tokens) and cached.last_stats["prefix_hit_tokens"] == 0
    again = cached.generate_token_ids(prompts, params)
    stats = cached.last_stats
    full = sum((len(p) - 1) // 4 * 4 for p in prompts)
    assert stats["prefix_hit_tokens"] == full and stats["prefix_tokens"] == sum(map(len, prompts))
    assert stats["prefill_tokens"] == sum(map(len, prompts)) - full
    assert again.tokens.equal(want.tokens) and again.lengths.equal(want.lengths)
    torch.testing.assert_close(again.log_probs, want.log_probs, atol=1e-5, rtol=0)
    cached.update_weights(AutoModelForCausalLM.from_pretrained(model_dir).state_dict())
    cached.generate_token_ids(prompts, params)
    assert cached.last_stats["prefix_hit_tokens"] == 0  # new weights: nothing reused
    tight = NativeRolloutEngine(
        model_path=model_dir, device="cpu", block_size=4, max_num_seqs=4, cpu_cache_tokens=48
    )
    out = tight.generate_token_ids(prompts[:4], SamplingParams(do_sample=False, max_new_tokens=R))
    assert tight.last_stats["preemptions"] > 0 and tight.last_stats["prefix_hit_tokens"] > 0
    ref = plain.generate_token_ids(prompts[:4], SamplingParams(do_sample=False, max_new_tokens=R))
    assert out.tokens.equal(ref.tokens)


def test_n_samples_share_one_prefill(model_dir, tokenizer):
    calls = []
    engine = NativeRolloutEngine(model_path=model_dir, device="cpu", block_size=4)
    forward = engine.model.forward
    engine.model.forward = lambda step, cache: (calls.append(step), forward(step, cache))[1]
    prompts = [tokenizer.encode(t) for t in TEXTS[:3]]
    out = engine.generate_token_ids(prompts, SamplingParams(n=4, max_new_tokens=4, ignore_eos=True))
    prefilled = sum(len(s.input_ids) for s in calls if not s.decode)
    assert prefilled == sum(map(len, prompts))  # once per prompt, not once per sample
    assert len({tuple(r) for r in out.tokens[:4].tolist()}) > 1  # the 4 samples differ


def test_prefill_step_inputs_of_resumed_and_fresh_chunks():
    """A prefill step's inputs, built for all chunks at once, are each chunk's own: its
    tokens, their positions past its cached prefix, their cache slots through its row of
    the block table; the Triton tiles read back as (sequence, first query) pairs."""
    from rayrl.rollout.native.runner import _prefill_inputs, _tiles
    from rayrl.rollout.native.scheduler import Chunk, Job
    from rayrl.rollout.native.step import PREFILL_TILE

    bs, rng = 4, np.random.default_rng(0)
    table = rng.permutation(200).astype(np.int32).reshape(5, 40)
    jobs = [Job(rng.integers(0, 99, n), [i]) for i, n in enumerate((30, 7, 150))]
    chunks = [Chunk(jobs[0], 21, 9, 3), Chunk(jobs[1], 0, 5, 0), Chunk(jobs[2], 3, 147, 1)]
    host = _prefill_inputs(chunks, table, bs)
    ids, pos, slots = [], [], []
    for c in chunks:
        p = np.arange(c.start, c.start + c.count)
        ids += c.job.tokens[p].tolist()
        pos += p.tolist()
        slots += (table[c.row, p // bs].astype(np.int64) * bs + p % bs).tolist()
    assert host["input_ids"].tolist() == ids and host["positions"].tolist() == pos
    assert host["slot_mapping"].tolist() == slots
    assert host["q_start"].tolist() == [0, 9, 14, 161]
    assert host["seq_lens"].tolist() == [30, 5, 150] and host["seq_rows"].tolist() == [3, 0, 1]
    assert host["last"].tolist() == [8, 160]  # the second chunk does not complete its job
    tiles = torch.from_numpy(_tiles(host["q_start"])).view(torch.int32).view(-1, 2)
    expected = [(0, 0), (1, 0)] + [(2, a) for a in range(0, 147, PREFILL_TILE)]
    assert [tuple(t) for t in tiles.tolist()] == expected


def test_resumed_turns_are_prefilled_together_with_the_same_tokens(model_dir, tokenizer):
    """Samples whose answers come back while others decode wait, and are prefilled
    together, in fewer prefill steps than one each; every token is the same."""
    prompts = [tokenizer.encode(t) for t in TEXTS]
    sampling = SamplingParams(n=4, max_new_tokens=48, seed=3, stop_token_ids=list(range(3, 512, 6)))
    outs, stats = {}, {}
    for cost in (0.0, 4.0):
        engine = NativeRolloutEngine(model_path=model_dir, device="cpu", resume_prefill_cost=cost)
        outs[cost] = engine.generate_token_ids(prompts, sampling, turns=InstantTurns(48))
        stats[cost] = engine.last_stats
    assert stats[0.0]["resumed_turns"] == stats[4.0]["resumed_turns"] > 2 * len(prompts)
    assert stats[4.0]["prefill_steps"] < stats[0.0]["prefill_steps"] / 2
    for field in ("tokens", "lengths", "stopped"):
        assert torch.equal(getattr(outs[0.0], field), getattr(outs[4.0], field)), field
    assert torch.allclose(outs[0.0].log_probs, outs[4.0].log_probs, atol=1e-5)


@pytest.mark.parametrize(
    ("n", "sizes"),
    [(4, {}), (2, dict(block_size=4, max_num_seqs=3, max_num_batched_tokens=8))],
    ids=["roomy", "small"],
)
def test_resumed_turns_prefilled_behind_a_decode_step_give_the_same_tokens(
    model_dir, tokenizer, n, sizes
):
    """With overlapped decoding, a resumed turn's prefill is queued behind the decode
    step in flight, which is committed meanwhile, and the next decode step takes the
    prefilled samples' first tokens from the device beside the others' from the host:
    the episodes are token for token those of an engine that commits every step before
    the next (also with few slots and blocks, chunked prefill and reclaimed KV)."""
    prompts = [tokenizer.encode(t) for t in TEXTS]
    sampling = SamplingParams(n=n, max_new_tokens=48, seed=3, stop_token_ids=list(range(3, 512, 6)))
    outs, stats = {}, {}
    for overlap in (False, True):
        engine = NativeRolloutEngine(
            model_path=model_dir,
            **{"device": "cpu", **sizes},
            overlap_decode=overlap,
            resume_prefill_cost=0.0,
        )
        outs[overlap] = engine.generate_token_ids(prompts, sampling, turns=InstantTurns(48))
        stats[overlap] = engine.last_stats
    assert stats[False]["overlapped_prefills"] == 0
    assert stats[True]["overlapped_prefills"] > len(prompts)
    assert stats[True]["resumed_turns"] == stats[False]["resumed_turns"] > 2 * len(prompts)
    for field in ("tokens", "lengths", "stopped"):
        assert torch.equal(getattr(outs[False], field), getattr(outs[True], field)), field
    assert torch.allclose(outs[False].log_probs, outs[True].log_probs, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sleep_on_cuda_gives_back_the_cache_and_replays_the_same_graphs(model_dir, tokenizer):
    """On CUDA the KV cache keeps its address across `sleep` (CUDA's virtual memory):
    its pages go back to the device (free memory rises by the cache's size) and come
    back at `wake` while torch's own cached blocks stay cached, the CUDA graphs (every
    bucket's, captured by the first batch that needed one) stay and are replayed after
    the wake with no capture, and the tokens stay the same."""
    engine = NativeRolloutEngine(model_path=model_dir, device="cuda", max_num_seqs=8)
    assert engine.cache.fixed_address
    params = SamplingParams(n=2, max_new_tokens=R, seed=3, ignore_eos=True)
    first = engine.generate(make_prompts(tokenizer), params)
    graphs, address = engine.runner.graphs, engine.cache.data.data_ptr()
    captures = graphs.captures
    assert captures == len(graphs.buckets) == len(graphs.graphs)  # every bucket, at once
    torch.cuda.synchronize()
    awake, reserved = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
    engine.sleep()
    asleep = torch.cuda.mem_get_info()[0]
    assert asleep - awake >= engine.cache.nbytes  # the pages went back
    assert torch.cuda.memory_reserved() == reserved  # torch's cached blocks (a trainer's) stay
    engine.wake()
    assert asleep - torch.cuda.mem_get_info()[0] >= engine.cache.nbytes  # taken back
    again = engine.generate(make_prompts(tokenizer), params)
    assert engine.runner.graphs is graphs and graphs.captures == captures  # replayed
    assert engine.cache.data.data_ptr() == address
    assert torch.equal(again["responses"], first["responses"])
    engine.sleep()
    assert torch.cuda.mem_get_info()[0] >= asleep - (64 << 20)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sleep_without_a_fixed_address_drops_the_graphs_and_gives_back_all(
    model_dir, tokenizer, monkeypatch
):
    """Where the driver gives no fixed address, the cache comes from torch, `sleep` gives
    back everything the wake and the generation took (the KV cache, the graphs' pool),
    with no garbage collection: allocated memory returns to what it was asleep before
    (the first round leaves cuBLAS's per-stream workspaces, which stay), and the
    tokens stay the same."""
    from rayrl.rollout.native import vmm

    monkeypatch.setattr(vmm.VirtualBuffer, "create", classmethod(lambda cls, size, device: None))
    engine = NativeRolloutEngine(model_path=model_dir, device="cuda", max_num_seqs=8)
    assert not engine.cache.fixed_address
    params = SamplingParams(n=2, max_new_tokens=R, seed=3, ignore_eos=True)
    first = engine.generate(make_prompts(tokenizer), params)
    engine.sleep()
    assert engine.runner.graphs is None
    torch.cuda.synchronize()
    asleep = torch.cuda.memory_allocated()
    engine.wake()
    cache = engine.cache.data.nbytes
    again = engine.generate(make_prompts(tokenizer), params)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.captures == len(graphs.graphs) > 0  # captured
    assert torch.cuda.memory_allocated() >= asleep + cache
    assert torch.equal(again["responses"], first["responses"])
    del graphs  # the test's own reference would keep the graphs' pool
    engine.sleep()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= asleep


def test_sleep_frees_the_cache_and_wake_restores_it(engine, tokenizer):
    prompts = make_prompts(tokenizer)
    params = SamplingParams(n=2, max_new_tokens=R, seed=2)
    before = engine.generate(prompts, params)
    engine.sleep()
    assert engine.is_asleep and not engine.cache.allocated
    engine.sleep()  # idempotent
    with pytest.raises(RuntimeError, match="wake"):
        engine.generate(prompts, params)
    engine.wake()
    assert engine.cache.allocated
    engine.cache.data.fill_(float("nan"))  # a reallocated cache holds anything
    assert torch.equal(engine.generate(prompts, params)["responses"], before["responses"])


def test_without_loading_the_weights_a_complete_update_fills_them(model_dir, hf_model, tokenizer):
    """`load_weights=False` reads the directory's config and tokenizer only: generating
    is refused until `update_weights` has set every weight (a hybrid actor's first
    sync), and then the engine samples as one that read the checkpoint."""
    loaded = NativeRolloutEngine(model_path=model_dir, **SMALL)
    empty = NativeRolloutEngine(model_path=model_dir, load_weights=False, **SMALL)
    prompts = make_prompts(tokenizer)
    params = SamplingParams(n=2, max_new_tokens=R, seed=4)
    state = list(hf_model.state_dict().items())
    empty.update_weights(state[:3])
    with pytest.raises(RuntimeError, match="never set .*update_weights"):
        empty.generate(prompts, params)
    empty.update_weights(state[3:])
    out = empty.generate(prompts, params)
    assert torch.equal(out["responses"], loaded.generate(prompts, params)["responses"])


def test_update_weights_in_place(tmp_path, tokenizer):
    path = build_tiny_model(tmp_path / "untied", tie_embeddings=False, **TINY)
    engine = make_rollout_engine("native", model_path=str(path), **SMALL)
    prompts = make_prompts(tokenizer)
    params = SamplingParams(n=2, max_new_tokens=R, ignore_eos=True, seed=5)
    token = 77
    assert not bool((engine.generate(prompts, params)["responses"] == token).all())
    hf = AutoModelForCausalLM.from_pretrained(path)
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    for name, value in state.items():  # `token` becomes certain after any input
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            value.zero_()
    state["model.embed_tokens.weight"][:, 0] = 1.0
    state["model.norm.weight"].zero_()
    state["model.norm.weight"][0] = 1.0
    state["lm_head.weight"].zero_()
    state["lm_head.weight"][token, 0] = 1e3
    ptrs = [t.data_ptr() for t in engine.weights.tensors()]
    assert engine.update_weights(state.items()) == len(state)
    assert [t.data_ptr() for t in engine.weights.tensors()] == ptrs  # in place
    out = engine.generate(prompts, params)
    assert bool((out["responses"] == token).all())
    assert torch.allclose(
        out["rollout_log_probs"], torch.zeros_like(out["rollout_log_probs"]), atol=1e-5
    )
    with pytest.raises(KeyError, match="lm_head.weight"):
        engine.update_weights({"lm_head.weigth": torch.zeros(1)})
    with pytest.raises(ValueError, match="unsharded"):
        engine.update_weights([("lm_head.weight", torch.zeros(3, 3))])


def test_registry_and_input_errors(engine, model_dir, tokenizer):
    assert ROLLOUT_ENGINES.get("native") is NativeRolloutEngine
    with pytest.raises(UnknownNameError, match="native"):
        make_rollout_engine("nativ", model_path=model_dir)
    with pytest.raises(ValueError, match="exactly one"):
        NativeRolloutEngine()
    with pytest.raises(UnsupportedModelError, match="rollout.name=hf"):
        NativeRolloutEngine(model=AutoModelForCausalLM.from_config(gpt2_config()))
    short = NativeRolloutEngine(model_path=model_dir, device="cpu", max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len=64"):
        short.generate_token_ids([[1] * 60], SamplingParams(max_new_tokens=10))
    with pytest.raises(ValueError, match="empty"):
        short.generate_token_ids([[]], SamplingParams(max_new_tokens=10))
    empty = engine.generate(make_prompts(tokenizer)[[]], SamplingParams(max_new_tokens=2))
    assert len(empty) == 0 and tuple(empty["responses"].shape) == (0, 2)
    no_uid = make_prompts(tokenizer).select("input_ids", "attention_mask")
    with pytest.raises(KeyError, match="'uid'"):
        engine.generate(no_uid, SamplingParams(max_new_tokens=2))
    assert np.array_equal(engine.runner.table_host.shape, (3, 2048 // 4))


def test_a_later_turn_finds_the_blocks_its_earlier_turn_decoded(model_dir, tokenizer):
    """Blocks filled while decoding are recorded as the prefill's are: a prompt that is
    an earlier prompt and its response (the next turn of an episode) claims every full
    block of it, those the response filled included, and draws what a cold engine does."""
    prompt = tokenizer.encode(TEXTS[0])
    greedy = SamplingParams(do_sample=False, max_new_tokens=R, ignore_eos=True)
    engine = NativeRolloutEngine(model_path=model_dir, device="cpu", block_size=4)
    first = engine.generate_token_ids([prompt], greedy)
    turn = prompt + first.tokens[0, : int(first.lengths[0])].tolist()
    assert (len(turn) - 1) // 4 > len(prompt) // 4  # the response filled blocks
    again = engine.generate_token_ids([turn], greedy)
    assert engine.last_stats["prefix_hit_tokens"] == (len(turn) - 1) // 4 * 4
    cold = NativeRolloutEngine(
        model_path=model_dir, device="cpu", block_size=4, enable_prefix_caching=False
    )
    assert again.tokens.equal(cold.generate_token_ids([turn], greedy).tokens)
