"""`rayrl doctor`: what the cluster has, what holds it, and whether the nodes agree.

Prints the live nodes with free/total resources and the Python, Ray, torch and
transformers versions on each (a mismatch is flagged: it breaks runs in ways that are
hard to see), then the placement groups with their owner job and state, stale ones
(detached, their job finished) flagged, then the detached rayrl pools and KV stores
with the driver that made them and the live drivers that re-attached to them.
`--cleanup` removes stale rayrl groups and detached rayrl actors of finished jobs that
no live driver re-attached to, after a confirmation (`--yes` skips it); it exits 1
while anything stale is left.

The cluster is `--address`, else the config's `resources.address` (`-c` and dotted
overrides, as for `rayrl train`), else RAY_ADDRESS; with none of them it starts a
private local Ray. It never attaches by "auto" on its own.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from rayrl.cli.common import add_config_args, load_from_args
from rayrl.cli.common import console as wide_console

if TYPE_CHECKING:  # Ray and rich load when the command runs, not at `rayrl --help`
    from rich.console import Console

    from rayrl.cluster.inspect import ClusterState

CLEANUP_WAIT_S = 10.0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `doctor` sub-command."""
    p = subparsers.add_parser("doctor", help="check nodes, versions and placement groups")
    p.add_argument(
        "--address",
        help="Ray GCS address (host:port); default: resources.address, then RAY_ADDRESS, "
        "then a private local Ray",
    )
    add_config_args(p)
    p.add_argument("--cleanup", action="store_true", help="remove stale rayrl groups and actors")
    p.add_argument("--yes", action="store_true", help="do not ask before cleaning up")
    p.add_argument(
        "--timeout", type=float, default=30.0, help="seconds to wait for each node's versions"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Entry point for the parsed `rayrl doctor` arguments; returns the exit code."""
    from rayrl.cluster.inspect import resolve_address

    configured = load_from_args(args).resources.address if args.config or args.overrides else None
    return doctor(
        resolve_address(args.address, configured),
        cleanup=args.cleanup,
        yes=args.yes,
        versions_timeout_s=args.timeout,
    )


def doctor(
    address: str | None = None,
    *,
    cleanup: bool = False,
    yes: bool = False,
    console: Console | None = None,
    confirm: Callable[[str], bool] | None = None,
    versions_timeout_s: float = 30.0,
) -> int:
    """Report on the cluster at `address` (or a fresh local one) and optionally clean up.

    Returns 0 when the nodes agree, every node answered and nothing stale is left
    (after the cleanup, when asked for); 1 otherwise. `confirm` asks the user
    (default: a prompt on a terminal, refusal elsewhere); `yes=True` skips it.
    """
    from rayrl.cluster.inspect import connect, snapshot

    console = console or wide_console()
    with connect(address) as gcs:
        state = snapshot(include_actors=True)
        healthy = report(state, gcs, console, versions_timeout_s)
        if cleanup:
            clean(state, console, yes=yes, confirm=confirm)
            state = snapshot(include_actors=True)
        left = [g.name or g.group_id for g in state.stale_groups()]
        left += [a.name or a.actor_id for a in state.stale_actors()]
        if cleanup and left:
            console.print(f"[red]Still stale after the cleanup: {', '.join(left)}.[/red]")
    return 0 if healthy and not left else 1


def report(state: ClusterState, gcs: str, console: Console, versions_timeout_s: float) -> bool:
    """Print nodes, versions and placement groups; True when nodes agree and all answered."""
    from rayrl.cluster.inspect import node_versions, version_mismatches
    from rayrl.cluster.tables import detached_table, groups_table, nodes_table, resource_names

    versions = node_versions(state, versions_timeout_s)
    mismatched = version_mismatches(versions)
    console.print(f"Ray cluster at [bold]{gcs}[/bold]: {len(state.nodes)} live node(s)")
    names = resource_names(n.total for n in state.nodes)
    names = [n for n in names if n != "object_store_memory"]
    console.print(nodes_table(state, names, versions, mismatched))
    for name, found in sorted(mismatched.items()):
        console.print(
            f"[red]MISMATCH: {name} differs between nodes ({', '.join(sorted(found))}); "
            "install the same version everywhere.[/red]"
        )
    silent = [n.short for n in state.nodes if versions.get(n.node_id) is None]
    if silent:
        console.print(
            f"[red]No answer within {versions_timeout_s:g}s from node(s) {', '.join(silent)}.[/red]"
        )
    if state.groups:
        console.print(groups_table(state.groups))
    else:
        console.print("No placement groups.")
    for g in state.stale_groups():
        hint = (
            "`rayrl doctor --cleanup`"
            if g.is_rayrl
            else "ray.util.remove_placement_group (not a rayrl group)"
        )
        console.print(
            f"[yellow]STALE: {g.name or g.group_id} of finished job {g.job_id}; remove with {hint}[/yellow]"
        )
    for a in state.stale_actors():
        console.print(
            f"[yellow]STALE: detached actor {a.name or a.actor_id} of finished job {a.job_id}[/yellow]"
        )
    detached = detached_table(state)
    if detached is not None:
        console.print(detached)
    return not mismatched and not silent


def clean(
    state: ClusterState,
    console: Console,
    *,
    yes: bool = False,
    confirm: Callable[[str], bool] | None = None,
) -> bool:
    """Remove stale rayrl groups and actors after confirmation; True when they are gone
    (groups of other tools are only reported: rayrl does not own them)."""
    from rayrl.cluster.inspect import remove_stale

    groups, actors = state.stale_groups(rayrl_only=True), state.stale_actors()
    if not groups and not actors:
        console.print("Nothing to clean up.")
        return True
    what = [f"placement group {g.name}" for g in groups] + [
        f"actor {a.name or a.actor_id}" for a in actors
    ]
    console.print("Will remove: " + ", ".join(what))
    if not yes and not (confirm or _ask)("Remove them?"):
        console.print("Left as is.")
        return False
    for line in remove_stale(state):
        console.print(line)
    return _wait_gone({g.group_id for g in groups}, {a.actor_id for a in actors}, console)


def _ask(question: str) -> bool:
    from rich.prompt import Confirm

    if not sys.stdin.isatty():
        print(f"{question} (not a terminal: pass --yes to confirm)", file=sys.stderr)
        return False
    return Confirm.ask(question, default=False)


def _wait_gone(group_ids: set[str], actor_ids: set[str], console: Console) -> bool:
    """Wait (at most CLEANUP_WAIT_S) until the GCS no longer lists the removed groups
    and the killed actors are dead (both happen asynchronously)."""
    from rayrl.cluster.inspect import snapshot

    deadline = time.monotonic() + CLEANUP_WAIT_S
    while True:
        state = snapshot()  # dead actors are left out
        left = {g.group_id for g in state.groups} & group_ids
        left |= {a.actor_id for a in state.actors} & actor_ids
        if not left:
            return True
        if time.monotonic() >= deadline:
            console.print(
                f"[red]{len(left)} group(s) or actor(s) still there after {CLEANUP_WAIT_S:g}s.[/red]"
            )
            return False
        time.sleep(0.2)
