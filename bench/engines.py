"""Benchmark: training-engine log-prob throughput, packed sequences versus padded rows.

Builds a small random-weight Qwen2 (4 layers, hidden 256, vocabulary 4096 by default;
``--preset qwen2.5-0.5b`` for the reference shape) and, for each shape, a batch in
verl's layout (left-padded prompts, right-padded responses), then times
`TrainEngine.forward` on the same engine and batch with `use_remove_padding` on and
off, interleaved after a warm-up. Shapes (``--shapes``, ``ROWSxPROMPT+RESPONSE``, a
``full`` suffix for rows without padding): the default ragged batch where about half
of the tokens are padding, 8 ragged rows of 512+512, and 8 full rows of 1024 (packing
saves nothing there; it must not cost either). Throughput counts real tokens only.
Prints one JSON object per line per shape: both throughputs, the padding fraction and
`packed_vs_padded_speedup` (the median of per-repeat ratios, so load drifting on a
shared machine cancels out).

    python bench/engines.py [--device cpu|cuda] [--preset tiny|qwen2.5-0.5b]
                            [--shapes 32x128+128,8x512+512,8x512+512full]
                            [--micro-batch-size 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time

import torch

from _common import hardware
from rayrl.batch import Batch
from rayrl.models.tiny import TinySpec, reference_05b
from rayrl.train.engine import TrainEngine


def ragged_batch(
    rows: int, prompt_len: int, response_len: int, vocab: int, full: bool = False
) -> Batch:
    """Rows whose real lengths spread evenly over [2, width - 2] (about half padding),
    or with ``full`` rows of exactly prompt_len + response_len real tokens."""
    width = prompt_len + response_len
    gen = torch.Generator().manual_seed(0)
    ids = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.long)
    for i in range(rows):
        total = width if full else round(2 + (width - 4) * (i + 0.5) / rows)
        p = min(prompt_len, max(1, (total + 1) // 2))
        r = min(response_len, total - p)
        ids[i, prompt_len - p : prompt_len + r] = torch.randint(3, vocab, (p + r,), generator=gen)
        mask[i, prompt_len - p : prompt_len + r] = 1
    order = torch.randperm(rows, generator=gen)  # mix long and short rows in micro-batches
    ids, mask = ids[order], mask[order]
    return Batch.from_dict(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, prompt_len:],
        }
    )


def time_forward(engine: TrainEngine, batch: Batch, packed: bool, micro: int) -> float:
    """Seconds for one no-grad forward of the whole batch (results come back to CPU)."""
    engine.use_remove_padding = packed
    start = time.perf_counter()
    engine.forward(batch, micro_batch_size=micro)
    return time.perf_counter() - start


def parse_shape(text: str) -> tuple[int, int, int, bool]:
    """``"8x512+512full"`` -> (rows 8, prompt 512, response 512, full rows)."""
    full = text.endswith("full")
    rows, lengths = text.removesuffix("full").split("x")
    prompt, response = lengths.split("+")
    return int(rows), int(prompt), int(response), full


def build_engine(args: argparse.Namespace, max_len: int) -> TrainEngine:
    if args.model_dir and os.path.isfile(os.path.join(args.model_dir, "config.json")):
        return TrainEngine(args.model_dir, device=args.device, attn_implementation=args.attn)
    if args.preset == "qwen2.5-0.5b":
        spec = reference_05b(max_position=max(max_len, 2048))
    else:
        spec = TinySpec(
            layers=args.layers,
            hidden=args.hidden,
            heads=args.heads,
            kv_heads=args.kv_heads,
            intermediate=args.intermediate,
            vocab_size=args.vocab,
            max_position=max_len,
        )
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = spec.build(os.path.join(tmp, "model"))
        return TrainEngine(model_dir, device=args.device, attn_implementation=args.attn)


def run_shape(args, engine: TrainEngine, shape: str) -> list[dict]:
    rows, prompt_len, response_len, full = parse_shape(shape)
    vocab = engine.config.vocab_size
    batch = ragged_batch(rows, prompt_len, response_len, vocab, full)
    real_tokens = int(batch["attention_mask"].sum())
    padding = 1 - real_tokens / batch["attention_mask"].numel()
    for _ in range(args.warmup):
        time_forward(engine, batch, True, args.micro_batch_size)
        time_forward(engine, batch, False, args.micro_batch_size)
    packed_s, padded_s = [], []
    for i in range(args.repeats):
        for packed in (True, False) if i % 2 == 0 else (False, True):
            seconds = time_forward(engine, batch, packed, args.micro_batch_size)
            (packed_s if packed else padded_s).append(seconds)
    speedup = statistics.median(d / p for p, d in zip(packed_s, padded_s, strict=True))
    cfg = engine.config
    common = {
        "bench": "engines",
        "device": args.device,
        "model": f"qwen2 {cfg.num_hidden_layers}L h{cfg.hidden_size} "
        f"i{cfg.intermediate_size} v{vocab}",
        "attn": engine.model.config._attn_implementation,
        "shape": shape,
        "rows": rows,
        "width": prompt_len + response_len,
        "micro_batch_size": args.micro_batch_size,
        "repeats": args.repeats,
        "hardware": hardware(args.device),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    return [
        {**common, "metric": "padding_fraction", "value": round(padding, 3), "unit": "fraction"},
        {
            **common,
            "metric": "logprob_tokens_per_s_packed",
            "value": round(real_tokens / statistics.median(packed_s), 1),
            "unit": "tokens/s",
        },
        {
            **common,
            "metric": "logprob_tokens_per_s_padded",
            "value": round(real_tokens / statistics.median(padded_s), 1),
            "unit": "tokens/s",
        },
        {
            **common,
            "metric": "packed_vs_padded_speedup",
            "value": round(speedup, 3),
            "unit": "x",
            "target": 1.0 if full else 1.5,
            "better": "higher",
        },
    ]


def run(args: argparse.Namespace) -> list[dict]:
    shapes = [s for s in args.shapes.split(",") if s]
    max_len = max(p + r for _, p, r, _ in map(parse_shape, shapes))
    engine = build_engine(args, max_len)
    return [line for shape in shapes for line in run_shape(args, engine, shape)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--preset", default="tiny", choices=["tiny", "qwen2.5-0.5b"])
    parser.add_argument("--model-dir", default=None, help="an existing model to load instead")
    parser.add_argument(
        "--shapes",
        default="32x128+128,8x512+512,8x512+512full",
        help="comma-separated ROWSxPROMPT+RESPONSE, 'full' suffix: no padding",
    )
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--attn", default="sdpa", help="transformers attn_implementation")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible to torch.")
    for line in run(args):
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
