"""`rayrl config show`: print the resolved config (defaults <- file <- overrides)."""

from __future__ import annotations

import argparse

from rayrl.cli.common import add_config_args, load_from_args


def show(args: argparse.Namespace) -> int:
    from rayrl.config import to_yaml

    print(to_yaml(load_from_args(args)), end="")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("config", help="inspect configs")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    p = verbs.add_parser("show", help="print the resolved and validated config as YAML")
    add_config_args(p)
    p.set_defaults(func=show)
