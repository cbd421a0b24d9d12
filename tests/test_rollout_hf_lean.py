"""The HF engine's lean decode loop against ``generate()``: token for token the same on
greedy, seeded and filtered sampling, stop tokens, EOS and stop strings; models it cannot
run keep ``generate()``."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rayrl.models.tiny import build_tiny_model
from rayrl.rollout import HFRolloutEngine, SamplingParams
from rayrl.rollout.hf.decode import can_lean_decode, decode_threads
from test_rollout_hf import TINY, forced_token, make_prompts

R = 8
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """A lean engine and a ``generate()`` engine sharing one model (dynamic cache)."""
    path = build_tiny_model(tmp_path_factory.mktemp("lean") / "tiny", **TINY)
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    lean = HFRolloutEngine(model=model, tokenizer=tok, cache="dynamic")
    plain = HFRolloutEngine(model=model, tokenizer=tok, cache="dynamic", decode="generate")
    assert lean.lean and not plain.lean
    return lean, plain


def assert_same(a, b):
    for key in ("responses", "response_mask", "rollout_log_probs", "input_ids", "position_ids"):
        assert torch.equal(a[key], b[key]), key
    assert list(a["finish_reason"]) == list(b["finish_reason"])


def counting_generate(model):
    """Count ``model.generate`` calls (the lean loop must make none)."""
    calls = []
    real = model.generate

    def generate(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    model.generate = generate
    return calls, lambda: delattr(model, "generate")


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=R, do_sample=False),
        SamplingParams(n=3, max_new_tokens=R, seed=7, temperature=1.0),
        SamplingParams(n=2, max_new_tokens=R, seed=3, temperature=0.7, top_p=0.9, top_k=20),
        SamplingParams(n=2, max_new_tokens=R, seed=9, ignore_eos=True),
    ],
    ids=["greedy", "seeded", "filtered", "ignore_eos"],
)
def test_lean_loop_equals_generate(engines, params):
    lean, plain = engines
    prompts = make_prompts(lean.tokenizer, step=4)
    calls, restore = counting_generate(lean.model)
    try:
        fast = lean.generate(prompts, params)
    finally:
        restore()
    assert calls == []  # the lean loop ran, not generate()
    assert_same(fast, plain.generate(prompts, params))


def test_lean_loop_stops_like_generate(engines):
    lean, plain = engines
    prompts = make_prompts(lean.tokenizer)
    stop = 42
    params = SamplingParams(n=2, max_new_tokens=R, stop_token_ids=(stop,), seed=1)
    outs = []
    for engine in (lean, plain):  # half the rows stop at token 3, the rest run on
        with forced_token(engine.model, stop, at_call=3, rows=slice(0, None, 2)):
            outs.append(engine.generate(prompts, params))
    assert_same(*outs)
    assert list(outs[0]["finish_reason"][::2]) == ["stop"] * 4
    eos = lean.eos_ids[0]
    outs = []
    for engine in (lean, plain):  # every row ends at once: one step only
        with forced_token(engine.model, eos, at_call=1):
            outs.append(engine.generate(prompts, SamplingParams(max_new_tokens=R, seed=2)))
    assert_same(*outs)
    assert outs[0]["response_mask"].sum().item() == 4


def test_lean_loop_stop_strings_like_generate(engines):
    lean, plain = engines
    (word_id,) = lean.tokenizer.encode("answer")
    prompts = make_prompts(lean.tokenizer)
    params = SamplingParams(n=2, max_new_tokens=R, stop=("answer",), seed=4)
    outs = []
    for engine in (lean, plain):
        with forced_token(engine.model, word_id, at_call=3, rows=slice(0, 4)):
            outs.append(engine.generate(prompts, params))
    assert_same(*outs)
    assert list(outs[0]["finish_reason"][:4]) == ["stop"] * 4


def test_models_the_lean_loop_cannot_run_keep_generate(engines):
    lean, _ = engines
    model = lean.model

    class OwnInputs(type(model)):
        def prepare_inputs_for_generation(self, *args, **kwargs):
            return super().prepare_inputs_for_generation(*args, **kwargs)

    other = OwnInputs(model.config)
    other.load_state_dict(model.state_dict())
    assert can_lean_decode(model) and not can_lean_decode(other)
    assert not can_lean_decode(torch.nn.Linear(2, 2))
    engine = HFRolloutEngine(model=other, tokenizer=lean.tokenizer, cache="dynamic")
    assert not engine.lean
    calls, restore = counting_generate(other)
    params = SamplingParams(n=2, max_new_tokens=R, seed=5)
    prompts = make_prompts(lean.tokenizer)
    try:
        out = engine.generate(prompts, params)
    finally:
        restore()
    assert calls == [1]
    assert_same(out, lean.generate(prompts, params))
    with pytest.raises(ValueError, match="decode="):
        HFRolloutEngine(model=model, decode="fast")


def test_a_small_model_decodes_on_one_thread(engines):
    lean, plain = engines
    seen = []
    hook = lean.model.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        params = SamplingParams(n=2, max_new_tokens=R, seed=6)
        prompts = make_prompts(lean.tokenizer)
        for engine in (lean, plain):
            engine.generate(prompts, params)
            assert torch.get_num_threads() == 2  # restored
        assert set(seen) == {1}
        big = torch.nn.Linear(1000, 1000)  # 1M parameters: as many threads as given
        with decode_threads(big, torch.device("cpu")):
            assert torch.get_num_threads() == 2
    finally:
        hook.remove()
        torch.set_num_threads(threads)
