"""Multi-turn rollout on both engines with a tiny model taught to call tools
(tests/agent_cases.py): token-exact episodes (the trained sequence is what was sampled
plus what was appended, the mask 0 on every appended token, log-probs those of a plain
forward pass over it), the same trajectories from both engines, replay in another
batch and process, tools that hang, raise or return garbage, turn and length limits,
a slow tool that does not stall the native engine, KV pressure, and environments that
fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agent_cases import (
    HANG_TIMEOUT_S,
    MAX_TOOL_RESPONSE_TOKENS,
    SCRIPTS,
    Handshake,
    make_prompts,
    make_tools,
    train_agent_model,
)
from rayrl.config.multi_turn import MultiTurnConfig
from rayrl.registry import UnknownNameError
from rayrl.rollout import HFRolloutEngine, NativeRolloutEngine, SamplingParams
from rayrl.rollout.agent.rollout import MultiTurnRollout, multi_turn_metrics
from rayrl.trainer.tool_budget import ToolBudget

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ALL = ["add", "mul", "both", "bad", "unknown", "hang", "boom", "junk", "loop", "long", "chat"]
GREEDY = SamplingParams(do_sample=False, max_new_tokens=200)
CONFIG = MultiTurnConfig(max_parallel_calls=4, max_tool_response_length=MAX_TOOL_RESPONSE_TOKENS)


@pytest.fixture(scope="module")
def agent_dir(tmp_path_factory):
    return str(train_agent_model(tmp_path_factory.mktemp("agent") / "model"))


@pytest.fixture(scope="module")
def tokenizer(agent_dir):
    return AutoTokenizer.from_pretrained(agent_dir)


@pytest.fixture(scope="module")
def engines(agent_dir):
    return {
        "hf": HFRolloutEngine(model_path=agent_dir, device="cpu"),
        "native": NativeRolloutEngine(model_path=agent_dir, device="cpu", block_size=8),
    }


def rollout(engine, names, sampling=GREEDY, config=CONFIG, tools=None, step=0, **columns):
    runner = MultiTurnRollout(engine, tools if tools is not None else make_tools(), config)
    prompts = make_prompts(engine.tokenizer, names, step=step)
    for key, values in columns.items():
        prompts.non_tensors[key] = np.array(values, dtype=object)
    return runner.generate(prompts, sampling), runner


def response_of(out, i) -> tuple[list[int], list[int]]:
    """(tokens, mask) of row i's response, up to its length."""
    width = out["prompts"].shape[1]
    length = int(out["attention_mask"][i, width:].sum())
    return out["responses"][i, :length].tolist(), out["response_mask"][i, :length].tolist()


