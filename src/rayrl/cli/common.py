"""Argument helpers shared by commands that take a config: `-c FILE` plus dotted overrides.

Imported by every command module at `rayrl --help` time: nothing heavy at module level
(rich, the config schema, torch and Ray load inside the functions that use them).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table


def add_config_args(
    parser: argparse.ArgumentParser, builtins: str = "grpo, ppo, demo", default: str = "grpo"
) -> None:
    parser.add_argument(
        "-c",
        "--config",
        default=None,
        help=f"YAML config file or a built-in name ({builtins}); default: the demo's config "
        f"({default}) unless a model path or train files are given, then verl's defaults",
    )
    parser.add_argument(
        "--config-path",
        "-cp",
        default=None,
        help="Hydra's flag (verl scripts): the folder of --config-name's file",
    )
    parser.add_argument(
        "--config-name",
        "-cn",
        default=None,
        help="Hydra's flag (verl scripts): a config file NAME(.yaml) in --config-path",
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.seed=3")


def config_file(args: argparse.Namespace) -> str | None:
    """The config file the arguments name: `-c FILE`, or verl's Hydra flags
    `--config-path DIR --config-name NAME` (the file DIR/NAME.yaml)."""
    from pathlib import Path

    name, folder = getattr(args, "config_name", None), getattr(args, "config_path", None)
    if name is None:
        return args.config
    if args.config is not None:
        sys.exit("rayrl: give -c FILE or --config-path/--config-name, not both")
    file = Path(folder or ".") / name
    return str(file) if file.suffix in (".yaml", ".yml") else f"{file}.yaml"


def checked_config(source, overrides, warn):
    """`rayrl train`'s config for a config file (or built-in name, or None) and dotted
    overrides: loaded, validated and its registry names checked. The path every command
    that takes a config goes through (`bench/verl_compat.py` calls it too); raises
    ConfigError."""
    from rayrl.config import load_config

    cfg = load_config(source, overrides, warn=warn)
    from rayrl.trainer.names import check_names  # imports torch: after the cheap checks

    check_names(cfg)
    return cfg


def checked_sft_config(source, overrides, warn):
    """`rayrl sft`'s config, as `checked_config` (`rayrl.config.sft`)."""
    from rayrl.config.sft import load_sft_config

    cfg = load_sft_config(source, overrides, warn=warn)
    from rayrl.trainer.names import check_sft_names  # imports torch: after the cheap checks

    check_sft_names(cfg)
    return cfg


def load_from_args(args: argparse.Namespace):
    """The validated config the arguments describe, its registry names checked too.

    Keys accepted without effect print one warning line each; a ConfigError exits 2
    with its message.
    """
    from rayrl.config import ConfigError

    err = console(stderr=True)
    file = config_file(args)
    source = config_source(file, args.overrides, DEMO_TRIGGERS, "grpo")
    if source is not None and file is None:
        err.print(
            "[dim]no -c, model path or train files given: the built-in demo config 'grpo' "
            "(tiny model, synthetic task); set any of them to start from verl's defaults[/]",
            highlight=False,
        )
    try:
        return checked_config(source, args.overrides, _warner(err))
    except ConfigError as exc:
        hint = (
            "\n(no -c given: verl's defaults apply; `-c grpo` or `-c ppo` start from the "
            "small built-in configs, `rayrl demo` runs the demo)"
            if args.config is None and source is None
            else ""
        )
        _refuse(err, exc, hint)


def load_sft_from_args(args: argparse.Namespace):
    """`rayrl sft`'s validated config (`rayrl.config.sft`); with no -c, model or data,
    the built-in `demo` SFT config. Exits 2 with the message on a ConfigError."""

    from rayrl.config import ConfigError

    err = console(stderr=True)
    file = config_file(args)
    source = config_source(file, args.overrides, SFT_DEMO_TRIGGERS, "demo")
    if source is not None and file is None:
        err.print(
            "[dim]no -c, model (model.partial_pretrain) or train files given: the built-in "
            "SFT config 'demo' (tiny model, synthetic demonstrations)[/]",
            highlight=False,
        )
    try:
        return checked_sft_config(source, args.overrides, _warner(err))
    except ConfigError as exc:
        _refuse(err, exc)


