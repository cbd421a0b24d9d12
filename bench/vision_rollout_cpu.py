"""Benchmark: the vision demo's rollout on a CPU, the hf engine against the native one.

`rayrl demo --task vision`'s RL stage generates, per step, 16 prompts of the synthetic
`colors` task (one image each) x 8 samples of at most 4 tokens at temperature 1, and
validates greedily on 128 held-out prompts (`rayrl/config/demo_vision.yaml`). Both
engines run those calls on the demo's tiny Qwen2.5-VL (`rayrl.models.tiny_vision`,
float32), in one process, alternating, the same seed and prompts each time; the
samples are the same tokens (checked). Ratios only: the 2-core machines are shared.
``--threads 1`` runs as a Ray worker of one CPU does (the rollout worker of the demo);
the native engine's many small CPU ops suffer most from threads that contend.

    python bench/vision_rollout_cpu.py [--repeats 5] [--threads N] [--out FILE.jsonl]

Prints JSON lines: per engine and call, the median ``seconds``; then
``native_speedup`` (hf's median over native's) per call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForImageTextToText, AutoTokenizer

from rayrl.data import PromptDataset
from rayrl.data.synthetic_images import image_rows
from rayrl.data.vision import load_vision_processor
from rayrl.models.tiny_vision import build_tiny_vision_model
from rayrl.rollout.hf.engine import HFRolloutEngine
from rayrl.rollout.native.engine import NativeRolloutEngine
from rayrl.rollout.sampling import SamplingParams

CALLS = {  # call -> (prompts, sampling)
    "train_step": (16, SamplingParams(n=8, temperature=1.0, max_new_tokens=4, seed=1)),
    "validation": (128, SamplingParams(n=1, temperature=0.0, do_sample=False, max_new_tokens=4)),
}


def _batch(model_dir: Path, size: int):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vision = load_vision_processor(model_dir, tokenizer, backend="pil")
    rows = image_rows("colors", size, seed=0)
    batch = PromptDataset(rows, tokenizer, max_prompt_length=64, vision=vision).collate(
        list(range(size))
    )
    batch.meta["step"] = 0
    return batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: its default)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_vision_model(Path(tmp) / "tiny")
        model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        engines = {
            "hf": HFRolloutEngine(model=model, tokenizer=tokenizer),
            "native": NativeRolloutEngine(model_path=str(model_dir), max_model_len=128),
        }
        lines = []
        for call, (size, sampling) in CALLS.items():
            batch = _batch(model_dir, size)
            times: dict[str, list[float]] = {name: [] for name in engines}
            outs = {}
            for _ in range(args.repeats):
                for name, engine in engines.items():
                    start = time.perf_counter()
                    with torch.inference_mode():
                        outs[name] = engine.generate(batch, sampling)
                    times[name].append(time.perf_counter() - start)
            same = torch.equal(outs["hf"]["responses"], outs["native"]["responses"])
            medians = {name: statistics.median(t) for name, t in times.items()}
            for name, seconds in medians.items():
                lines.append(
                    {
                        "bench": "vision_rollout_cpu",
                        "metric": f"{call}/{name}/seconds",
                        "value": round(seconds, 4),
                        "unit": "s",
                        "same_tokens": same,
                    }
                )
            lines.append(
                {
                    "bench": "vision_rollout_cpu",
                    "metric": f"{call}/native_speedup",
                    "value": round(medians["hf"] / medians["native"], 2),
                    "unit": "x",
                    "better": "higher",
                    "threads": torch.get_num_threads(),
                }
            )
    for line in lines:
        print(json.dumps(line))
    if args.out is not None:
        args.out.write_text("".join(json.dumps(line) + "\n" for line in lines))


if __name__ == "__main__":
    main()
