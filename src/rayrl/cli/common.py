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
        help="YAML config file or a built-in name (grpo, ppo); default: the demo's config "
        "(grpo) unless a model path or train files are given, then verl's defaults",
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.seed=3")


def load_from_args(args: argparse.Namespace):
    """The validated config the arguments describe, its registry names checked too.

    Keys accepted without effect print one warning line each; a ConfigError exits 2
    with its message.
    """
    from rayrl.config import ConfigError, load_config
    from rayrl.trainer.names import check_names

    err = Console(stderr=True, soft_wrap=True)

    def warn(message: str) -> None:
        err.print(f"[yellow]config warning:[/] {message}", highlight=False)

    source = args.config
    if source is None and not _names_model_or_data(args.overrides):
        source = "grpo"
        err.print(
            "[dim]no -c, model path or train files given: the built-in demo config 'grpo' "
            "(tiny model, synthetic task); set any of them to start from verl's defaults[/]",
            highlight=False,
        )
    try:
        cfg = load_config(source, args.overrides, warn=warn)
        check_names(cfg)
        return cfg
    except ConfigError as exc:
        hint = (
            "\n(no -c given: verl's defaults apply; `-c grpo` or `-c ppo` start from the "
            "small built-in configs, `rayrl demo` runs the demo)"
            if args.config is None and source is None
            else ""
        )
        err.print(f"[bold red]config error:[/] {exc}{hint}", highlight=False)
        sys.exit(2)


DEMO_TRIGGERS = ("actor_rollout_ref.model.path", "data.train_files")


def _names_model_or_data(overrides: list[str]) -> bool:
    """Whether the command line names a model or training data (then verl's defaults
    apply; otherwise a command with no -c runs the demo's config, as DESIGN.md asks)."""
    return any(o.split("=", 1)[0].lstrip("+") in DEMO_TRIGGERS for o in overrides)


def console(stderr: bool = False) -> Console:
    """A rich console; when output goes to a file or pipe, wide enough for our tables."""
    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else 160
    return Console(stderr=stderr, soft_wrap=True, width=width)
