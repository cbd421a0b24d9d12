"""Multi-turn GRPO through the product path, with real Ray, real tools and real kills:

- `rayrl train` on a tiny model taught to call the calculator (tests/agent_cases.py):
  the steps report verl's multi-turn and tool metrics, `rollout/token_mismatch` 0, and
  the loss mask covers none of the tool tokens the rollout appended;
- a multi-turn run whose worker is SIGKILLed while its episodes' tools run (the chaos
  monkey's `tools` point; each turn of a random model runs a 0.4 s tool,
  bench/_agent_env.py) ends bitwise like the clean run: weights, metrics, ledger.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent_cases import MAX_TOOL_RESPONSE_TOKENS, SCRIPTS, train_agent_model
from conftest import start_local_ray
from rayrl.cli.main import main
from rayrl.config import load_config
from rayrl.data import write_parquet
from rayrl.envs import load_object
from rayrl.models import build_tiny_model
from rayrl.testing.chaos import ChaosMonkey, compare_runs, final_weights
from rayrl.trainer.ppo import PPOTrainer
from rayrl.trainer.run import Run

pytestmark = pytest.mark.slow
BENCH = Path(__file__).resolve().parents[1] / "bench"
MT = "actor_rollout_ref.rollout.multi_turn"
ANSWERS = {"add": "5", "mul": "20", "both": "4", "chat": "0"}
SMALL = [
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "trainer.device=cpu",
    "trainer.n_gpus_per_node=1",
    "trainer.total_training_steps=1",
    "trainer.val_before_train=false",
    "trainer.resume_mode=disable",
    "trainer.logger=[jsonl]",
    "resources.dashboard=false",
]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_multi_turn_grpo_through_rayrl_train(tmp_path):
    model = train_agent_model(tmp_path / "model", names=tuple(ANSWERS))
    rows = [
        {
            "data_source": "arithmetic",
            "prompt": [{"role": "user", "content": SCRIPTS[name].prompt}],
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"index": i},
            "agent_name": "tool_agent",
        }
        for i, (name, answer) in enumerate(ANSWERS.items())
    ]
    data = write_parquet(rows, tmp_path / "train.parquet")
    address = start_local_ray().get_runtime_context().gcs_address
    out = tmp_path / "run"
    code = main(
        [
            "train",
            "-c",
            "grpo",
            *SMALL,
            f"actor_rollout_ref.model.path={model}",
            f"data.train_files={data}",
            "data.train_batch_size=4",
            "data.max_prompt_length=64",
            "data.max_response_length=256",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            f"{MT}.enable=true",
            f"{MT}.tools=[calculator]",
            f"{MT}.max_parallel_calls=4",
            f"{MT}.max_tool_response_length={MAX_TOOL_RESPONSE_TOKENS}",
            "trainer.export_hf=false",
            f"trainer.output_dir={out}",
            f"resources.address={address}",
        ]
    )
    assert code == 0
    steps = _rows(out)
    assert [r["step"] for r in steps] == [1]
    for metrics in steps:
        assert metrics["tool/calculator/calls"] >= 3  # add, mul, both's two: every sample
        assert metrics["tool/calculator/errors"] == 0 and metrics["tool/calculator/timeouts"] == 0
        assert metrics["multi_turn/num_turns/max"] >= 4 and metrics["multi_turn/num_turns/min"] >= 2
        assert metrics["rollout/token_mismatch"] == 0
        assert metrics["multi_turn/tool_tokens"] > 0  # tool responses appended ...
        assert metrics["multi_turn/loss_on_tool_tokens"] == 0  # ... and never trained on
        assert metrics["timing_s/tools"] > 0 and metrics["critic/score/mean"] > 0


def test_a_worker_killed_while_tools_run_ends_bitwise_like_the_clean_run(tmp_path):
    start_local_ray()
    model = str(build_tiny_model(tmp_path / "model", layers=2, hidden=64, seed=0))
    load_object(f"{BENCH}/_agent_env.py:end_turns_often")(model, 1 / 6)
    agent = [
        f"actor_rollout_ref.model.path={model}",
        "data.train_batch_size=2",
        "data.max_response_length=24",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        f"{MT}.enable=true",
        f"actor_rollout_ref.rollout.agent.default_agent_loop={BENCH}/_agent_env.py"
        ":LatencyEnvironment",
        f"{MT}.environment_config.latency_s=0.4",
        f"{MT}.environment_config.calls=2",
    ]

    def run(out: Path, kill: bool) -> dict:
        cfg = load_config("grpo", [*SMALL, *agent, f"trainer.output_dir={out}"])
        training, monkey = Run(PPOTrainer(cfg, print_fn=lambda _: None)), None
        try:
            training.setup()
            if kill:
                monkey = ChaosMonkey(training, seed=0, stages=["tools"], kills=1, steps=[0])
                monkey.start()
            history = training.fit()
        finally:
            if monkey is not None:
                monkey.stop()
            training.shutdown()
        return {
            "history": history,
            "ledger": training.replay.ledger,
            "weights": final_weights(out),
            "kills": monkey.done if monkey else [],
            "recoveries": training.replay.recoveries,
        }

    clean = run(tmp_path / "clean", kill=False)
    killed = run(tmp_path / "killed", kill=True)
    assert [(k.step, k.stage) for k in killed["kills"]] == [(0, "tools")]
    assert killed["recoveries"], "the kill was not recovered from"
    assert all(m["multi_turn/num_turns/max"] >= 3 for m in clean["history"])  # tools ran
    verdict = compare_runs(clean, killed)
    assert verdict["weights_identical"] and verdict["ledger_identical"], verdict
    assert verdict["metrics_identical"], verdict["metrics_differ"]
