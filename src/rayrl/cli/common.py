"""Argument helpers shared by commands that take a config: `-c FILE` plus dotted overrides."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-c",
        "--config",
        default=None,
        help="YAML config file or a built-in name (grpo, ppo); default: the demo's config",
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.seed=3")


def load_from_args(args: argparse.Namespace):
    """The validated config the arguments describe; a ConfigError exits with its message."""
    from rayrl.config import ConfigError, load_config

    try:
        return load_config(args.config, args.overrides)
    except ConfigError as exc:
        Console(stderr=True, soft_wrap=True).print(
            f"[bold red]config error:[/] {exc}", highlight=False
        )
        sys.exit(2)


def console(stderr: bool = False) -> Console:
    """A rich console; when output goes to a file or pipe, wide enough for our tables."""
    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else 160
    return Console(stderr=stderr, soft_wrap=True, width=width)
