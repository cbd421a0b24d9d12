"""HFRolloutEngine on a tiny random Qwen2: the output contract, stopping, seeded replay
(across processes, batch orders and splits), log-probs, sleep/wake and weight updates."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys

import pytest
import torch

from rayrl.batch import Batch
from rayrl.models.tiny import build_tiny_model
from rayrl.rollout import (
    ROLLOUT_ENGINES,
    HFRolloutEngine,
    SamplingParams,
    UnknownNameError,
    make_rollout_engine,
    positions_from_mask,
)

TINY = dict(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, vocab_size=320)
TEXTS = ["1 + 2 =", "the answer is", "Tom has 3 apples. How many", "x"]
R = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("rollout") / "tiny", **TINY))


@pytest.fixture(scope="module")
def engine(model_dir):
    return HFRolloutEngine(model_path=model_dir, device="cpu")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_prompts(tokenizer, texts=TEXTS, step=0) -> Batch:
    enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
    uids = [f"p{i}" for i in range(len(texts))]
    columns = {**enc, "position_ids": positions_from_mask(enc["attention_mask"])}
    return Batch.from_dict({**columns, "uid": uids, "tag": list(texts)}, meta={"step": step})


@contextlib.contextmanager
def forced_token(model, token: int, at_call: int, rows=slice(None)):
    """Make `token` certain on the `at_call`-th forward pass (1 = prefill) for `rows`,
    and impossible everywhere else."""
    calls = {"n": 0}

    def hook(module, inputs, logits):
        calls["n"] += 1
        logits = logits.clone()
        logits[:, -1, token] = float("-inf")
        if calls["n"] == at_call:
            logits[rows, -1, token] = 1e4
        return logits

    handle = model.lm_head.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def recompute_log_probs(model, out: Batch, temperature: float) -> torch.Tensor:
    """Log-probs of the responses from one plain forward pass over prompt + response."""
    prompt_len = out["prompts"].shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=out["input_ids"],
            attention_mask=out["attention_mask"],
            position_ids=out["position_ids"],
        ).logits
    logits = logits[:, prompt_len - 1 : -1].float() / temperature
    lp = torch.log_softmax(logits, -1).gather(-1, out["responses"][..., None])[..., 0]
    return lp * out["response_mask"]


def test_output_contract(engine):
    prompts = make_prompts(engine.tokenizer, step=2)
    caches = []
    hook = engine.model.register_forward_pre_hook(
        lambda module, args, kwargs: caches.append(type(kwargs["past_key_values"]).__name__),
        with_kwargs=True,
    )
    try:
        out = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=R, seed=1))
    finally:
        hook.remove()
    assert set(caches) == {"StaticCache"}
    b, p = prompts["input_ids"].shape
    assert len(out) == b * 3
    for key, shape in {
        "prompts": (b * 3, p),
        "responses": (b * 3, R),
        "response_mask": (b * 3, R),
        "rollout_log_probs": (b * 3, R),
        "input_ids": (b * 3, p + R),
        "attention_mask": (b * 3, p + R),
        "position_ids": (b * 3, p + R),
    }.items():
        assert tuple(out[key].shape) == shape, key
    rows = torch.arange(b).repeat_interleave(3)
    assert torch.equal(out["prompts"], prompts["input_ids"][rows])
    assert torch.equal(out["input_ids"], torch.cat([out["prompts"], out["responses"]], 1))
    assert torch.equal(
        out["attention_mask"], torch.cat([prompts["attention_mask"][rows], out["response_mask"]], 1)
    )
    last = prompts["position_ids"][rows, -1:]
    assert torch.equal(out["position_ids"][:, p:], last + torch.arange(1, R + 1))
    assert list(out["uid"]) == [f"p{i}" for i in range(b) for _ in range(3)]
    assert list(out["tag"]) == [t for t in TEXTS for _ in range(3)]
    assert list(out["sample_uid"]) == [f"p{i}/{k}" for i in range(b) for k in range(3)]
    assert out.meta == {"step": 2}
    assert set(out["finish_reason"]) <= {"stop", "length"}
    assert out["rollout_log_probs"].dtype == torch.float32
    assert bool((out["rollout_log_probs"][out["response_mask"] == 0] == 0).all())
    assert bool((out["rollout_log_probs"][out["response_mask"] == 1] < 0).all())
    # Samples of one prompt differ (random tiny model: near-uniform over 320 tokens).
    assert not torch.equal(out["responses"][0], out["responses"][1])
    assert engine.cache == "static"  # no fallback happened


def test_stop_token_ends_and_right_pads(engine):
    prompts = make_prompts(engine.tokenizer)
    stop = 42
    params = SamplingParams(n=2, max_new_tokens=R, stop_token_ids=(stop,), ignore_eos=True)
    with forced_token(engine.model, stop, at_call=3, rows=slice(0, None, 2)):
        out = engine.generate(prompts, params)
    even, odd = slice(0, None, 2), slice(1, None, 2)
    assert list(out["finish_reason"][even]) == ["stop"] * 4
    assert list(out["finish_reason"][odd]) == ["length"] * 4
    assert bool((out["responses"][even, 2] == stop).all())
    assert out["response_mask"][even].sum(1).tolist() == [3] * 4
    assert bool((out["responses"][even, 3:] == engine.pad_id).all())
    assert out["response_mask"][odd].sum(1).tolist() == [R] * 4


def test_eos_at_first_token_ends_every_row(engine):
    prompts = make_prompts(engine.tokenizer)
    eos = engine.eos_ids[0]
    with forced_token(engine.model, eos, at_call=1):
        out = engine.generate(prompts, SamplingParams(n=1, max_new_tokens=R))
    assert list(out["finish_reason"]) == ["stop"] * 4
    assert out["response_mask"].sum(1).tolist() == [1] * 4
    assert bool((out["responses"][:, 0] == eos).all())
    assert bool((out["responses"][:, 1:] == engine.pad_id).all())
    with forced_token(engine.model, eos, at_call=1):
        ignored = engine.generate(prompts, SamplingParams(max_new_tokens=R, ignore_eos=True))
    assert list(ignored["finish_reason"]) == ["length"] * 4


def test_stop_string(engine):
    tok = engine.tokenizer
    (word_id,) = tok.encode("answer")
    prompts = make_prompts(tok)
    with forced_token(engine.model, word_id, at_call=3):
        out = engine.generate(prompts, SamplingParams(max_new_tokens=R, stop=("answer",)))
    assert list(out["finish_reason"]) == ["stop"] * 4
    lengths = out["response_mask"].sum(1)
    assert bool((lengths <= 3).all())
    for row, n in zip(out["responses"], lengths.tolist(), strict=True):
        assert "answer" in tok.decode(row[:n])


def test_replay_is_independent_of_batch_order_and_split(engine):
    prompts = make_prompts(engine.tokenizer, step=5)
    params = SamplingParams(n=2, max_new_tokens=R, seed=11, temperature=0.9, top_p=0.95)
    full = engine.generate(prompts, params)
    again = engine.generate(prompts, params)
    assert torch.equal(full["responses"], again["responses"])

    perm = [2, 0, 3, 1]
    permuted = engine.generate(prompts[perm], params)
    rows = torch.tensor([2 * i + k for i in perm for k in range(2)])
    assert torch.equal(permuted["responses"], full["responses"][rows])
    assert list(permuted["sample_uid"]) == list(full["sample_uid"][rows.numpy()])

    halves = [engine.generate(prompts[s], params) for s in (slice(0, 1), slice(1, 4))]
    joined = Batch.concat(halves)
    assert torch.equal(joined["responses"], full["responses"])
    torch.testing.assert_close(
        joined["rollout_log_probs"], full["rollout_log_probs"], atol=1e-4, rtol=0
    )

    other_step = make_prompts(engine.tokenizer, step=6)
    assert not torch.equal(engine.generate(other_step, params)["responses"], full["responses"])
    other_seed = SamplingParams(n=2, max_new_tokens=R, seed=12, temperature=0.9, top_p=0.95)
    assert not torch.equal(engine.generate(prompts, other_seed)["responses"], full["responses"])


REPLAY_SCRIPT = """
import sys, torch
from transformers import AutoTokenizer
from rayrl.rollout import HFRolloutEngine, SamplingParams
from test_rollout_hf import TEXTS, make_prompts
model_dir, out_path, width = sys.argv[1], sys.argv[2], int(sys.argv[3])
engine = HFRolloutEngine(model_path=model_dir, device="cpu")
prompts = make_prompts(AutoTokenizer.from_pretrained(model_dir), TEXTS)
out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=width, seed=3, top_k=50))
torch.save({k: out[k] for k in ("responses", "rollout_log_probs")}, out_path)
"""


@pytest.mark.slow  # a fresh interpreter imports torch + transformers: ~15-25 s when loaded
def test_replay_in_another_process(engine, model_dir, tmp_path):
    params = SamplingParams(n=2, max_new_tokens=R, seed=3, top_k=50)
    local = engine.generate(make_prompts(engine.tokenizer), params)
    out_path = tmp_path / "remote.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", REPLAY_SCRIPT, model_dir, str(out_path), str(R)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    remote = torch.load(out_path)
    assert torch.equal(remote["responses"], local["responses"])
    torch.testing.assert_close(
        remote["rollout_log_probs"], local["rollout_log_probs"], atol=1e-4, rtol=0
    )


def test_rollout_log_probs_match_a_forward_pass(engine):
    prompts = make_prompts(engine.tokenizer)
    for params in (
        SamplingParams(n=2, max_new_tokens=R, temperature=0.7, seed=4),
        SamplingParams(n=1, max_new_tokens=R, do_sample=False),
    ):
        out = engine.generate(prompts, params)
        temperature = 1.0 if params.greedy else params.temperature
        expected = recompute_log_probs(engine.model, out, temperature)
        torch.testing.assert_close(out["rollout_log_probs"], expected, atol=1e-4, rtol=1e-4)


def test_top_k_one_equals_greedy(engine):
    prompts = make_prompts(engine.tokenizer)
    greedy = engine.generate(prompts, SamplingParams(max_new_tokens=R, do_sample=False))
    top1 = engine.generate(prompts, SamplingParams(max_new_tokens=R, top_k=1, seed=9))
    assert torch.equal(top1["responses"], greedy["responses"])
    zero_t = engine.generate(prompts, SamplingParams(max_new_tokens=R, temperature=0))
    assert torch.equal(zero_t["responses"], greedy["responses"])


def test_sleep_and_wake(engine):
    prompts = make_prompts(engine.tokenizer)
    params = SamplingParams(max_new_tokens=R, seed=2)
    before = engine.generate(prompts, params)
    engine.sleep()
    assert engine.is_asleep
    engine.sleep()  # idempotent
    with pytest.raises(RuntimeError, match="wake"):
        engine.generate(prompts, params)
    engine.wake()
    assert not engine.is_asleep
    assert torch.equal(engine.generate(prompts, params)["responses"], before["responses"])


def _certain_token_weights(model, token: int) -> dict[str, torch.Tensor]:
    """Weights under which `token` is certain after any input (untied embeddings).

    Attention and MLP outputs are zeroed, so the last hidden state is the token's
    embedding; every embedding has 1 in dimension 0 and the final norm keeps only that
    dimension, so the hidden state is a positive multiple of e0; lm_head scores only
    `token` along e0.
    """
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for name, value in state.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            value.zero_()
    state["model.embed_tokens.weight"][:, 0] = 1.0
    state["model.norm.weight"].zero_()
    state["model.norm.weight"][0] = 1.0
    state["lm_head.weight"].zero_()
    state["lm_head.weight"][token, 0] = 1e3
    return state


def test_update_weights_changes_generations(tmp_path):
    model_dir = build_tiny_model(tmp_path / "untied", tie_embeddings=False, **TINY)
    engine = make_rollout_engine("hf", model_path=str(model_dir), device="cpu")
    prompts = make_prompts(engine.tokenizer)
    params = SamplingParams(n=2, max_new_tokens=R, ignore_eos=True, seed=5)
    token = 77
    assert not bool((engine.generate(prompts, params)["responses"] == token).all())
    ptrs = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
    copied = engine.update_weights(_certain_token_weights(engine.model, token))
    assert copied == len(engine.model.state_dict())
    assert {n: p.data_ptr() for n, p in engine.model.named_parameters()} == ptrs  # in place
    out = engine.generate(prompts, params)
    assert bool((out["responses"] == token).all())
    assert torch.allclose(out["rollout_log_probs"], torch.zeros(8, R), atol=1e-5)
    with pytest.raises(KeyError, match="lm_head.weight"):
        engine.update_weights({"lm_head.weigth": torch.zeros(1)})
    with pytest.raises(ValueError, match="unsharded"):
        engine.update_weights([("lm_head.weight", torch.zeros(3, 3))])


def test_an_engine_built_without_weights_waits_for_them_and_reads_nothing(engine, model_dir):
    """`load_weights=False` (an actor's own rollout copy, filled by its weight sync):
    config and tokenizer only; generating before `update_weights` fails; after it, the
    same samples and log-probs as an engine that loaded the directory."""
    from rayrl import reads

    before = reads.total()
    empty = HFRolloutEngine(model_path=model_dir, device="cpu", load_weights=False)
    assert reads.total() == before
    prompts = make_prompts(engine.tokenizer)
    params = SamplingParams(n=2, max_new_tokens=R, seed=3)
    with pytest.raises(RuntimeError, match="call update_weights"):
        empty.generate(prompts, params)
    empty.update_weights(engine.model.named_parameters())  # tied: one name for two
    ours, theirs = empty.generate(prompts, params), engine.generate(prompts, params)
    assert torch.equal(ours["responses"], theirs["responses"])
    assert torch.equal(ours["rollout_log_probs"], theirs["rollout_log_probs"])


def test_hybrid_engine_shares_the_training_model(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir).train()
    engine = HFRolloutEngine(model=model, tokenizer=AutoTokenizer.from_pretrained(model_dir))
    assert engine.model is model and not engine.owns_weights
    saved_config = model.generation_config
    prompts = make_prompts(engine.tokenizer)
    params = SamplingParams(n=2, max_new_tokens=R, ignore_eos=True, seed=5)
    before = engine.generate(prompts, params)
    assert model.training and model.generation_config is saved_config  # restored
    assert engine.update_weights(model.named_parameters()) == 0  # own storage: no copy
    with torch.no_grad():  # the trainer updates its model in place ...
        model.lm_head.weight.mul_(20.0)  # tied: sharper logits, different samples
    after = engine.generate(prompts, params)  # ... and the engine sees it without a sync
    assert not torch.equal(after["responses"], before["responses"])
    greedy = engine.generate(prompts, SamplingParams(max_new_tokens=R, do_sample=False))
    expected = recompute_log_probs(model.eval(), greedy, 1.0)
    torch.testing.assert_close(greedy["rollout_log_probs"], expected, atol=1e-4, rtol=1e-4)


def test_static_cache_falls_back_to_dynamic_once(model_dir, caplog, monkeypatch):
    engine = HFRolloutEngine(model_path=model_dir, device="cpu")
    real_generate = engine.model.generate
    seen = []

    def picky_generate(*args, generation_config, **kwargs):
        seen.append(generation_config.cache_implementation)
        if generation_config.cache_implementation == "static":
            raise NotImplementedError("no static cache for this model")
        return real_generate(*args, generation_config=generation_config, **kwargs)

    monkeypatch.setattr(engine.model, "generate", picky_generate)
    prompts = make_prompts(engine.tokenizer)
    with caplog.at_level(logging.WARNING, logger="rayrl.rollout.hf.engine"):
        first = engine.generate(prompts, SamplingParams(max_new_tokens=R, seed=1))
        second = engine.generate(prompts, SamplingParams(max_new_tokens=R, seed=1))
    assert seen == ["static"]  # the dynamic cache then decodes in the lean loop
    assert engine.cache == "dynamic"
    assert sum("static KV cache failed" in r.getMessage() for r in caplog.records) == 1
    assert torch.equal(first["responses"], second["responses"])


def test_an_error_of_both_caches_is_raised_and_keeps_static(model_dir, monkeypatch):
    engine = HFRolloutEngine(model_path=model_dir, device="cpu", decode="generate")

    def broken_generate(*args, **kwargs):
        raise RuntimeError("broken model")

    monkeypatch.setattr(engine.model, "generate", broken_generate)
    with pytest.raises(RuntimeError, match="broken model"):
        engine.generate(make_prompts(engine.tokenizer), SamplingParams(max_new_tokens=2))
    assert engine.cache == "static"


def test_input_errors(engine):
    prompts = make_prompts(engine.tokenizer)
    params = SamplingParams(max_new_tokens=2)
    no_uid = Batch(prompts.tensors, {}, prompts.meta)
    with pytest.raises(KeyError, match="'uid'"):
        engine.generate(no_uid, params)
    with pytest.raises(KeyError, match="'step'"):
        engine.generate(Batch(prompts.tensors, prompts.non_tensors), params)
    right = engine.tokenizer(TEXTS, return_tensors="pt", padding=True, padding_side="right")
    right_padded = Batch.from_dict({**right, "uid": list("abcd")}, meta={"step": 0})
    with pytest.raises(ValueError, match="LEFT-padded"):
        engine.generate(right_padded, params)
    no_pos = prompts.select("input_ids", "attention_mask", "uid")
    torch.testing.assert_close(
        engine.generate(no_pos, params)["responses"], engine.generate(prompts, params)["responses"]
    )
    empty = engine.generate(prompts[[]], params)
    assert len(empty) == 0 and tuple(empty["responses"].shape) == (0, 2)


def test_registry_and_constructor_errors(model_dir):
    assert ROLLOUT_ENGINES.get("hf") is HFRolloutEngine
    with pytest.raises(UnknownNameError, match="Did you mean 'hf'"):
        make_rollout_engine("hff", model_path=model_dir)
    with pytest.raises(ValueError, match="exactly one"):
        HFRolloutEngine()
    with pytest.raises(ValueError, match="cache="):
        HFRolloutEngine(model_path=model_dir, cache="paged")
