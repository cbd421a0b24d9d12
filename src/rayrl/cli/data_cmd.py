"""`rayrl data ...`: datasets in verl's parquet layout from local JSONL files.

    rayrl data convert IN.jsonl OUT.parquet [--prompt-key K] [--answer-key K] ...
    rayrl data gsm8k IN.jsonl OUT.parquet [--split train]

`convert` maps a column holding the question (a string, or chat messages already) and
one holding the answer to verl's columns; `gsm8k` reads GSM8K's layout (`question`,
`answer` ending in `#### N`) and adds verl's instruction suffix.
"""

from __future__ import annotations

import argparse
import sys


def run_convert(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rayrl.data.convert import convert_rows, read_jsonl

    data_source = args.data_source or Path(args.input).stem
    return _write(
        args,
        lambda rows: convert_rows(
            rows,
            prompt_key=args.prompt_key,
            answer_key=args.answer_key,
            data_source=data_source,
            ability=args.ability,
            split=args.split,
            system=args.system,
            suffix=args.suffix,
        ),
        read_jsonl,
    )


def run_gsm8k(args: argparse.Namespace) -> int:
    from rayrl.data.convert import gsm8k_rows, read_jsonl

    return _write(args, lambda rows: gsm8k_rows(rows, split=args.split), read_jsonl)


def _write(args: argparse.Namespace, fn, read) -> int:
    from rayrl.data import write_parquet

    try:
        rows = fn(read(args.input))
    except (FileNotFoundError, ValueError, KeyError) as err:
        print(f"rayrl data {args.verb}: {err}", file=sys.stderr)
        return 2
    write_parquet(rows, args.output)
    print(f"{len(rows)} rows -> {args.output}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("data", help="make verl-layout parquet datasets")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    c = verbs.add_parser("convert", help="JSONL with any column names -> verl's columns")
    c.add_argument("input")
    c.add_argument("output")
    c.add_argument("--prompt-key", default="prompt", help="column with the question or messages")
    c.add_argument("--answer-key", default="answer", help="column with the ground truth")
    c.add_argument(
        "--data-source",
        default=None,
        help="data_source (picks the reward scorer); default: the input file's name",
    )
    c.add_argument("--ability", default="general")
    c.add_argument("--split", default="train")
    c.add_argument("--system", default=None, help="a system message to put first")
    c.add_argument("--suffix", default="", help="text appended to each question")
    c.set_defaults(func=run_convert)
    g = verbs.add_parser(
        "gsm8k", help="GSM8K's JSONL (question, answer '... #### N') -> verl's columns"
    )
    g.add_argument("input")
    g.add_argument("output")
    g.add_argument("--split", default="train")
    g.set_defaults(func=run_gsm8k)
