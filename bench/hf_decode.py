"""Benchmark: the HF rollout engine's lean decode loop against ``generate()`` on CPU (issue 15).

The demo's batch on the demo's tiny model (`build_tiny_model(layers=2, hidden=64)`): 8
arithmetic prompts from the demo's task, chat-templated and left-padded, 4 samples each,
32 new tokens at temperature 1 (EOS ignored, so every call decodes the same 32 steps).
Engines, one model object, interleaved each round: ``lean`` (HFRolloutEngine, dynamic
cache, `rayrl.rollout.hf.decode.lean_decode`), ``generate`` (the same engine with
``decode="generate"``), and ``native`` (NativeRolloutEngine on CPU, its own weight copy).
Every engine draws the same tokens (checked). JSON lines: per engine the median seconds
per ``generate`` call, and ``lean_ratio_vs_generate`` / ``native_ratio_vs_generate``
(median of per-round ratios, lower is better).

``--sweep``: instead, the lean loop on 1 and on 2 torch threads (the one-thread rule of
`rayrl.rollout.hf.decode.decode_threads` switched off), alternated, on three model sizes (107k, 2.5M,
24M parameters): ``decode_s`` per size and thread count, ``one_thread_ratio`` per size.

    python bench/hf_decode.py [--rounds 30] [--threads 1] [--sweep] [--out FILE]
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

import numpy as np
import torch

from _common import hardware

BENCH = "hf_decode"
PROMPTS, SAMPLES, NEW_TOKENS = 8, 4, 32


SWEEP = ((64, 2, 4, 128), (256, 4, 4, 512), (512, 8, 8, 1536))  # hidden, layers, heads, ffn


def build(workdir: Path, shape: tuple[int, int, int, int] | None = None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rayrl.batch import Batch
    from rayrl.config import load_config
    from rayrl.data import synthetic_rows
    from rayrl.models import build_tiny_model

    cfg = load_config("grpo", [])
    hidden, layers, heads, ffn = shape or (64, 2, 4, 128)
    path = build_tiny_model(
        workdir / "model",
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=2,
        intermediate=ffn,
        seed=cfg.trainer.seed,
    )
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rows = synthetic_rows(cfg.data.synthetic_task, PROMPTS, cfg.trainer.seed)
    texts = [
        tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
        for r in rows
    ]
    enc = tok(texts, return_tensors="pt", padding=True, padding_side="left")
    uids = np.array([f"p{i}" for i in range(PROMPTS)], dtype=object)
    batch = Batch(
        {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]},
        {"uid": uids},
        {"step": 3},
    )
    return model, tok, batch


def engines(model, tok) -> dict:
    from rayrl.rollout import HFRolloutEngine, NativeRolloutEngine

    return {
        "lean": HFRolloutEngine(model=model, tokenizer=tok, cache="dynamic"),
        "generate": HFRolloutEngine(model=model, tokenizer=tok, cache="dynamic", decode="generate"),
        "native": NativeRolloutEngine(
            model=model, tokenizer=tok, device="cpu", dtype=torch.float32, max_model_len=256
        ),
    }


def sweep(rounds: int, common: dict) -> list[dict]:
    """The lean loop on 1 vs 2 threads per model size (module docstring)."""
    from rayrl.rollout import HFRolloutEngine, SamplingParams
    from rayrl.rollout.hf import decode as hf_decode

    hf_decode.SINGLE_THREAD_DECODE_PARAMS = 0  # the rule off: the threads given are used
    params = SamplingParams(n=SAMPLES, max_new_tokens=NEW_TOKENS, seed=1, ignore_eos=True)
    lines = []
    for shape in SWEEP:
        with tempfile.TemporaryDirectory() as tmp:
            model, tok, batch = build(Path(tmp), shape)
        engine = HFRolloutEngine(model=model, tokenizer=tok, cache="dynamic")
        size = sum(p.numel() for p in model.parameters())
        times = {1: [], 2: []}
        for round_ in range(rounds + 1):
            for threads in (1, 2) if round_ % 2 else (2, 1):
                torch.set_num_threads(threads)
                start = time.perf_counter()
                engine.generate(batch, params)
                if round_:  # round 0 warms up
                    times[threads].append(time.perf_counter() - start)
        for threads, ts in times.items():
            lines.append(
                {
                    **common,
                    "metric": "decode_s",
                    "params": size,
                    "threads": threads,
                    "value": statistics.median(ts),
                    "unit": "s",
                    "better": "lower",
                }
            )
        ratios = [a / b for a, b in zip(times[1], times[2], strict=True)]
        lines.append(
            {
                **common,
                "metric": "one_thread_ratio",
                "params": size,
                "value": statistics.median(ratios),
                "unit": "ratio",
            }
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sweep", action="store_true", help="1 vs 2 threads, three sizes")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from rayrl.rollout import SamplingParams

    if args.sweep:
        common = {
            "bench": BENCH,
            "hardware": hardware(),
            "date": datetime.date.today().isoformat(),
            "load_avg_1m_start": os.getloadavg()[0],
        }
        emit(sweep(args.rounds, common), args.out)
        return

    with tempfile.TemporaryDirectory() as tmp:
        model, tok, batch = build(Path(tmp))
        runs = engines(model, tok)
    params = SamplingParams(n=SAMPLES, max_new_tokens=NEW_TOKENS, seed=1, ignore_eos=True)
    first = {name: engine.generate(batch, params) for name, engine in runs.items()}
    for name, out in first.items():
        assert torch.equal(out["responses"], first["generate"]["responses"]), name
    times = {name: [] for name in runs}
    load_start = os.getloadavg()[0]
    for round_ in range(args.rounds):
        order = list(runs) if round_ % 2 == 0 else list(reversed(runs))
        for name in order:
            start = time.perf_counter()
            runs[name].generate(batch, params)
            times[name].append(time.perf_counter() - start)
    common = {
        "bench": BENCH,
        "hardware": hardware(),
        "threads": args.threads,
        "date": datetime.date.today().isoformat(),
        "load_avg_1m_start": load_start,
        "load_avg_1m_end": os.getloadavg()[0],
    }
    lines = [
        {
            **common,
            "metric": "generate_s",
            "engine": name,
            "value": statistics.median(ts),
            "unit": "s",
            "better": "lower",
        }
        for name, ts in times.items()
    ]
    for name in ("lean", "native"):
        ratios = [a / b for a, b in zip(times[name], times["generate"], strict=True)]
        lines.append(
            {
                **common,
                "metric": f"{name}_ratio_vs_generate",
                "value": statistics.median(ratios),
                "unit": "ratio",
                "better": "lower",
            }
        )
    emit(lines, args.out)


def emit(lines: list[dict], out: str | None) -> None:
    for line in lines:
        print(json.dumps(line))
    if out:
        with open(out, "a") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)


if __name__ == "__main__":
    main()
