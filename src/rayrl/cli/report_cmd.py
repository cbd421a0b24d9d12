"""`rayrl report RUN_DIR`: PNG plots of a run's metrics and report.html with its config."""

from __future__ import annotations

import argparse
import sys


def run(args: argparse.Namespace) -> int:
    from rayrl.trainer.report import write_report

    try:
        page = write_report(args.run_dir)
    except FileNotFoundError as err:
        print(f"rayrl report: {err}", file=sys.stderr)
        return 2
    print(page)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="plot a run's metrics into RUN_DIR/report/")
    p.add_argument("run_dir", help="a run directory (trainer.output_dir of a run)")
    p.set_defaults(func=run)
