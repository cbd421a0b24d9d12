"""A small GRPO run on CPU, rayrl against TRL doing the same work, side by side (issue 15).

Both systems train the demo's tiny model (built once, `rayrl.models.build_tiny_model`
with the demo's shape and seed) on the same prompts in the same order (the demo's
synthetic arithmetic task: one parquet file, shuffling off on both sides) with the
same reward (rayrl's `arithmetic` scorer; TRL calls it in-process), GRPO with the
demo's settings: 8 prompts x 4 samples per step, up to 32 new tokens, temperature 1,
AdamW at a constant lr 1e-5 (no weight decay, gradient clipping at 1), a KL term of
coefficient 0.001 against the frozen start (k3 / low_var_kl), 12 steps. Each step is
one optimizer step over its 32 samples in one micro-batch on both sides (rayrl:
`ppo_mini_batch_size=8`, TRL: `per_device_train_batch_size=32`), fp32, no gradient
checkpointing, no vLLM. rayrl runs as a user runs it, `rayrl train -c grpo ...` in its
own process with its own embedded Ray (no validation; it saves its final checkpoint
and HF export as it always does); TRL runs `GRPOTrainer` in its own process and saves
the model at the end.

Rounds interleave the two systems, alternating which goes first; each ratio is the
median of the per-round ratios. JSON lines (`bench`, `metric`, `value`, `unit`,
`target`/`better` where issue 15 sets one):

- `step_ratio_vs_trl`: rayrl / TRL, median step time of steps 3-12 (target <= 1.0);
- `wall_ratio_vs_trl`: rayrl / TRL, the whole command from spawn to exit (target <= 2.0);
- per system: `step_s` (median of steps 3-12), `first_step_s`, `tokens_per_s` (prompt
  and response tokens of a step over its time, median), `wall_s`; for rayrl also
  `ready_s` (Ray start, pools, workers and models), `stopped_s` (teardown),
  `old_log_prob_s` and `controller_overhead_s` (medians);
- `load_avg_1m` at the start and the end (the machine is shared: read ratios with it);
- `stage_s` per stage (`stage`: median of steps 3-12): rayrl's `timing_s/*` always, and
  with `--breakdown` TRL's too (`gen`: tokenize, generate, decode; `reward`; `ref`;
  `policy_forward`; `loss`; `train_step`: generation, scoring, loss and backward), by
  wrapping its trainer's methods.

Both processes get `OMP_WAIT_POLICY=PASSIVE` unless it is set (the same thread
behaviour on both sides; `rayrl train` sets it for its workers).

    python bench/vs_trl_cpu.py [--rounds 2] [--steps 12] [--out FILE] [--breakdown]

Needs TRL: `pip install -e .[bench]`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import hardware

BENCH = "vs_trl_cpu"
ROOT = Path(__file__).resolve().parents[1]
PROMPTS, SAMPLES, NEW_TOKENS, LR, KL = 8, 4, 32, 1e-5, 0.001
STEADY = slice(2, None)  # steps 3.. (the first two warm caches and allocators)


def prepare(workdir: Path, steps: int) -> tuple[Path, Path]:
    """The demo's tiny model and `steps` x 8 arithmetic prompts in a parquet file."""
    from rayrl.config import load_config
    from rayrl.data import synthetic_rows
    from rayrl.data.dataset import write_parquet
    from rayrl.models import build_tiny_model

    cfg = load_config("grpo", [])
    model = build_tiny_model(workdir / "model", layers=2, hidden=64, seed=cfg.trainer.seed)
    rows = synthetic_rows(cfg.data.synthetic_task, steps * PROMPTS, cfg.trainer.seed)
    return Path(model), write_parquet(rows, workdir / "train.parquet")


# ----------------------------------------------------------------------- rayrl
def run_rayrl(model: Path, data: Path, steps: int, out: Path, breakdown: bool = False) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "rayrl.cli.main",
        "train",
        "-c",
        "grpo",
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files=[{data}]",
        "data.shuffle=false",
        f"data.train_batch_size={PROMPTS}",
        f"data.max_response_length={NEW_TOKENS}",
        f"actor_rollout_ref.rollout.n={SAMPLES}",
        f"actor_rollout_ref.actor.optim.lr={LR}",
        "actor_rollout_ref.actor.use_kl_loss=true",
        f"actor_rollout_ref.actor.kl_loss_coef={KL}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={PROMPTS * SAMPLES}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={PROMPTS * SAMPLES}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={PROMPTS * SAMPLES}",
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=false",
        "trainer.device=cpu",
        "resources.dashboard=false",
        f"trainer.output_dir={out}",
        "trainer.resume_mode=disable",
    ]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), check=False)
    wall = time.perf_counter() - start
    text = done.stdout + done.stderr
    if done.returncode != 0:
        return {"error": f"rayrl exited with {done.returncode}: {text[-2000:]}"}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing_s/step" in r]
    return {
        "wall_s": wall,
        "steps": [r["timing_s/step"] for r in rows],
        "tokens_per_s": [r["perf/throughput"] for r in rows],
        "old_log_prob_s": [r["timing_s/old_log_prob"] for r in rows],
        "controller_overhead_s": [r.get("timing_s/controller_overhead") for r in rows],
        "ready_s": _seconds(r"ready in ([\d.]+) s", text),
        "stopped_s": _seconds(r"stopped in ([\d.]+) s", text),
        "stages": {
            k.removeprefix("timing_s/"): [r[k] for r in rows]
            for k in rows[0]
            if k.startswith("timing_s/") and k != "timing_s/step"
        },
    }


