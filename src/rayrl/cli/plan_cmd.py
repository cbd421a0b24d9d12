"""`rayrl plan`: the pools a config needs, where they would go, and whether they fit.

Connects to `--address`, else `resources.address`, else RAY_ADDRESS, or starts a
private local Ray, and prints pools, bundles, per-node placement, the CPU budget and
the verdict without reserving anything. Exit code 0 when it fits now, 1 when resources
are held or it waits for an autoscaler to add nodes, 2 when it can never fit.
"""

from __future__ import annotations

import argparse

from rayrl.cli.common import add_config_args, console, load_from_args

EXIT = {"fits": 0, "busy": 1, "scale": 1, "never": 2}


def plan(args: argparse.Namespace) -> int:
    from rayrl.cluster.guard import assess, render_plan
    from rayrl.cluster.inspect import connect, resolve_address, snapshot
    from rayrl.trainer.resources import node_cpus, pools_from_config, resolve_device

    cfg = load_from_args(args)
    out = console()
    with connect(resolve_address(args.address, cfg.resources.address)) as address:
        state = snapshot()
        gpus = sum(node.get("GPU", 0.0) for node in state.totals.values())
        device = resolve_device(cfg, gpus)
        pools = pools_from_config(cfg, device, node_cpus(state.totals, device))
        out.print(f"cluster {address}: {len(state.nodes)} node(s); device {device}")
        out.print(render_plan(pools, state))
        return EXIT[assess(pools, state).status]


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("plan", help="show the pools a config needs and whether they fit")
    add_config_args(parser)
    parser.add_argument(
        "--address",
        default=None,
        help="Ray address; default: resources.address, then RAY_ADDRESS, then a local Ray",
    )
    parser.set_defaults(func=plan)