def spans(mask: list[int], value: int) -> list[tuple[int, int]]:
    """(start, end) of the runs of ``value`` in ``mask``."""
    runs, start = [], None
    for i, m in enumerate([*mask, 1 - value]):
        if m == value and start is None:
            start = i
        elif m != value and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_episodes_are_token_exact_and_both_engines_agree(engines, tokenizer, agent_dir):
    outs = {kind: rollout(engine, ALL)[0] for kind, engine in engines.items()}
    hf, native = outs["hf"], outs["native"]
    for key in ("responses", "response_mask", "attention_mask"):
        assert torch.equal(hf[key], native[key]), key
    torch.testing.assert_close(
        hf["rollout_log_probs"], native["rollout_log_probs"], atol=1e-4, rtol=0
    )
    for key in ("finish_reason", "num_turns", "trajectory", "multi_turn_events"):
        assert list(hf[key]) == list(native[key]), key

    model = AutoModelForCausalLM.from_pretrained(agent_dir).eval()
    with torch.no_grad():
        logits = model(
            input_ids=native["input_ids"],
            attention_mask=native["attention_mask"],
            position_ids=native["position_ids"],
        ).logits.float()
    width = native["prompts"].shape[1]
    log_probs = torch.log_softmax(logits[:, width - 1 : -1], -1)
    for i, name in enumerate(ALL):
        tokens, mask = response_of(native, i)
        sampled = torch.tensor(mask, dtype=torch.bool)
        # Sampled tokens: greedy under a plain forward pass over the very sequence that is
        # trained on, with the rollout's log-probs. Appended tokens: mask 0, log-prob 0.
        picked = log_probs[i, : len(tokens)].gather(-1, torch.tensor(tokens)[:, None])[:, 0]
        torch.testing.assert_close(
            native["rollout_log_probs"][i, : len(tokens)][sampled],
            picked[sampled],
            atol=1e-4,
            rtol=0,
        )
        assert torch.equal(
            log_probs[i, : len(tokens)].argmax(-1)[sampled], torch.tensor(tokens)[sampled]
        )
        assert not native["rollout_log_probs"][i, : len(tokens)][~sampled].any()
        # Each appended run is exactly the chat format around the tool messages shown.
        tool_messages = [m for m in native["trajectory"][i] if m["role"] == "tool"]
        appended = [tokenizer.decode(tokens[a:b]) for a, b in spans(mask, 0)]
        turns = _observations(native["trajectory"][i])
        expected = [
            "\n"
            + "".join(f"<|im_start|>tool\n{m['content']}<|im_end|>\n" for m in group)
            + "<|im_start|>assistant\n"
            for group in turns
        ]
        assert appended == expected, name
        assert all(
            tokenizer.decode(tokens[a:b]).count("<|im_end|>") == 1 for a, b in spans(mask, 1)
        )
        assert len(tool_messages) == sum(map(len, turns))

    by_name = dict(zip(ALL, range(len(ALL)), strict=True))

    def final(name):
        return native["trajectory"][by_name[name]][-1]["content"]

    def observations(name):
        return [m["content"] for m in native["trajectory"][by_name[name]] if m["role"] == "tool"]

    assert final("add") == "The answer is 5." and observations("add") == ["5"]
    assert observations("both") == ["2", "4"] and final("both") == "Got 2 and 4."
    assert observations("loop") == ["2", "4", "8"] and native["num_turns"][by_name["loop"]] == 8
    assert "not valid JSON" in observations("bad")[0]
    assert "unknown tool 'weather'" in observations("unknown")[0]
    assert f"did not finish within {HANG_TIMEOUT_S:g} s" in observations("hang")[0]
    assert "RuntimeError: exploded" in observations("boom")[0]
    assert json.loads(observations("junk")[0])["n"] == [1, None, 2.5]
    assert "(truncated)" in observations("long")[0]
    assert (
        native["num_turns"][by_name["chat"]] == 2
        and final("chat") == "Hello there, no tools needed."
    )
    assert set(native["finish_reason"]) == {"stop"}
    stats = native["tool_stats"]
    assert stats[by_name["hang"]]["sleepy"] == {
        "calls": 1,
        "errors": 0,
        "timeouts": 1,
        "latency_s": pytest.approx(HANG_TIMEOUT_S, abs=0.5),
    }
    assert stats[by_name["boom"]]["boom"]["errors"] == 1
    events = native["multi_turn_events"]
    assert (
        events[by_name["bad"]]["malformed"] == 1 and events[by_name["unknown"]]["unknown_tool"] == 1
    )
    assert events[by_name["long"]]["truncated_observations"] == 1
    metrics = multi_turn_metrics(native)
    assert metrics["multi_turn/num_turns/max"] == 8 and metrics["multi_turn/num_turns/min"] == 2
    assert (
        metrics["tool/calculator/calls"] == 1 + 1 + 2 + 3 and metrics["tool/sleepy/timeouts"] == 1
    )


def _observations(trajectory) -> list[list[dict]]:
    """The tool messages of a trajectory, grouped by the assistant turn they answer."""
    groups, current = [], None
    for message in trajectory:
        if message["role"] == "tool":
            current = current if current is not None else []
            current.append(message)
        elif current is not None:
            groups.append(current)
            current = None
    if current is not None:
        groups.append(current)
    return groups