# ------------------------------------------------------------------------- TRL
def run_trl(model: Path, data: Path, steps: int, out: Path, breakdown: bool = False) -> dict:
    job = {
        "model": str(model),
        "data": str(data),
        "steps": steps,
        "out": str(out),
        "breakdown": breakdown,
    }
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, __file__, "--trl-job", json.dumps(job)],
        capture_output=True,
        text=True,
        env=_env(),
        check=False,
    )
    wall = time.perf_counter() - start
    result = out / "result.json"
    if done.returncode != 0 or not result.is_file():
        return {
            "error": f"TRL exited with {done.returncode}: {(done.stdout + done.stderr)[-2000:]}"
        }
    return {**json.loads(result.read_text()), "wall_s": wall}


def trl_job(job: dict) -> None:
    """The TRL process: GRPOTrainer on the same model, prompts, reward and settings."""
    import pyarrow.parquet as pq
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rayrl.rewards import compute_score

    out = Path(job["out"])
    rows = pq.read_table(job["data"]).to_pylist()
    dataset = Dataset.from_list(
        [{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]} for r in rows]
    )

    def reward(completions, ground_truth, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        scores = [
            compute_score("arithmetic", t, g, None)
            for t, g in zip(texts, ground_truth, strict=True)
        ]
        return [float(s["score"] if isinstance(s, dict) else s) for s in scores]

    config = GRPOConfig(
        output_dir=str(out / "trl"),
        per_device_train_batch_size=PROMPTS * SAMPLES,
        gradient_accumulation_steps=1,
        num_generations=SAMPLES,
        max_completion_length=NEW_TOKENS,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        warmup_steps=0,
        beta=KL,
        loss_type="dapo",
        gradient_checkpointing=False,
        use_cpu=True,
        bf16=False,
        shuffle_dataset=False,
        max_steps=job["steps"],
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_vllm=False,
        seed=1,
    )

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.starts: list[float] = []
            self.ends: list[float] = []

        def on_step_begin(self, *args, **kwargs):
            self.starts.append(time.perf_counter())

        def on_step_end(self, *args, **kwargs):
            self.ends.append(time.perf_counter())

    clock = Clock()
    trainer = GRPOTrainer(
        model=job["model"],
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        callbacks=[clock],
    )
    stages = _trl_stage_timers(trainer) if job.get("breakdown") else None
    trainer.train()
    trainer.save_model(str(out / "trl" / "final"))
    steps = [end - begin for begin, end in zip(clock.starts, clock.ends, strict=True)]
    seen = [h["num_tokens"] for h in trainer.state.log_history if "num_tokens" in h]
    tokens = [b - a for a, b in zip([0.0, *seen], seen, strict=False)]
    result = {
        "steps": steps,
        "tokens_per_s": [t / s for t, s in zip(tokens, steps, strict=False)],
        "completion_len": [h.get("completions/mean_length") for h in trainer.state.log_history],
    }
    if stages is not None:
        result["stages"] = stages
    (out / "result.json").write_text(json.dumps(result))


def _trl_stage_timers(trainer) -> dict[str, list[float]]:
    """Per-step seconds of TRL's stages (`--breakdown`), by wrapping the trainer's own
    methods: `gen` (tokenize, `generate`, decode), `reward`, `ref` (the reference
    model's log-probs), `policy_forward` (the loss's forward), `loss` (compute_loss),
    `train_step` (generation, scoring, loss and backward: Trainer.training_step)."""
    stages: dict[str, list[float]] = {}

    def wrap(name: str, stage) -> None:
        inner = getattr(trainer, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                key = stage(args) if callable(stage) else stage
                stages.setdefault(key, []).append(time.perf_counter() - start)

        setattr(trainer, name, timed)

    wrap("_generate", "gen")
    wrap("_calculate_rewards", "reward")
    wrap(
        "_get_per_token_logps_and_entropies",
        lambda args: "ref" if args[0] is trainer.ref_model else "policy_forward",
    )
    wrap("compute_loss", "loss")
    wrap("training_step", "train_step")
    return stages


# ---------------------------------------------------------------------- report
def _env() -> dict:
    """Both systems' environment. OpenMP threads sleep at barriers on both sides (as in
    the workers of the Ray that `rayrl train` starts): TRL's process with spinning
    threads ran its steps ~50x slower on the shared 2-core machine under load."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "RAY_USAGE_STATS_ENABLED": "0"}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.pop("RAY_ADDRESS", None)
    return env


def _seconds(pattern: str, text: str) -> float | None:
    found = re.search(pattern, text)
    return float(found.group(1)) if found else None


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(system: str, runs: list[dict]) -> list[dict]:
    lines = []

    def line(metric: str, values: list, unit: str, **extra) -> None:
        lines.append(
            {
                "bench": BENCH,
                "system": system,
                "metric": metric,
                "value": _median(values),
                "unit": unit,
                "runs": values,
                **extra,
            }
        )

    line("step_s", [_median(r["steps"][STEADY]) for r in runs], "s", better="lower")
    line("first_step_s", [r["steps"][0] for r in runs], "s", better="lower")
    line(
        "tokens_per_s",
        [_median(r["tokens_per_s"][STEADY]) for r in runs],
        "tokens/s",
        better="higher",
    )
    line("wall_s", [r["wall_s"] for r in runs], "s", better="lower")
    for key in ("ready_s", "stopped_s"):
        if key in runs[0]:
            line(key, [r[key] for r in runs], "s", better="lower")
    for key in ("old_log_prob_s", "controller_overhead_s"):
        if key in runs[0]:
            line(key, [_median(r[key][STEADY]) for r in runs], "s", better="lower")
    for stage in runs[0].get("stages") or {}:
        line("stage_s", [_median(r["stages"][stage][STEADY]) for r in runs], "s", stage=stage)
    return lines


def ratio(metric: str, rayrl: list[float], trl: list[float], target: float) -> dict:
    per_round = [a / b for a, b in zip(rayrl, trl, strict=True)]
    return {
        "bench": BENCH,
        "metric": metric,
        "value": statistics.median(per_round),
        "unit": "ratio",
        "target": target,
        "better": "lower",
        "rounds": per_round,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", default=None, help="append the JSON lines to this file too")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also time TRL's stages and print both systems' stage_s lines",
    )
    parser.add_argument("--trl-job", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_job:
        trl_job(json.loads(args.trl_job))
        return
    date = datetime.date.today().isoformat()
    out_file = Path(args.out or ROOT / "bench" / "results" / f"{BENCH}-{date}.jsonl")
    emitted = []

    def emit(obj: dict) -> None:
        obj = {**obj, "date": date}
        emitted.append(obj)
        print(json.dumps(obj), flush=True)

    emit(
        {
            "bench": BENCH,
            "metric": "load_avg_1m",
            "value": os.getloadavg()[0],
            "unit": "load",
            "when": "start",
            "cpus": os.cpu_count(),
            "hardware": hardware(),
        }
    )
    runs: dict[str, list[dict]] = {"rayrl": [], "trl": []}
    with tempfile.TemporaryDirectory() as tmp:
        model, data = prepare(Path(tmp), args.steps)
        for i in range(args.rounds):
            order = ("rayrl", "trl") if i % 2 == 0 else ("trl", "rayrl")
            for system in order:
                fn = run_rayrl if system == "rayrl" else run_trl
                result = fn(model, data, args.steps, Path(tmp) / f"{system}-{i}", args.breakdown)
                if "error" in result:
                    emit(
                        {
                            "bench": BENCH,
                            "system": system,
                            "metric": "error",
                            "value": None,
                            "unit": "",
                            "error": result["error"],
                        }
                    )
                    sys.exit(1)
                runs[system].append(result)
    for system, results in runs.items():
        for obj in summarize(system, results):
            emit(obj)
    step = {s: [_median(r["steps"][STEADY]) for r in runs[s]] for s in runs}
    emit(ratio("step_ratio_vs_trl", step["rayrl"], step["trl"], 1.0))
    emit(
        ratio(
            "wall_ratio_vs_trl",
            [r["wall_s"] for r in runs["rayrl"]],
            [r["wall_s"] for r in runs["trl"]],
            2.0,
        )
    )
    emit(
        {
            "bench": BENCH,
            "metric": "load_avg_1m",
            "value": os.getloadavg()[0],
            "unit": "load",
            "when": "end",
        }
    )
    out_file.parent.mkdir(parents=True, exist_ok=True)
    with out_file.open("a") as f:
        for obj in emitted:
            f.write(json.dumps(obj) + "\n")


if __name__ == "__main__":
    main()
