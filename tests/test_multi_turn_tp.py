"""Multi-turn episodes on a tensor-parallel rollout replica, through the actor group on Ray.

Two actor ranks (gloo) form one native rollout replica of
`tensor_model_parallel_size=2`; a tiny model taught to call tools (tests/agent_cases.py)
runs greedy episodes with the calculator and a counter (each episode's calls answer 1,
2, 3; every call writes its process id to a log). The replica's output must be the
unsplit engine's: the same tokens, masks, log-probs, tool outputs and trajectories; and
the tools must have run once per call, all in one worker process (TP rank 0), the other
rank applying the broadcast answers. Then rank 1 is replaced: the survivor cuts the
replica's groups anew from the re-formed process group, the new rank builds its engines
beside it reading no weights, and after the step snapshot's restore the replica runs
the same episodes again (the same tokens; their log-probs to rounding, since which
samples decode together depends on when the tools answer).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from agent_cases import MAX_TOOL_RESPONSE_TOKENS, make_prompts, train_agent_model
from rayrl.controller import GroupSnapshot
from rayrl.rollout import NativeRolloutEngine
from rayrl.rollout.agent.rollout import MultiTurnRollout
from rayrl.trainer.roles import set_data_layouts
from rayrl.workers import ActorRolloutRefWorker
from rayrl.workers.actor import sampling_params
from rayrl.workers.agent import configured_tools, episode_settings
from workers_cases import close, config, generate, group_on

pytestmark = pytest.mark.slow
TESTS = Path(__file__).resolve().parent
MT = "actor_rollout_ref.rollout.multi_turn"
NAMES = ["add", "loop", "count"]


@pytest.fixture(scope="module")
def agent_dir(tmp_path_factory):
    return str(train_agent_model(tmp_path_factory.mktemp("agent") / "model", names=tuple(NAMES)))


def _config(log: Path, *overrides: str):
    cfg = config(
        "data.max_prompt_length=64",
        "data.max_response_length=200",
        "actor_rollout_ref.rollout.name=native",
        "actor_rollout_ref.rollout.temperature=0",  # greedy
        f"{MT}.enable=true",
        f"{MT}.max_parallel_calls=4",
        f"{MT}.max_tool_response_length={MAX_TOOL_RESPONSE_TOKENS}",
        "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
        *overrides,
    )
    counter = {"class_name": f"{TESTS / 'agent_cases.py'}:Counter", "config": {"log": str(log)}}
    cfg.actor_rollout_ref.rollout.multi_turn.tools = ["calculator", counter]
    return cfg


def _one_rank(cfg, agent_dir: str, prompts):
    """The same episodes on one unsplit native engine, in this process."""
    tokenizer = AutoTokenizer.from_pretrained(agent_dir)
    engine = NativeRolloutEngine(model_path=agent_dir, tokenizer=tokenizer, device="cpu")
    episodes = MultiTurnRollout(
        engine, configured_tools(cfg), tokenizer=tokenizer, **episode_settings(cfg)
    )
    return episodes.generate(prompts, sampling_params(cfg, "train"))


def test_tp2_episodes_match_one_rank_and_tools_run_once(ray_local, agent_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(agent_dir)
    prompts = make_prompts(tok, NAMES)
    tp_log, ref_log = tmp_path / "tp2.log", tmp_path / "tp1.log"
    cfg = _config(
        tp_log,
        "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    )
    group, pool, kv = group_on(ActorRolloutRefWorker, 2, "actor")
    try:
        group.init(timeout_s=300, backend="gloo", config=cfg, model_path=agent_dir)
        set_data_layouts(group, [group])  # both ranks: the replica's prompts (as the trainer)
        snap = GroupSnapshot.take(group)
        out = generate(group, prompts)
        pids = {info["pid"] for info in group.device_info()}
        callers = tp_log.read_text().split()
        done = group.replace(1)
        # the survivor keeps its weights; the new rank reads its reference's shard alone
        assert done.bytes_read[0] == 0 < done.bytes_read[1] and done.ranks_reloading == 1
        snap.restore(group)
        again = generate(group, prompts)
    finally:
        close(group, pool, kv)
    ref = _one_rank(_config(ref_log), agent_dir, prompts)

    assert len(out) == len(NAMES) * 2  # one replica's output (n=2), not one per rank
    for key in ("responses", "response_mask"):  # the rebuilt replica: the same episodes
        assert torch.equal(again[key], out[key]), key
    # and their log-probs to rounding: when tools answer decides which samples decode
    # together, and on an AVX-512 CPU a matmul of 1 or 2 rows rounds differently from the
    # same rows in a larger batch (by up to 1e-5 here; bitwise on the AMD machine before)
    torch.testing.assert_close(
        again["rollout_log_probs"], out["rollout_log_probs"], atol=1e-5, rtol=0
    )
    for key in ("responses", "response_mask", "attention_mask"):
        assert torch.equal(out[key], ref[key]), key
    torch.testing.assert_close(
        out["rollout_log_probs"], ref["rollout_log_probs"], atol=1e-4, rtol=0
    )
    for key in ("trajectory", "num_turns", "finish_reason", "multi_turn_events"):
        assert list(out[key]) == list(ref[key]), key
    tool_said = [[m["content"] for m in t if m["role"] == "tool"] for t in out["trajectory"]]
    assert tool_said[::2] == [["5"], ["2", "4", "8"], ["1", "2", "3"]]
    assert out["trajectory"][4][-1]["content"] == "Counted to 3."
    # Each counter call ran once, in one actor process (TP rank 0); the other rank
    # decoded on the answers it was sent.
    assert len(callers) == len(ref_log.read_text().split()) == 6  # 2 samples x 3 calls
    assert len(set(callers)) == 1 and int(callers[0]) in pids and int(callers[0]) != os.getpid()