@pytest.mark.parametrize("kind", ["hf", "native"])
def test_turn_limits_truncation_and_the_context_limit(engines, tokenizer, kind):
    engine = engines[kind]
    limited = MultiTurnConfig(
        max_assistant_turns=2, max_tool_response_length=MAX_TOOL_RESPONSE_TOKENS
    )
    out, _ = rollout(engine, ["loop"], config=limited)
    assert out["num_turns"][0] == 4 and out["finish_reason"][0] == "stop"
    roles = [m["role"] for m in out["trajectory"][0]]
    assert roles == ["user", "assistant", "tool", "assistant"]
    tokens, mask = response_of(out, 0)
    assert tokenizer.decode(tokens).endswith("</tool_call><|im_end|>")  # the 2nd call, not run
    observed = MultiTurnConfig(max_user_turns=1, max_tool_response_length=MAX_TOOL_RESPONSE_TOKENS)
    again, _ = rollout(engine, ["loop"], config=observed)
    assert torch.equal(again["responses"], out["responses"])

    # The per-message limit is exact in tokens; the cut is marked.
    short = MultiTurnConfig(max_tool_response_length=40, tool_response_truncate_side="right")
    cut, _ = rollout(engine, ["long"], config=short)
    tokens, mask = response_of(cut, 0)
    first = spans(mask, 0)[0]
    content = cut["trajectory"][0][2]["content"]
    assert content.startswith("word0 word1") and content.endswith("...(truncated)")
    opening = tokenizer.encode("\n<|im_start|>tool\n")
    closing = tokenizer.encode("<|im_end|>\n<|im_start|>assistant\n")
    assert first[1] - first[0] == len(opening) + 40 + len(closing)
    assert cut["multi_turn_events"][0]["truncated_observations"] == 1

    # The context limit: an observation that leaves no room ends the episode with "length".
    first_turn = len(tokenizer.encode(SCRIPTS["add"].turns[0])) + 1
    tight = SamplingParams(do_sample=False, max_new_tokens=first_turn + 3)
    ended, _ = rollout(engine, ["add"], sampling=tight)
    tokens, mask = response_of(ended, 0)
    assert ended["finish_reason"][0] == "length" and len(tokens) == first_turn and all(mask)
    assert ended["num_turns"][0] == 2 and ended["trajectory"][0][-1]["role"] == "assistant"
    # what the trainer reads of it to say that the budget cuts tool turns short
    said = ToolBudget(first_turn + 3).check(ended)
    assert f"took {first_turn} tokens and the tool's answer did not fit in the 3 left" in said
    # The response limit cutting a turn short is "length" too.
    five = SamplingParams(do_sample=False, max_new_tokens=5)
    cut_short, _ = rollout(engine, ["add"], sampling=five)
    assert cut_short["finish_reason"][0] == "length" and response_of(cut_short, 0)[1] == [1] * 5


@pytest.mark.parametrize("kind", ["hf", "native"])
def test_turns_can_end_at_the_tool_call(engines, tokenizer, kind):
    """Stopping at </tool_call> (a stop string): the turn separator the model would have
    sampled (<|im_end|>) is appended instead; the tokens are the same, the mask differs.
    (One call per turn: this tokenizer merges the '><' between two calls into one token,
    so a stop string would end a two-call turn inside that token.)"""
    at_eos, _ = rollout(engines[kind], ["add", "loop"])
    config = MultiTurnConfig(
        max_parallel_calls=4,
        max_tool_response_length=MAX_TOOL_RESPONSE_TOKENS,
        stop_at_tool_call_end=True,
    )
    at_call, _ = rollout(engines[kind], ["add", "loop"], config=config)
    assert torch.equal(at_eos["responses"], at_call["responses"])
    for i in range(2):
        tokens, mask = response_of(at_call, i)
        _, eos_mask = response_of(at_eos, i)
        moved = [j for j in range(len(mask)) if mask[j] != eos_mask[j]]
        assert [tokenizer.decode([tokens[j]]) for j in moved] == ["<|im_end|>"] * (1 + 2 * i)
    assert list(at_call["trajectory"]) == list(at_eos["trajectory"])


