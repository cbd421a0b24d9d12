"""GRPO steps of a mixture-of-experts model on one GPU, with and without routing replay.

The model is Qwen3-30B-A3B's layer (hidden 2048, 32 query and 4 KV heads of 128, 128
experts of width 768, top-8 renormalised: `bench/rollout.py`'s ``moe_config``) at
``--layers`` of its 48 layers, its full vocabulary, random bf16 weights (built on the
GPU, saved once). Each run is `bench/gpu_e2e.py`'s rayrl GRPO through the product path
(`PPOTrainer`, the native rollout, ``ignore_eos``: every response ``--response-len``
tokens) with what one GPU needs for a model this size: bf16 master weights and moments,
activation checkpointing, the rollout at ``--gpu-mem`` of the GPU; the rollout records
each token's experts (``rollout.enable_rollout_routing_replay``) and reports its own
log-probs (``rollout.calculate_log_probs``). Two runs, one per ``--modes`` entry
(``actor.router_replay.mode``: ``disabled`` measures how often training routes a token
differently from the rollout; ``R3`` replays the rollout's routing).

One JSON line per run and metric (``bench``, ``device``, ``date``, ``mode``, ``metric``,
``value``, ``unit``): ``step_s`` (median of the measured steps, each step in
``per_step``, the stage medians in ``stages``), ``actor_mfu`` (``perf/mfu/actor``,
counted on the *active* parameters: each token meets 8 of 128 experts), the routing
metrics (``actor/routing_mismatch_frac``, ``actor/router_disagree_frac``,
``actor/routing_recorded_frac``) and the rollout-vs-training probability gap
(``training/rollout_probs_diff_mean`` / ``_max``), medians over the measured steps;
``params_b`` and ``active_params_b`` of the model. Lines are also appended to ``--out``.

    python bench/gpu_moe.py [--layers 6] [--seqs 128] [--steps 3] [--modes disabled,R3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from gpu_e2e import emit, make_rows, run_rayrl
from rollout_models import moe_config

BENCH = "gpu_moe"
PER_STEP = (
    "actor/routing_mismatch_frac",
    "actor/router_disagree_frac",
    "actor/routing_recorded_frac",
    "training/rollout_probs_diff_mean",
    "training/rollout_probs_diff_max",
    "perf/mfu/actor",
)


def build_moe(path: Path, layers: int, device: str) -> tuple[Path, dict]:
    """The benchmark model saved at ``path`` (random bf16 weights drawn on ``device``),
    with its total and active parameter counts in billions."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rayrl.models.flops import FlopModel
    from rayrl.models.tiny import preset

    config = moe_config()
    config.num_hidden_layers = layers
    config.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    total = sum(p.numel() for p in model.parameters())
    sizes = FlopModel.of(model)
    active = sizes.body_params + sizes.head_params  # what a token meets, head included
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache() if device == "cuda" else None
    tokenizer = AutoTokenizer.from_pretrained(preset("tiny").build(path.parent / "tok"))
    tokenizer.save_pretrained(path)
    return path, {"params_b": total / 1e9, "active_params_b": active / 1e9}


def overrides(args: argparse.Namespace, mode: str) -> tuple[str, ...]:
    """The keys of a run beside `run_rayrl`'s own (module docstring)."""
    return (
        "actor_rollout_ref.model.enable_gradient_checkpointing=true",
        "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16",
        f"actor_rollout_ref.actor.fsdp_config.optimizer_offload={args.optimizer_offload}",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={args.gpu_mem}",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
        f"actor_rollout_ref.actor.router_replay.mode={mode}",
        "trainer.export_hf=false",
        f"resources.cpus_per_worker={max(1, min(8, (os.cpu_count() or 2) // 2))}",
    )


def medians(history: list[dict], keys: tuple[str, ...]) -> dict[str, float]:
    out = {}
    for key in keys:
        values = [h[key] for h in history if h.get(key) is not None]
        if values:
            out[key] = statistics.median(values)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--seqs", type=int, default=128, help="sequences per step")
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=3, help="measured steps after warm-up")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--modes", default="disabled,R3")
    p.add_argument("--gpu-mem", type=float, default=0.3, help="the rollout's GPU share")
    p.add_argument("--optimizer-offload", default="false", choices=["true", "false"])
    p.add_argument("--max-tokens", type=int, default=16384, help="tokens per micro-batch")
    p.add_argument("--logprob-micro", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.rollout, args.worker_logs = "native", False
    date = datetime.datetime.now(datetime.timezone.utc)
    out = Path(args.out or Path(__file__).parent / "results" / f"{BENCH}-{date:%Y-%m-%d}.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    common = {
        "bench": BENCH,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "date": date.isoformat(timespec="seconds"),
        "layers": args.layers,
        "seqs_per_step": args.seqs,
        "prompt_len": args.prompt_len,
        "response_len": args.response_len,
    }
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        model_dir, sizes = build_moe(Path(tmp) / "moe", args.layers, args.device)
        common.update(sizes, build_s=round(time.perf_counter() - start, 1))
        from transformers import AutoTokenizer

        rows = make_rows(AutoTokenizer.from_pretrained(model_dir), 256, args.prompt_len)
        for mode in (m for m in args.modes.split(",") if m):
            history: list[dict] = []
            res = run_rayrl(
                args, model_dir, rows, args.seqs, extra=overrides(args, mode), history_to=history
            )
            base = {**common, "mode": mode}
            emit(
                {
                    **base,
                    "metric": "step_s",
                    "value": res["step_s"],
                    "unit": "s",
                    "per_step": res["per_step"]["step"],
                    "stages": res["stages"],
                    "peak_mem_gb": res["peak_mem_gb"],
                    "grad_finite": res["grad_finite"],
                },
                out,
            )
            for key, value in medians(history[args.warmup :], PER_STEP).items():
                emit({**base, "metric": key, "value": value, "unit": "fraction"}, out)
    print(json.dumps({"done": True, "out": str(out)}))


if __name__ == "__main__":
    main()
