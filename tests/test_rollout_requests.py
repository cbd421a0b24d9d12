"""The request-level engine contract on both engines, the one turn loop, the service.

- requests added while others decode, aborted mid-flight, resumed from a parked turn:
  every sample's tokens are those it draws alone (seeded by its key, batch-independent),
  and an abort frees what the sample held (ids reused, KV blocks back);
- weights changed between steps while samples are in flight: the tokens drawn before
  are the old policy's, the tokens after are the new one's, computed on the KV cache
  the samples kept, each tagged with its version;
- jobs of several threads at once share one loop and draw exactly their own tokens;
- the service: a call that begins while a newer policy is staged waits for it (without
  partial rollouts) and aborts when its samples would lag too far.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from native_toys import InstantTurns, perturbed
from rayrl.models.tiny import build_tiny_model
from rayrl.rollout import HFRolloutEngine, NativeRolloutEngine, SamplingParams
from rayrl.rollout.loop import Job, TurnLoop, responses_of, run_batch
from rayrl.rollout.requests import DONE, TURN
from rayrl.rollout.sampling import sample_keys
from rayrl.rollout.service import Aborted, CallPolicy, RolloutService

TINY = dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab_size=320)
R = 12
FREE = SamplingParams(n=2, max_new_tokens=R, seed=5, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("requests") / "tiny", **TINY)
    model = perturbed(AutoModelForCausalLM.from_pretrained(path))
    model.save_pretrained(path)
    return str(path)


def make_engine(kind: str, model_dir: str):
    if kind == "native":
        return NativeRolloutEngine(model_path=model_dir, device="cpu", block_size=4)
    return HFRolloutEngine(model_path=model_dir, device="cpu", cache="dynamic")


def prompts_and_keys(model_dir: str, count: int = 4, n: int = 2):
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = ["1 + 2 =", "the answer is", "hello there friend", "x y z w v"][:count]
    prompts = [np.asarray(tok.encode(t), dtype=np.int64) for t in texts]
    keys = sample_keys(5, 0, [f"p{i}/{k}" for i in range(count) for k in range(n)]).numpy()
    return prompts, keys


def alone(engine, prompt, keys, sampling=FREE):
    """Each sample's tokens drawn with nothing else in the engine."""
    out = run_batch(engine, [prompt], sampling, keys, np.full(len(keys), R))
    return [out.tokens[i, : out.lengths[i]].tolist() for i in range(len(keys))]


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_requests_added_midway_and_aborted_draw_their_own_tokens(model_dir, kind):
    engine = make_engine(kind, model_dir)
    prompts, keys = prompts_and_keys(model_dir)
    want = [alone(engine, p, keys[2 * i : 2 * i + 2]) for i, p in enumerate(prompts)]
    limits = np.full(2, R)
    first = engine.add(prompts[0], keys[0:2], limits, FREE)
    for _ in range(3):
        engine.step()
    second = engine.add(prompts[1], keys[2:4], limits, FREE)  # joins while others decode
    third = engine.add(prompts[2], keys[4:6], limits, FREE)
    engine.step()
    engine.abort([int(third[0])])  # one sample of a prompt mid-flight, the other goes on
    outputs, steps = {}, 0
    while engine.busy:
        for sample, kind_ in engine.step():
            assert kind_ == DONE
            outputs[sample] = engine.output(sample).tokens.tolist()
        steps += 1
        assert steps < 200
    got = {
        0: [outputs[int(s)] for s in first],
        1: [outputs[int(s)] for s in second],
        2: [outputs[int(third[1])]],
    }
    assert got[0] == want[0] and got[1] == want[1] and got[2] == [want[2][1]]
    assert int(third[0]) not in outputs  # an aborted sample has no event
    engine.release([*first, *second, *third])
    assert engine.live == 0 and not engine.busy
    if kind == "native":
        assert engine.sched.alloc.free_blocks == engine.cache.num_blocks  # all back
    engine.step()  # nothing to run: released ids become reusable (no step holds them)
    reused = engine.add(prompts[3], keys[6:8], limits, FREE)
    assert set(reused.tolist()) <= {*first.tolist(), *second.tolist(), *third.tolist()}
    engine.abort(reused)
    engine.release(reused)


