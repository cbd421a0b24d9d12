"""The agent demo end to end on CPU: base validation, multi-turn SFT, multi-turn GRPO
(`rayrl demo --task tools`).

Runs `rayrl.cli.demo_cmd.run_pipeline` with the `tools` task (the built-in
`demo_tools` configs: the tiny model, the synthetic `multiply` task whose rows run the
tool agent with the `calculator` tool, SFT on conversations that use the tool right
30% of the time, GRPO rewarded for the exact product, greedy validation on held-out
questions) and prints one JSON object per line:

- `accuracy_base`, `accuracy_after_sft`, `accuracy_after_rl`: greedy validation
  accuracy (fraction of the held-out questions);
- `rl_gain`: accuracy_after_rl - accuracy_after_sft in points (target >= 15);
- `tool_calls_per_episode` after SFT and after RL (greedy validation);
- `token_mismatch`: the largest `rollout/token_mismatch` of any GRPO step (the tokens
  trained on that differ from the rollout's record; must be 0);
- `loss_on_tool_tokens`: the largest `multi_turn/loss_on_tool_tokens` of any step
  (tool-response tokens the loss mask covers, counted from the mask; must be 0), with
  the tool tokens the steps appended in all (`tool_tokens`);
- `wall_s`: the whole pipeline, Ray and worker start-ups included (target <= 600).

The demo's own output goes to stderr. Usage: `python bench/e2e_agent_cpu.py [--seed 1]
[--output-dir DIR] [--mode sync|async]`; extra `KEY=VALUE` arguments override the RL
stage. `--mode async` trains the RL stage asynchronously (`ASYNC`): one rollout replica
in a process of its own generates the episodes while the trainer trains, with partial
rollouts, the weights sent after every step and verl's staleness threshold of 0.1 (a
tenth of a batch may come from the weights before; with 1, a whole batch one step
behind, the gain fell to +15.7, +23.4 and -18.0 points on seeds 1-3, CPU, 2026-12-06).
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
from pathlib import Path

from _common import emit_line

BENCH = "e2e_agent_cpu"
# --mode async: the RL stage with a rollout pool of one replica, a tenth of a batch stale
ASYNC = [
    "actor_rollout_ref.rollout.mode=async",
    "rollout.n_gpus_per_node=1",
    "async_training.trigger_parameter_sync_step=1",
    "async_training.staleness_threshold=0.1",
    "async_training.partial_rollout=true",
]


emit = functools.partial(emit_line, BENCH)


def largest(history: list[dict], key: str) -> float:
    """The largest value of a per-step metric (NaN when no step logged it)."""
    values = [m[key] for m in history if key in m]
    return max(values) if values else float("nan")


def main() -> None:
    from rayrl.cli.common import console
    from rayrl.cli.demo_cmd import DemoPlan, run_pipeline

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--output-dir", default=None, help="default: a temporary directory")
    parser.add_argument("--sft", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="SIZE=N",
        help="a tiny-model size in place of the task's (layers, hidden, heads, kv_heads, ...)",
    )
    parser.add_argument("--mode", choices=("sync", "async"), default="sync")
    parser.add_argument("overrides", nargs="*", help="overrides of the RL stage")
    args = parser.parse_args()
    rl = (ASYNC if args.mode == "async" else []) + list(args.overrides)
    out = Path(args.output_dir or tempfile.mkdtemp(prefix="rayrl-e2e-agent-"))
    plan = DemoPlan(
        out,
        seed=args.seed,
        shared=["resources.dashboard=false"],  # not needed here; one thing less to start
        sft=args.sft,
        rl=rl,
        task="tools",
        model={k: int(v) for k, v in (m.split("=", 1) for m in args.model)},
    )
    start = time.perf_counter()
    result = run_pipeline(plan, console(stderr=True))
    wall = time.perf_counter() - start
    seed = {"seed": args.seed, "val_size": result.val_size, "mode": args.mode}
    emit("accuracy_base", result.accuracy["base"], "fraction", **seed)
    emit("accuracy_after_sft", result.accuracy["sft"], "fraction", **seed)
    emit("accuracy_after_rl", result.accuracy["rl"], "fraction", **seed)
    emit("rl_gain", result.gain_points, "points", target=15, better="higher", **seed)
    for stage, name in (("sft", "after_sft"), ("rl", "after_rl")):
        calls = result.tool_calls.get(stage, float("nan"))
        emit("tool_calls_per_episode", calls, "calls", stage=name, **seed)
    history = result.rl_history
    emit(
        "token_mismatch",
        largest(history, "rollout/token_mismatch"),
        "tokens",
        target=0,
        better="lower",
        steps=len(history),
        **seed,
    )
    emit(
        "loss_on_tool_tokens",
        largest(history, "multi_turn/loss_on_tool_tokens"),
        "tokens",
        target=0,
        better="lower",
        tool_tokens=sum(m.get("multi_turn/tool_tokens", 0.0) for m in history),
        **seed,
    )
    emit(
        "wall_s",
        wall,
        "s",
        target=600,
        better="lower",
        **{f"{k}_s": round(v, 1) for k, v in result.seconds.items()},
    )


if __name__ == "__main__":
    main()
