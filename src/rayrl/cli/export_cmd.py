"""`rayrl export CHECKPOINT_DIR OUT_DIR`: a Hugging Face model directory from a checkpoint.

Reads the actor's weights from the sharded checkpoint (no Ray, no GPU needed), merges
LoRA adapters, and writes config, weights (in the training dtype unless `--dtype`),
generation config and tokenizer, loadable with `AutoModelForCausalLM.from_pretrained`.
"""

from __future__ import annotations

import argparse
import sys


def run(args: argparse.Namespace) -> int:
    from rayrl.train.hf_export import export_checkpoint

    try:
        out = export_checkpoint(args.checkpoint, args.out, dtype=args.dtype)
    except (FileNotFoundError, ValueError) as err:
        print(f"rayrl export: {err}", file=sys.stderr)
        return 2
    print(out)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a Hugging Face model directory from a checkpoint")
    p.add_argument(
        "checkpoint", help="a checkpoint directory (OUTPUT_DIR/checkpoints/global_step_N)"
    )
    p.add_argument("out", help="the directory to write (replaced if it exists)")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="weight dtype (default: the dtype the model was trained in)",
    )
    p.set_defaults(func=run)
