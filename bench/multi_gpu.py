"""Multi-GPU scaling of rayrl's GRPO step on one host (FSDP2 over NCCL, hybrid engine on
every rank): tokens/s per GPU at N GPUs against 1 GPU.

The work is `bench/gpu_e2e.py`'s (reference-shape model, group size 8, prompt 256 +
response 256 tokens, the same optimizer settings), run through the product path
(`PPOTrainer`) with ``trainer.n_gpus_per_node`` set to 1 and then N:

* weak scaling: ``--seqs`` sequences per GPU (N x seqs at N GPUs);
* strong scaling: ``--seqs`` sequences in all, whatever the number of GPUs.

``scaling_efficiency`` = (tokens/s per GPU at N) / (tokens/s per GPU at 1), with ``mode``
and ``n_gpus`` fields; ``weight_sync_ms`` per step at N GPUs; each run's stage times.
Lines go to stdout and to ``--out`` (default bench/results/multi_gpu-<date>.jsonl).

    python bench/multi_gpu.py [--gpus 2] [--seqs 256] [--steps 2] [--warmup 1]
"""

from __future__ import annotations

import argparse
import datetime
import tempfile
from pathlib import Path

import torch

from gpu_e2e import build_model, emit, make_rows, run_rayrl

BENCH = "multi_gpu"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--seqs", type=int, default=256, help="sequences per step on one GPU")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--preset", default="qwen2.5-0.5b", choices=["qwen2.5-0.5b", "tiny"])
    p.add_argument("--sft-steps", type=int, default=0)
    p.add_argument("--rollout", default=None)
    p.add_argument("--model-dir", default=None)
    p.add_argument("--worker-logs", action="store_true")
    p.add_argument("--max-tokens", type=int, default=16384)
    p.add_argument("--logprob-micro", type=int, default=64)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    date = datetime.datetime.now(datetime.timezone.utc)
    out = Path(args.out or Path(__file__).parent / "results" / f"{BENCH}-{date:%Y-%m-%d}.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    common = {
        "bench": BENCH,
        "date": date.isoformat(timespec="seconds"),
        "preset": args.preset,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "prompt_len": args.prompt_len,
        "response_len": args.response_len,
        "group": args.group,
    }
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(args, Path(tmp))
        from transformers import AutoTokenizer

        rows = make_rows(AutoTokenizer.from_pretrained(model_dir), 2048, args.prompt_len)
        runs = {
            "1": (1, args.seqs),
            "weak": (args.gpus, args.seqs * args.gpus),
            "strong": (args.gpus, args.seqs),
        }
        per_gpu = {}
        for name, (gpus, seqs) in runs.items():
            res = run_rayrl(
                argparse.Namespace(**{**vars(args), "gpus": gpus}), model_dir, rows, seqs
            )
            per_gpu[name] = res["tokens_per_s"]  # perf/throughput is per GPU
            line = {**common, "n_gpus": gpus, "seqs_per_step": seqs}
            emit(
                {
                    **line,
                    "metric": "tokens_per_s_per_gpu",
                    "value": per_gpu[name],
                    "unit": "tokens/s",
                    "step_s": res["step_s"],
                    "stages": res["stages"],
                    "grad_finite": res["grad_finite"],
                },
                out,
            )
            sync = res["stages"].get("weight_sync")
            if gpus > 1 and sync is not None:
                emit(
                    {
                        **line,
                        "metric": "weight_sync_ms",
                        "value": sync * 1e3,
                        "unit": "ms",
                        "mode": name,
                    },
                    out,
                )
        for mode in ("weak", "strong"):
            emit(
                {
                    **common,
                    "metric": "scaling_efficiency",
                    "mode": mode,
                    "n_gpus": args.gpus,
                    "value": per_gpu[mode] / per_gpu["1"],
                    "unit": "fraction",
                    "target": 0.85 if mode == "weak" else None,
                    "better": "higher",
                },
                out,
            )


if __name__ == "__main__":
    main()