def picked(logits: torch.Tensor, tokens) -> torch.Tensor:
    """The log-probs ``logits`` (a row per position) give ``tokens``, one per row."""
    log_probs = torch.log_softmax(logits.float(), -1)
    return log_probs.gather(-1, torch.as_tensor(tokens, dtype=torch.long)[:, None]).squeeze(-1)


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_weights_change_between_steps_with_samples_in_flight(model_dir, kind):
    """Tokens before the update: the old policy's; after it: the new policy's on the
    KV cache the samples kept (the old policy's keys and values of everything before:
    what an old forward over the prefix then a new forward over the rest computes, and
    not what a new forward over the whole sequence does), each tagged with the version
    that drew it."""
    engine = make_engine(kind, model_dir)
    prompts, keys = prompts_and_keys(model_dir, count=1)
    greedy = SamplingParams(n=2, max_new_tokens=R, do_sample=False, ignore_eos=True)
    samples = engine.add(prompts[0], keys, np.full(2, R), greedy)
    for _ in range(4):
        engine.step()
    engine.drain()
    before = {int(s): len(engine.output(int(s)).tokens) for s in samples}
    assert all(0 < n < R for n in before.values())
    old = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    new = perturbed(AutoModelForCausalLM.from_pretrained(model_dir), seed=9)
    engine.update_weights(new.state_dict().items(), version=7)
    outputs = {}
    while engine.busy:
        for sample, _ in engine.step():
            outputs[sample] = engine.output(sample)
    for s in samples.tolist():
        out, cut = outputs[s], before[s]
        assert out.versions[:cut].tolist() == [0] * cut
        assert out.versions[cut:].tolist() == [7] * (R - cut)
        tokens = prompts[0].tolist() + out.tokens.tolist()
        cached = len(prompts[0]) + cut - 1  # the last drawn token is fed after the update
        with torch.no_grad():
            past = old(input_ids=torch.tensor([tokens[:cached]]), use_cache=True)
            kept = new(
                input_ids=torch.tensor([tokens[cached:-1]]), past_key_values=past.past_key_values
            )
            whole = new(input_ids=torch.tensor([tokens[:-1]])).logits[0, cached:]
        assert kept.logits[0].argmax(-1).tolist() == out.tokens[cut:].tolist()
        assert whole.argmax(-1).tolist() != out.tokens[cut:].tolist()  # the cache was kept
        # each token's log-prob is the policy's that drew it (the behaviour policy of a
        # decoupled objective): the old one's before the update, the new one's after
        start, drawn = len(prompts[0]) - 1, torch.as_tensor(out.log_probs[:R]).float()
        want = torch.cat(
            [
                picked(past.logits[0, start:], out.tokens[:cut]),
                picked(kept.logits[0], out.tokens[cut:]),
            ]
        )
        torch.testing.assert_close(drawn, want, atol=1e-4, rtol=0)
        with torch.no_grad():
            renewed = new(input_ids=torch.tensor([tokens[:-1]])).logits[0, start : start + cut]
        assert not torch.allclose(drawn[:cut], picked(renewed, out.tokens[:cut]), atol=1e-3)
    engine.release(samples)


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_parked_turns_resume_on_their_cache_and_engines_agree(model_dir, kind):
    engine = make_engine(kind, model_dir)
    prompts, keys = prompts_and_keys(model_dir)
    sampling = SamplingParams(n=2, max_new_tokens=40, seed=3, stop_token_ids=range(3, 320, 7))
    limits = np.full(len(keys), 40)
    out = run_batch(engine, prompts, sampling, keys, limits, InstantTurns(40))
    native = make_engine("native", model_dir)
    ref = run_batch(native, prompts, sampling, keys, limits, InstantTurns(40))
    assert torch.equal(out.tokens, ref.tokens) and torch.equal(out.lengths, ref.lengths)
    appended = (out.tokens == 5) & (out.log_probs == 0)  # observations [5, 6, 7]
    assert appended.any()