def checked_pref_config(command, source, overrides, warn):
    """`rayrl rm`'s or `rayrl dpo`'s config (`rayrl.config.pref`), names checked."""
    from rayrl.config.pref import load_pref_config

    cfg = load_pref_config(command, source, overrides, warn=warn)
    from rayrl.trainer.names import check_pref_names  # imports torch: after the cheap checks

    check_pref_names(cfg)
    return cfg


def load_pref_from_args(args: argparse.Namespace, command: str):
    """`rayrl rm`'s or `rayrl dpo`'s validated config; with no -c, model or data, the
    command's built-in `demo` config. Exits 2 with the message on a ConfigError."""
    from rayrl.config import ConfigError

    err = console(stderr=True)
    file = config_file(args)
    source = config_source(file, args.overrides, PREF_DEMO_TRIGGERS, "demo")
    if source is not None and file is None:
        err.print(
            f"[dim]no -c, model (model.partial_pretrain) or train files given: the built-in "
            f"`rayrl {command}` config 'demo' (tiny model, synthetic preference pairs)[/]",
            highlight=False,
        )
    try:
        return checked_pref_config(command, source, args.overrides, _warner(err))
    except ConfigError as exc:
        _refuse(err, exc)


def _warner(err: Console):
    from rich.markup import escape

    def warn(message: str) -> None:
        err.print(f"[yellow]config warning:[/] {escape(message)}", highlight=False)

    return warn


def _refuse(err: Console, exc: Exception, hint: str = "") -> NoReturn:
    from rich.markup import escape

    err.print(f"[bold red]config error:[/] {escape(str(exc))}{escape(hint)}", highlight=False)
    sys.exit(2)


DEMO_TRIGGERS = ("actor_rollout_ref.model.path", "data.train_files")
SFT_DEMO_TRIGGERS = ("model.partial_pretrain", "model.path", "data.train_files")
PREF_DEMO_TRIGGERS = ("model.partial_pretrain", "data.train_files")


def config_source(
    config: str | None, overrides: list[str], triggers: tuple[str, ...], demo: str
) -> str | None:
    """The config a command starts from: `-c`'s; with none, the built-in `demo` config
    unless the command line names a model or training data (then verl's defaults: None)."""
    if config is None and not _names_model_or_data(overrides, triggers):
        return demo
    return config


def _names_model_or_data(overrides: list[str], triggers: tuple[str, ...] = DEMO_TRIGGERS) -> bool:
    """Whether the command line names a model or training data (then verl's defaults
    apply; otherwise a command with no -c runs the demo's config: every command that
    takes a config works with none)."""
    return any(o.split("=", 1)[0].lstrip("+") in triggers for o in overrides)


def console(stderr: bool = False) -> Console:
    """A rich console; when output goes to a file or pipe, wide enough for our tables."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else 160
    return Console(stderr=stderr, soft_wrap=True, width=width)


def plain_printer(out: Console) -> Callable[[str], None]:
    """A run's `print_fn` on `out`: its messages as they are, never read as rich markup
    (they quote error texts, paths and log lines that hold brackets, such as gloo's
    ``[/path/pair.cc:553]``, which rich would take for a closing tag and fail on)."""
    return lambda text: out.print(text, highlight=False, markup=False)


def step_table(
    history: list[dict], columns: dict[str, str], title: str, rows: int | None = None
) -> Table:
    """A table of per-step metrics: the step, then ``columns`` (metric key -> title), for
    every step or up to ``rows`` evenly spaced ones (the last included)."""
    from rich.table import Table

    table = Table(title=title)
    for name in ("step", *columns.values()):
        table.add_column(name, justify="right")
    every = max(1, -(-len(history) // rows)) if rows else 1
    for i, metrics in enumerate(history):
        if i % every and i != len(history) - 1:
            continue
        cells = ["-" if metrics.get(k) is None else f"{metrics[k]:.4g}" for k in columns]
        table.add_row(str(int(metrics["training/global_step"])), *cells)
    return table
