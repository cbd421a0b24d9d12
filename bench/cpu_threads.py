"""torch threads of a CPU worker: one thread against two, spinning or sleeping at OpenMP
barriers, on the demo's work (issue 15).

Each setting runs in a fresh process (OpenMP reads `OMP_NUM_THREADS` and
`OMP_WAIT_POLICY` when torch loads): the demo's tiny model generates 8 prompts x 4
samples of 32 tokens with rayrl's HF engine, then takes one actor update on them (the
GRPO loss with the KL term, one micro-batch). Settings: `1` (one thread), `2-active`
(two threads, OpenMP's default spinning), `2-passive` (two threads that sleep at a
barrier: what a `rayrl train` worker gets, `rayrl.trainer.ray_session.WORKER_ENV`).
Rounds interleave the settings, their order rotating; per setting the median over
rounds of each process's median iteration. JSON lines: `gen_s`, `update_s` per setting,
and `<setting>_vs_1_thread` ratios (median of per-round ratios of gen + update time),
with the 1-minute load average before and after (the machine may be shared).

    python bench/cpu_threads.py [--rounds 3] [--iters 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = "cpu_threads"
ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {
    "1": {"OMP_NUM_THREADS": "1"},
    "2-active": {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "ACTIVE"},
    "2-passive": {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"},
}


def child(model: str, iters: int) -> None:
    """One setting: median seconds of generation and of an update, as JSON."""
    import torch

    from rayrl.config import load_config
    from rayrl.data import PromptDataset, synthetic_rows
    from rayrl.rollout import HFRolloutEngine, SamplingParams
    from rayrl.train.engine import TrainEngine
    from rayrl.workers.losses import actor_loss_fn

    cfg = load_config("grpo", ["actor_rollout_ref.actor.kl_loss_coef=0.001"])
    engine = TrainEngine(model, optim={"lr": 1e-5})
    rollout = HFRolloutEngine(model=engine.model, tokenizer=_tokenizer(model))
    prompts = PromptDataset(
        synthetic_rows(size=8, seed=1), rollout.tokenizer, max_prompt_length=64
    ).collate(list(range(8)))
    params = SamplingParams(n=4, temperature=1.0, top_p=1.0, max_new_tokens=32, seed=1)
    loss = actor_loss_fn(cfg.actor_rollout_ref.actor, 32)
    gen, update = [], []
    for step in range(iters + 1):
        prompts.meta["step"] = step
        start = time.perf_counter()
        batch = rollout.generate(prompts, params)
        gen.append(time.perf_counter() - start)
        batch.meta["temperature"] = 1.0
        old = engine.forward(batch, micro_batch_size=32)["log_probs"]
        batch["old_log_probs"], batch["ref_log_prob"] = old, old
        batch["advantages"] = torch.randn(batch["responses"].shape)
        start = time.perf_counter()
        engine.train_step(batch, loss, micro_batch_size=32)
        update.append(time.perf_counter() - start)
    print(
        json.dumps(
            {
                "gen_s": statistics.median(gen[1:]),
                "update_s": statistics.median(update[1:]),
                "threads": torch.get_num_threads(),
            }
        )
    )


def _tokenizer(model: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def run(setting: str, model: Path, iters: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "MKL_"))}
    env.update(SETTINGS[setting], PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run(
        [sys.executable, __file__, "--child", str(model), "--iters", str(iters)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def emit(obj: dict) -> None:
    print(json.dumps({"bench": BENCH, **obj}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.iters)
        return
    from rayrl.models import build_tiny_model

    emit({"metric": "load_avg_1m", "value": os.getloadavg()[0], "unit": "load", "when": "start"})
    names = list(SETTINGS)
    results: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "model", layers=2, hidden=64, seed=1)
        for i in range(args.rounds):
            for name in names[i % 3 :] + names[: i % 3]:
                results[name].append(run(name, model, args.iters))
    for name, runs in results.items():
        for key in ("gen_s", "update_s"):
            values = [r[key] for r in runs]
            emit(
                {
                    "metric": key,
                    "setting": name,
                    "value": statistics.median(values),
                    "unit": "s",
                    "runs": values,
                    "threads": runs[0]["threads"],
                }
            )
    base = [r["gen_s"] + r["update_s"] for r in results["1"]]
    for name in names[1:]:
        per_round = [
            (r["gen_s"] + r["update_s"]) / b for r, b in zip(results[name], base, strict=True)
        ]
        emit(
            {
                "metric": f"{name}_vs_1_thread",
                "value": statistics.median(per_round),
                "unit": "ratio",
                "better": "lower",
                "rounds": per_round,
            }
        )
    emit({"metric": "load_avg_1m", "value": os.getloadavg()[0], "unit": "load", "when": "end"})


if __name__ == "__main__":
    main()
