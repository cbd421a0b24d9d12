"""The demo's pipeline end to end on CPU: base validation, SFT, then GRPO (`rayrl demo`).

Runs `rayrl.cli.demo_cmd.run_pipeline` (the same stages and built-in `demo` configs as
`rayrl demo`: the tiny model, the synthetic `larger` task, SFT on demonstrations right
30% of the time, GRPO with the exact reward, greedy validation on held-out questions)
and prints one JSON object per line:

- `accuracy_base`, `accuracy_before_rl` (after SFT), `accuracy_after_rl`: greedy
  validation accuracy (fraction of the held-out questions);
- `rl_gain`: accuracy_after_rl - accuracy_before_rl in points (target >= 15);
- `steps_per_s`, `tokens_per_s`: GRPO steps and tokens (prompt + response, all
  samples) per second of step time (validation and start-up left out);
- `sft_steps_per_s`, `sft_tokens_per_s`: the same for the SFT stage;
- `wall_s`: the whole pipeline, Ray and worker start-ups included (target <= 600).

The demo's own output goes to stderr. Usage: `python bench/e2e_cpu.py [--seed 1]
[--output-dir DIR] [--family qwen3_moe] [--task vision [--no-images]]`; extra
`KEY=VALUE` arguments override the RL stage. `--task vision` is `rayrl demo --task
vision` (a tiny vision-language model names the colour of an image); `--no-images` its
control, the same questions without the images, whose accuracies stay at chance (1/8). With an MoE family, e.g. routing replay: `--family qwen3_moe
actor_rollout_ref.rollout.name=native
actor_rollout_ref.rollout.enable_rollout_routing_replay=true
actor_rollout_ref.actor.router_replay.mode=R3`.
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
from pathlib import Path

from _common import emit_line

BENCH = "e2e_cpu"


emit = functools.partial(emit_line, BENCH)


def rates(history: list[dict]) -> tuple[float, float]:
    """(steps, tokens) per second of step time."""
    seconds = sum(m["timing_s/step"] for m in history)
    tokens = sum(m["perf/total_num_tokens"] for m in history)
    return len(history) / seconds, tokens / seconds


def main() -> None:
    from rayrl.cli.common import console
    from rayrl.cli.demo_cmd import DemoPlan, run_pipeline

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--output-dir", default=None, help="default: a temporary directory")
    parser.add_argument("--sft", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--family", default=None, help="the tiny model's family (qwen2; qwen3_moe, mixtral, ...)"
    )
    parser.add_argument("--task", default="larger", help="the demo's task: larger, tools, vision")
    parser.add_argument(
        "--no-images", action="store_true", help="--task vision without its images (control)"
    )
    parser.add_argument("overrides", nargs="*", help="overrides of the RL stage")
    args = parser.parse_args()
    out = Path(args.output_dir or tempfile.mkdtemp(prefix="rayrl-e2e-"))
    model = {"family": args.family} if args.family else {}
    plan = DemoPlan(
        out,
        seed=args.seed,
        sft=args.sft,
        rl=args.overrides,
        model=model,
        task=args.task,
        images=not args.no_images,
    )
    start = time.perf_counter()
    result = run_pipeline(plan, console(stderr=True))
    wall = time.perf_counter() - start
    seed = {
        "seed": args.seed,
        "val_size": result.val_size,
        "task": args.task,
        **({"images": False} if args.no_images else {}),
    }
    emit("accuracy_base", result.accuracy["base"], "fraction", **seed)
    emit("accuracy_before_rl", result.accuracy["sft"], "fraction", **seed)
    emit("accuracy_after_rl", result.accuracy["rl"], "fraction", **seed)
    emit("rl_gain", result.gain_points, "points", target=15, better="higher", **seed)
    steps, tokens = rates(result.rl_history)
    emit("steps_per_s", steps, "steps/s", stage="rl", steps=len(result.rl_history))
    emit("tokens_per_s", tokens, "tokens/s", stage="rl")
    steps, tokens = rates(result.sft_history)
    emit("sft_steps_per_s", steps, "steps/s", stage="sft", steps=len(result.sft_history))
    emit("sft_tokens_per_s", tokens, "tokens/s", stage="sft")
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
