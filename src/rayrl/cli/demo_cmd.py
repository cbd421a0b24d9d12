"""`rayrl demo`: the largest end-to-end path that works today, on a local embedded Ray.

Builds the tiny demo model (or uses `actor_rollout_ref.model.path`), starts a local
Ray, places one sampling worker per `trainer.n_gpus_per_node`, and prints what each
worker sampled for a few arithmetic prompts.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.table import Table

from rayrl.cli.common import add_config_args, load_from_args

PROMPTS = ["What is 12+7?", "What is 3*4?", "What is 20-5?", "What is 9+9?"]


def ensure_model(cfg, console: Console) -> Path:
    """The configured model directory, or the tiny demo model (built once, then reused)."""
    from rayrl.models import build_tiny_model

    if cfg.actor_rollout_ref.model.path:
        return Path(cfg.actor_rollout_ref.model.path)
    out = Path(cfg.trainer.output_dir) / "tiny-model"
    if not (out / "config.json").is_file():
        console.print(f"building the tiny demo model in {out}")
        build_tiny_model(out, layers=2, hidden=64, seed=cfg.trainer.seed, overwrite=True)
    return out


def run(args: argparse.Namespace) -> int:
    import ray

    from rayrl.cli.demo_sampler import Sampler

    console = Console()
    cfg = load_from_args(args)
    model_dir = ensure_model(cfg, console)
    workers = cfg.trainer.n_gpus_per_node
    ray.init(
        address=cfg.resources.address or "local", include_dashboard=False, log_to_driver=False
    )
    try:
        console.print(f"ray: {ray.cluster_resources().get('CPU', 0):.0f} CPUs; {workers} workers")
        actors = [Sampler.remote(str(model_dir), rank) for rank in range(workers)]
        shards = [PROMPTS[r::workers] for r in range(workers)]
        results = ray.get(
            [a.sample.remote(s, cfg.trainer.seed) for a, s in zip(actors, shards, strict=True)]
        )
    finally:
        ray.shutdown()
    table = Table(title=f"samples from {model_dir} (random weights: gibberish is expected)")
    for col in ("rank", "pid", "prompt", "response"):
        table.add_column(col)
    for rows in results:
        for row in rows:
            table.add_row(str(row["rank"]), str(row["pid"]), row["prompt"], repr(row["response"]))
    console.print(table)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("demo", help="run the end-to-end demo on a local embedded Ray")
    add_config_args(parser)
    parser.set_defaults(func=run)
