"""Benchmark: the demo's GRPO step (tiny model, `rayrl train -c demo`), where its time goes.

Runs the built-in `demo` RL config through the product's trainer (`Run(PPOTrainer)`,
real Ray roles) for `--steps` steps on `--device`, and prints JSON lines:

- `step_s`, `gen_s` and every other `timing_s/*` stage: medians over the steps after
  the third (`--skip`), as the run's own metrics report them;
- with `--profile-call N`, the N-th call of the actor's `generate` on rank 0 runs under
  `cProfile` and `torch.profiler` (a call hook, `rayrl.controller.calls`): the top
  functions by cumulative time and the top operators by self CPU / device time are
  written to `--out` (`generate-cprofile.txt`, `generate-torch.txt`) and the hook's
  own figure (`profiled_call_s`) is printed.

    python bench/small_step.py [--device cuda] [--steps 12] [--profile-call 6]
        [--out DIR] [--set KEY=VALUE ...]

`--set` adds config overrides (e.g. `actor_rollout_ref.rollout.free_cache_engine=false`)
so settings can be compared run by run.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import emit_line, hardware
from rayrl.config import load_config
from rayrl.trainer.ppo import PPOTrainer
from rayrl.trainer.run import Run

BENCH = "small_step"


class ProfileCall:
    """Call hook: profile call number `nth` of `method` on rank 0, write the tables."""

    def __init__(self, method: str, nth: int, out: str) -> None:
        self.method, self.nth, self.out, self.seen = method, nth, out, 0

    def __call__(self, worker, name):
        ctx = getattr(worker, "ctx", None)
        if name != self.method or (ctx is not None and ctx.rank != 0):
            return None
        self.seen += 1
        return self._profile() if self.seen == self.nth else None

    def _profile(self):
        import contextlib
        import cProfile
        import io
        import pstats

        import torch

        @contextlib.contextmanager
        def around():
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            python = cProfile.Profile()
            start = time.perf_counter()
            with torch.profiler.profile(activities=activities) as prof:
                python.enable()
                try:
                    yield
                finally:
                    python.disable()
                    if torch.cuda.is_available():
                        torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            out = Path(self.out)
            out.mkdir(parents=True, exist_ok=True)
            text = io.StringIO()
            pstats.Stats(python, stream=text).sort_stats("cumulative").print_stats(60)
            (out / f"{self.method}-cprofile.txt").write_text(text.getvalue())
            tables = [f"profiled call: {seconds:.4f} s"]
            for key in ("self_cpu_time_total", "self_device_time_total"):
                tables.append(prof.key_averages().table(sort_by=key, row_limit=30))
            (out / f"{self.method}-torch.txt").write_text("\n\n".join(tables))
            (out / "profiled_call_s").write_text(f"{seconds}")

        return around()


emit = functools.partial(emit_line, BENCH)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=3, help="steps left out of the medians")
    parser.add_argument("--profile-call", type=int, default=0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--set", nargs="*", default=[], help="config overrides KEY=VALUE")
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="small-step-")
    overrides = [
        f"trainer.device={args.device}",
        f"trainer.total_training_steps={args.steps}",
        f"trainer.output_dir={out}/run",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.export_hf=false",
        "trainer.logger=[jsonl]",
        *args.set,
    ]
    cfg = load_config("demo", overrides)
    training = Run(PPOTrainer(cfg, print_fn=lambda text: print(text, file=sys.stderr)))
    try:
        training.setup()
        if args.profile_call:
            hook = ProfileCall("generate", args.profile_call, out)
            for group in training.groups:  # only the actor's group has `generate`
                group.add_call_hook(hook)
        history = training.fit()
    finally:
        training.shutdown()
    kept = history[args.skip :] or history
    stages = sorted({k for row in kept for k in row if k.startswith("timing_s/")})
    where = {"device": args.device, "settings": args.set, "hardware": hardware(args.device)}
    for key in stages:
        values = [row[key] for row in kept if key in row]
        emit(key.removeprefix("timing_s/") + "_s", statistics.median(values), "s", **where)
    profiled = Path(out) / "profiled_call_s"
    if profiled.exists():
        emit("profiled_call_s", float(profiled.read_text()), "s", tables=out, **where)


if __name__ == "__main__":
    main()