REPLAY_SAMPLING = SamplingParams(n=2, temperature=1.5, top_k=20, max_new_tokens=160, seed=7)


def test_replay_does_not_depend_on_the_batch(engines):
    names = ["add", "loop", "chat", "both", "long"]
    full, _ = rollout(engines["native"], names, sampling=REPLAY_SAMPLING, step=3)
    part, _ = rollout(engines["native"], ["both", "add"], sampling=REPLAY_SAMPLING, step=3)
    hf, _ = rollout(engines["hf"], ["both", "add"], sampling=REPLAY_SAMPLING, step=3)
    uids = list(full["sample_uid"])
    rows = [uids.index(u) for u in part["sample_uid"]]
    for other in (part, hf):
        assert list(other["sample_uid"]) == [uids[r] for r in rows]
        assert torch.equal(other["responses"], full["responses"][rows])
        assert torch.equal(other["response_mask"], full["response_mask"][rows])
        assert list(other["trajectory"]) == [full["trajectory"][r] for r in rows]
    other_step, _ = rollout(engines["native"], names, sampling=REPLAY_SAMPLING, step=4)
    assert not torch.equal(other_step["responses"], full["responses"])


REPLAY = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, sys.argv[3])
    from test_rollout_multi_turn import REPLAY_SAMPLING, rollout
    from rayrl.rollout import HFRolloutEngine
    torch.set_num_threads(1)
    engine = HFRolloutEngine(model_path=sys.argv[1], device="cpu")
    out, _ = rollout(engine, ["loop", "add"], sampling=REPLAY_SAMPLING, step=3)
    torch.save({"responses": out["responses"], "mask": out["response_mask"]}, sys.argv[2])
    """
)


@pytest.mark.slow  # a fresh interpreter imports torch and transformers
def test_replay_in_another_process(engines, agent_dir, tmp_path):
    local, _ = rollout(engines["native"], ["loop", "add"], sampling=REPLAY_SAMPLING, step=3)
    path = tmp_path / "remote.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", REPLAY, agent_dir, str(path), os.path.dirname(__file__)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    remote = torch.load(path)
    assert torch.equal(remote["responses"], local["responses"])
    assert torch.equal(remote["mask"], local["response_mask"])


@pytest.mark.parametrize("kind", ["hf", "native"])
def test_a_slow_tool_does_not_stall_the_engine(engines, kind):
    """``wait`` calls a tool that returns only once ``signal``'s sample has called its
    own tool, in its second turn: both engines must decode ``signal`` while ``wait``
    waits (a parked sample holds no one up: the turn loop runs the others)."""
    handshake = Handshake(timeout_s=30.0)
    out, _ = rollout(engines[kind], ["wait", "signal"], tools=make_tools(handshake))
    assert [m["content"] for m in out["trajectory"][0] if m["role"] == "tool"] == ["peer arrived"]
    times = handshake.times
    assert times["wait_start"] < times["signal"] <= times["wait_end"]
    assert out["trajectory"][1][-1]["content"] == "Signalled."
    assert out["tool_stats"][0]["wait_for_peer"]["timeouts"] == 0


def test_native_engine_under_kv_pressure(engines, agent_dir):
    names = ["add", "loop", "both", "long", "mul", "signal"]
    roomy, _ = rollout(engines["native"], names)
    sizes = dict(block_size=4, max_num_seqs=6, max_num_batched_tokens=16)
    sizes["cpu_cache_tokens"] = 212  # one episode of 200 tokens fits, six do not
    small = NativeRolloutEngine(
        model_path=agent_dir, device="cpu", enable_prefix_caching=False, **sizes
    )
    tight, _ = rollout(small, names)
    # Parked samples gave their KV blocks up (then were recomputed), and a running
    # one was preempted, with tool responses in its response.
    assert small.last_stats["reclaimed_kv"] > 0 and small.last_stats["preemptions"] > 0
    cached = NativeRolloutEngine(model_path=agent_dir, device="cpu", **sizes)
    again, _ = rollout(cached, names)  # the recomputed turns find their blocks again
    assert cached.last_stats["reclaimed_kv"] > 0 and cached.last_stats["prefix_hit_tokens"] > 0
    for out in (tight, again):
        assert torch.equal(out["responses"], roomy["responses"])
        assert torch.equal(out["response_mask"], roomy["response_mask"])
        assert list(out["trajectory"]) == list(roomy["trajectory"])


ENVIRONMENTS = textwrap.dedent(
    '''
    import time
    from rayrl.envs import Environment, StepResult

    class Quiz(Environment):
        """Answers the first message with a user turn, then ends with a reward."""

        def step(self, conversation, message):
            if len(conversation) <= 2:
                return StepResult("Are you sure?", reward=0.5)
            return StepResult(done=True, reward=1.0)

    class Broken(Environment):
        def step(self, conversation, message):
            raise ValueError("environment bug")

    class Stuck(Environment):
        def step(self, conversation, message):
            time.sleep(30)

    class Wrong(Environment):
        def step(self, conversation, message):
            return "not a StepResult"

    class NoReset(Environment):
        def reset(self, episode):
            raise KeyError("missing column")
    '''
)


def test_environments_by_agent_name_and_their_failures(engines, tmp_path):
    path = tmp_path / "envs.py"
    path.write_text(ENVIRONMENTS)
    agents = ["tool_agent"] + [
        f"{path}:{c}" for c in ("Quiz", "Broken", "Stuck", "Wrong", "NoReset")
    ]
    config = MultiTurnConfig(env_timeout_s=1.0, max_tool_response_length=MAX_TOOL_RESPONSE_TOKENS)
    sampling = SamplingParams(do_sample=False, max_new_tokens=120)
    names = ["add"] * len(agents)
    for kind in ("native", "hf"):
        out, _ = rollout(engines[kind], names, sampling=sampling, config=config, agent_name=agents)
        events = out["multi_turn_events"]
        assert out["trajectory"][0][-1]["content"] == "The answer is 5."
        assert out["trajectory"][1][2] == {"role": "user", "content": "Are you sure?"}
        assert out["turn_scores"][1][0] == 0.5
        assert events[2]["env_errors"] == 1 and events[3]["env_timeouts"] == 1
        assert events[4]["env_errors"] == 1 and events[5]["env_errors"] == 1
        for i in (2, 3, 4, 5):  # ended after their first turn, the sample kept
            assert out["num_turns"][i] == 2 and out["finish_reason"][i] == "stop"
        assert len(out) == len(agents)
    with pytest.raises(UnknownNameError, match="Did you mean 'tools'"):
        MultiTurnRollout(engines["native"], [], MultiTurnConfig(), environment="tool")
    with pytest.raises(TypeError, match="hf or native engine"):
        MultiTurnRollout(object(), [])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_native_engine_on_cuda_matches_cpu(engines, agent_dir):
    """bf16 weights, Triton kernels, CUDA graphs and overlapped decode steps: the same
    episodes as on the CPU (the trained model's choices have wide margins), and the
    handshake that needs other samples to decode while one waits."""
    cpu, _ = rollout(engines["native"], ALL)
    gpu_engine = NativeRolloutEngine(model_path=agent_dir, device="cuda")
    gpu, _ = rollout(gpu_engine, ALL)
    assert list(gpu["trajectory"]) == list(cpu["trajectory"])
    assert torch.equal(gpu["responses"], cpu["responses"])
    assert torch.equal(gpu["response_mask"], cpu["response_mask"])
    handshake = Handshake(timeout_s=30.0)
    out, _ = rollout(gpu_engine, ["wait", "signal"], tools=make_tools(handshake))
    assert out["trajectory"][0][2]["content"] == "peer arrived"


NUDGE = textwrap.dedent(
    '''
    class Nudge:
        """verl's BaseInteraction protocol, async: one nudge, then the episode ends."""

        def __init__(self, config):
            self.config, self.seen = config, {}

        async def start_interaction(self, instance_id, **kwargs):
            self.seen[instance_id] = 0

        async def generate_response(self, instance_id, messages, **kwargs):
            self.seen[instance_id] += 1
            done = self.seen[instance_id] > 1
            return done, f"{self.config['name']}: say it again", 0.5, {}

        async def finalize_interaction(self, instance_id, **kwargs):
            del self.seen[instance_id]
    '''
)


def test_interactions_answer_messages_without_tool_calls(engines, tmp_path):
    """verl's interaction YAML: its GSM8K interaction (built in) ends a right answer's
    episode with a turn score of 1 and asks a wrong one to try again (score 0), as the
    user; an async interaction class of one's own runs too. Rows pick theirs by
    extra_info.interaction_kwargs.name; an unknown name ends that episode, counted."""
    from rayrl.config import load_config
    from rayrl.envs import load_interaction_config
    from rayrl.workers.agent import ToolConfigError, configured_interactions

    (tmp_path / "nudge.py").write_text(NUDGE)
    (tmp_path / "interactions.yaml").write_text(
        "interaction:\n"
        '  - name: "gsm8k"\n'
        '    class_name: "verl.interactions.gsm8k_interaction.Gsm8kInteraction"\n'
        "    config: {}\n"
        f'  - class_name: "{tmp_path / "nudge.py"}:Nudge"\n'
    )
    interactions = load_interaction_config(tmp_path / "interactions.yaml")
    assert sorted(interactions) == ["gsm8k", "nudge"]  # verl's default name: the class's
    mt = "actor_rollout_ref.rollout.multi_turn"
    cfg = load_config(
        "grpo",
        [f"{mt}.enable=true", f"{mt}.interaction_config_path={tmp_path / 'interactions.yaml'}"],
    )
    assert sorted(configured_interactions(cfg)) == ["gsm8k", "nudge"]  # what each worker loads
    cfg.actor_rollout_ref.rollout.multi_turn.interaction_config_path = str(tmp_path / "none.yaml")
    with pytest.raises(ToolConfigError, match="interaction_config_path=.*none.yaml.*no such file"):
        configured_interactions(cfg)
    kwargs = [
        {"name": "gsm8k", "ground_truth": "5"},
        {"name": "gsm8k", "ground_truth": "6"},
        {"name": "nudge"},
        {"name": "weather"},
    ]
    config = MultiTurnConfig(max_user_turns=2, max_tool_response_length=MAX_TOOL_RESPONSE_TOKENS)
    runner = MultiTurnRollout(engines["native"], make_tools(), config, interactions=interactions)
    prompts = make_prompts(engines["native"].tokenizer, ["add"] * 4)
    prompts.non_tensors["extra_info"] = np.array(
        [{"interaction_kwargs": k} for k in kwargs], dtype=object
    )
    out = runner.generate(prompts, GREEDY)
    said = [[(m["role"], m["content"]) for m in t[2:]] for t in out["trajectory"]]
    assert said[0] == [("tool", "5"), ("assistant", "The answer is 5.")]
    assert out["turn_scores"][0] == [1.0] and out["num_turns"][0] == 4
    wrong = "Your response is incorrect! You need to reflect on your answer and try again."
    assert said[1][:3] == [("tool", "5"), ("assistant", "The answer is 5."), ("user", wrong)]
    assert out["turn_scores"][1][0] == 0.0 and len(said[1]) == 4  # max_user_turns=2
    assert said[2][2] == ("user", "nudge: say it again") and out["turn_scores"][2][0] == 0.5
    assert out["multi_turn_events"][3]["env_errors"] == 1 and out["num_turns"][3] == 2
    tokens, mask = response_of(out, 1)
    appended = [engines["native"].tokenizer.decode(tokens[a:b]) for a, b in spans(mask, 0)]
    assert f"<|im_start|>user\n{wrong}<|im_end|>" in appended[1]  # the user's turn, not trained
    with pytest.raises(Exception, match="interaction"):
        bad = tmp_path / "bad.yaml"
        bad.write_text("interaction:\n  - config: {}\n")
        load_interaction_config(bad)