def test_jobs_of_several_threads_share_one_loop(model_dir):
    """Calls from threads at once: one pumps, every job gets exactly its own tokens."""
    engine = make_engine("native", model_dir)
    loop = TurnLoop(engine)
    prompts, keys = prompts_and_keys(model_dir)
    want = [alone(engine, p, keys[2 * i : 2 * i + 2]) for i, p in enumerate(prompts)]
    # the first job is the longest: the others finish before it (out of order)
    limits = [[R, R], [4, 4], [6, 6], [3, 3]]
    want = [[t[: lim[k]] for k, t in enumerate(w)] for w, lim in zip(want, limits, strict=True)]
    jobs = [Job([p], keys[2 * i : 2 * i + 2], limits[i], FREE) for i, p in enumerate(prompts)]
    errors: list[BaseException] = []

    def call(job: Job) -> None:
        try:
            loop.run(job)
        except BaseException as err:  # noqa: BLE001 - the test asserts there is none
            errors.append(err)

    threads = [threading.Thread(target=call, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads), errors
    for job, expected in zip(jobs, want, strict=True):
        out = responses_of(job.outputs)
        assert [out.tokens[i, : out.lengths[i]].tolist() for i in range(2)] == expected
    assert engine.live == 0


def test_turn_events_reach_the_caller_of_the_request_api(model_dir):
    engine = make_engine("native", model_dir)
    prompts, keys = prompts_and_keys(model_dir, count=1)
    stop = SamplingParams(n=2, max_new_tokens=R, seed=1, stop_token_ids=range(3, 320, 3))
    samples = engine.add(prompts[0], keys, np.full(2, R), stop, park=True)
    seen = []
    while not seen:
        seen = [e for e in engine.step() if e[1] == TURN]
    sample = seen[0][0]
    assert engine.parked >= 1
    at = len(engine.output(sample).tokens)
    engine.resume(sample, np.array([5, 6]))
    engine.abort(samples)
    engine.release(samples)
    assert at < R and engine.live == 0


def service_call(service, model_dir, policy, step=0):
    from rayrl.batch import Batch

    tok = AutoTokenizer.from_pretrained(model_dir)
    enc = tok(["1 + 2 =", "hello there"], return_tensors="pt", padding=True, padding_side="left")
    prompts = Batch.from_dict({**enc, "uid": ["a", "b"]}, meta={"step": step})
    return service.generate(prompts, FREE, policy)


def test_the_service_holds_new_calls_for_a_staged_version_and_aborts_stale_ones(model_dir):
    engine = make_engine("native", model_dir)
    service = RolloutService(engine)
    new = perturbed(AutoModelForCausalLM.from_pretrained(model_dir), seed=9)
    first = service_call(service, model_dir, CallPolicy(max_lag=1))
    assert first.versions.unique().tolist() == [0]
    service.offer(1, list(new.state_dict().items()))
    held = service_call(service, model_dir, CallPolicy(max_lag=1))  # starts on version 1
    assert held.first_version == 1 and held.versions.unique().tolist() == [1]
    real = engine.step
    calls = {"n": 0}

    def step():  # version 3 arrives after the call's first step
        calls["n"] += 1
        if calls["n"] == 1:
            service.offer(3, list(new.state_dict().items()))
        return real()

    engine.step = step
    with pytest.raises(Aborted):
        service_call(service, model_dir, CallPolicy(max_lag=1))
    assert service.version == 3 and engine.live == 0


def test_the_engine_sleeps_after_a_generation_that_left_a_late_step_launched(model_dir):
    """With overlapped decoding a stop is found a step late: the generation ends with
    that step launched (its tokens to be dropped). Sleep commits it and frees the
    cache; only samples still live keep it from sleeping."""
    engine = make_engine("native", model_dir)
    prompts, keys = prompts_and_keys(model_dir)
    stops = SamplingParams(n=2, max_new_tokens=R, seed=1, stop_token_ids=range(3, 320, 5))
    late = 0
    for _ in range(3):
        run_batch(engine, prompts, stops, keys, np.full(len(keys), R))
        late += engine.stepper.pending is not None
        engine.sleep()
        assert engine.is_asleep and not engine.busy
        engine.wake()
    assert late  # the case this test is about happened
    live = engine.add(prompts[0], keys[:2], np.full(2, R), stops)
    with pytest.raises(RuntimeError, match="in flight"):
        engine.sleep()
    engine.abort(live)
    engine.release(live)
