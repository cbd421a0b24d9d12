"""Entry point of the `rayrl` console script.

Each sub-command is a module in `rayrl.cli` exposing `register(subparsers)`, which
adds its parser and sets `func` (called with the parsed namespace, returning an exit
code). Modules are listed in COMMANDS and imported lazily, so `rayrl --help` does not
pay for torch or Ray.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = [
    "config_cmd",
    "models_cmd",
    "demo_cmd",
    "doctor_cmd",
    "plan_cmd",
    "train_cmd",
    "sft_cmd",
    "pref_cmd",
    "export_cmd",
    "report_cmd",
    "data_cmd",
]


def build_parser() -> argparse.ArgumentParser:
    import rayrl

    parser = argparse.ArgumentParser(prog="rayrl", description=rayrl.__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"rayrl.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
