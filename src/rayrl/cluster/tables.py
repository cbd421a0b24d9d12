"""Rich tables of cluster state (nodes, placement groups) and plain-text rendering.

Shared by the ResourceGuard's error messages and `rayrl doctor`, so a failing run and
the doctor describe the cluster in the same words.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from rayrl.cluster.inspect import ActorInfo, ClusterState, GroupInfo, short_id
from rayrl.cluster.spec import format_amount

DEFAULT_RESOURCES = ("GPU", "CPU", "memory")


def render_text(*renderables: object, width: int = 140) -> str:
    """Render rich objects to plain text (no colour), e.g. for exception messages."""
    buf = io.StringIO()
    console = Console(file=buf, width=width, no_color=True, color_system=None, highlight=False)
    for item in renderables:
        console.print(item)
    return buf.getvalue().rstrip()


def resource_names(shapes: Iterable[dict[str, float]]) -> list[str]:
    """GPU, CPU and memory first, then any other resource the shapes name."""
    names = list(DEFAULT_RESOURCES)
    for shape in shapes:
        for k in shape:
            if k not in names:
                names.append(k)
    return names


def nodes_table(
    state: ClusterState,
    resources: Sequence[str] = DEFAULT_RESOURCES,
    versions: dict[str, dict[str, str] | None] | None = None,
    mismatched: Iterable[str] = (),
) -> Table:
    """One row per live node: free / total of each resource, and versions if given."""
    table = Table(title="Nodes (free / total)", title_justify="left")
    table.add_column("node")
    table.add_column("address")
    for name in resources:
        table.add_column(name, justify="right")
    version_keys = sorted({k for v in (versions or {}).values() for k in (v or {})})
    for key in version_keys:
        table.add_column(key)
    mismatched = set(mismatched)
    for node in state.nodes:
        label = node.short + (" (head)" if node.is_head else "")
        cells = [label, node.address]
        for name in resources:
            free = format_amount(name, node.free.get(name, 0.0))
            total = format_amount(name, node.total.get(name, 0.0))
            cells.append(f"{free} / {total}")
        if versions is not None:
            found = versions.get(node.node_id)
            for key in version_keys:
                if found is None:
                    cells.append("[red]no answer[/red]")
                    continue
                value = found.get(key, "?")
                cells.append(f"[red]{value} (MISMATCH)[/red]" if key in mismatched else value)
        table.add_row(*cells)
    return table


def groups_table(groups: Sequence[GroupInfo], title: str = "Placement groups") -> Table:
    """One row per placement group: name, owner job, state, detached, stale, holdings."""
    table = Table(title=title, title_justify="left")
    for col in ("placement group", "job", "state", "strategy", "detached", "stale", "holds"):
        table.add_column(col)
    for g in groups:
        stale = "[red]STALE (job finished)[/red]" if g.stale else "no"
        job = f"{g.job_id} ({'finished' if g.job_dead else 'running'})"
        table.add_row(
            escape(g.name) if g.name else f"(unnamed {g.group_id[:8]})",
            job,
            g.state,
            g.strategy,
            "yes" if g.detached else "no",
            stale,
            holdings_text(g),
        )
    return table


def holdings_text(group: GroupInfo) -> str:
    """What a group reserves on each node, e.g. 'GPU 4, CPU 2 on 1a2b3c4d'."""
    parts = []
    for node, held in sorted(group.held_per_node().items()):
        shape = ", ".join(f"{k} {format_amount(k, v)}" for k, v in sorted(held.items()) if v)
        parts.append(f"{shape} on {short_id(node)}")
    return "; ".join(parts) or "nothing placed yet"


def holder_line(group: GroupInfo) -> str:
    """A one-line description of a group for log messages."""
    flags = ["detached" if group.detached else "job-scoped"]
    if group.stale:
        flags.append("STALE: its job finished; `rayrl doctor --cleanup` removes it")
    return (
        f"{group.name or group.group_id} (job {group.job_id}, {group.state}, "
        f"{', '.join(flags)}) holds {holdings_text(group)}"
    )


def loose_holders_table(state: ClusterState) -> Table | None:
    """Actors outside placement groups, and what tasks hold, per node; None if nothing."""
    actors = state.loose_actors()
    others = state.other_holders()
    if not actors and not others:
        return None
    table = Table(title="Holders outside placement groups", title_justify="left")
    for col in ("holder", "job", "node", "holds"):
        table.add_column(col)
    for a in actors:
        label = f"actor {escape(a.name) if a.name else a.actor_id[:12]} ({a.class_name})"
        table.add_row(label, a.job_id, short_id(a.node_id), _held(a.resources))
    for node, held in sorted(others.items()):
        table.add_row("tasks and others the GCS does not name", "?", short_id(node), _held(held))
    return table


def _held(held: dict[str, float]) -> str:
    return ", ".join(f"{k} {format_amount(k, v)}" for k, v in sorted(held.items()) if v)


def detached_table(state: ClusterState) -> Table | None:
    """Detached rayrl pools and KV stores: run, who made them, who uses them now."""
    groups, actors = state.detached_rayrl()
    if not groups and not actors:
        return None
    table = Table(title="Detached rayrl resources", title_justify="left")
    for col in ("run", "what", "made by job", "used by live job(s)", "stale"):
        table.add_column(col)
    pools: dict[tuple[str, str], list[GroupInfo]] = {}
    for g in groups:
        pools.setdefault((g.run, g.name.rsplit("/", 1)[0]), []).append(g)
    rows: list[tuple[str, str, GroupInfo | ActorInfo]] = [
        (run, f"pool {escape(name)} ({sum(len(g.bundles) for g in gs)} bundles)", gs[0])
        for (run, name), gs in sorted(pools.items())
    ]
    rows += [(a.run, f"actor {escape(a.name)} ({a.class_name})", a) for a in actors]
    for run, what, item in rows:
        users = state.attached.get(run, [])
        stale = item.job_dead and not users
        table.add_row(
            run or "?",
            what,
            f"{item.job_id} ({'finished' if item.job_dead else 'running'})",
            ", ".join(users) or "-",
            "[red]STALE[/red]" if stale else "no",
        )
    return table
