"""`rayrl models ...`: model utilities; `rayrl models tiny` builds a tiny model (Qwen2,
or another family with ``--family``).

    rayrl models tiny --out DIR [--preset tiny|qwen2.5-0.5b] [--family qwen2|gemma2|...]
        [--layers N] [--hidden N] [--heads N] [--kv-heads N] [--intermediate N]
        [--vocab-size N] [--seed N] ...

Shape flags override the preset's fields; ``--family`` keeps the shape and builds it
with that family's transformers config (its defaults for the rest). torch and
transformers are imported only when the command runs, so `rayrl --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys

from rayrl.models.tiny_families import FAMILIES

# TinySpec integer fields a flag may override (--kv-heads sets kv_heads), with help text.
SHAPE_FLAGS = {
    "layers": "decoder layers",
    "hidden": "hidden size",
    "heads": "attention heads",
    "kv_heads": "key/value heads (grouped-query attention)",
    "intermediate": "MLP intermediate size",
    "vocab_size": "target vocabulary size of the trained tokenizer",
    "max_position": "maximum positions (and tokenizer model_max_length)",
    "seed": "seed of the random weights (same seed, identical files)",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `models` and its sub-commands to the `rayrl` parser."""
    models = subparsers.add_parser("models", help="build and inspect models")
    models.set_defaults(func=lambda args: _print_usage(models))
    sub = models.add_subparsers(dest="models_command", metavar="SUBCOMMAND")
    tiny = sub.add_parser(
        "tiny",
        help="build a tiny random-weight model (Qwen2 or --family) + tokenizer (loads offline)",
        description="Build a random-weight model (Qwen2, or the --family given) and its "
        "tokenizer in a directory that transformers loads offline.",
    )
    tiny.add_argument("--out", required=True, help="directory to create (new or empty)")
    tiny.add_argument(
        "--preset", default="tiny", help="shape to start from: tiny (default) or qwen2.5-0.5b"
    )
    tiny.add_argument(
        "--family",
        choices=sorted(FAMILIES),
        help="the transformers model_type to build (default qwen2)",
    )
    for field, text in SHAPE_FLAGS.items():
        tiny.add_argument(f"--{field.replace('_', '-')}", type=int, dest=field, help=text)
    tiny.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="weight dtype")
    tiny.add_argument(
        "--untied", action="store_true", help="separate lm_head instead of tied embeddings"
    )
    tiny.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    tiny.set_defaults(func=run_tiny)


def run_tiny(args: argparse.Namespace) -> int:
    """Build the model named by `args`; print its directory, size and shape."""
    from transformers.utils import logging as hf_logging

    from rayrl.models.tiny import count_parameters, preset

    hf_logging.disable_progress_bar()
    overrides = {f: getattr(args, f) for f in SHAPE_FLAGS if getattr(args, f) is not None}
    if args.dtype:
        overrides["dtype"] = args.dtype
    if args.untied:
        overrides["tie_embeddings"] = False
    if args.family:
        overrides["family"] = args.family
    try:
        spec = preset(args.preset, **overrides)
        path = spec.build(args.out, overwrite=args.overwrite)
    except (ValueError, FileExistsError) as err:
        print(f"rayrl models tiny: {err}", file=sys.stderr)
        return 2
    counts = count_parameters(path)
    print(path)
    print(f"parameters: {counts['total']:,} (non-embedding {counts['non_embedding']:,})")
    print(_summary(spec, path))
    return 0


def _summary(spec, path) -> str:
    import json

    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    tied = "tied" if spec.tie_embeddings else "untied"
    return (
        f"{spec.family}: {spec.layers} layers, hidden {spec.hidden}, {spec.heads} heads "
        f"({spec.kv_heads} kv), intermediate {spec.intermediate}, vocab {vocab}, "
        f"{tied}, {spec.dtype}, seed {spec.seed}"
    )


def _print_usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2
