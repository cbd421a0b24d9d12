"""Every leaf key of the config schema is read by the code (or waits, listed, for its
wiring): a key that nothing reads is a promise the product does not keep.

The check is by name: a leaf ``group.key`` counts as read when ``.key`` (attribute
access) or ``"key"`` appears in ``src/rayrl`` outside ``rayrl/config`` (the schema, its
validation and its loading do not count as use).
"""

from __future__ import annotations

import re
from pathlib import Path

from rayrl.config.compat import GLOBAL_MICRO_BATCH
from rayrl.config.load import all_paths
from rayrl.config.profiler import PROFILED_ROLES
from rayrl.config.schema import RayRLConfig, schema_fields
from rayrl.config.sft import SFTConfig

SRC = Path(__file__).resolve().parent.parent / "src" / "rayrl"

# Keys another piece of work is wiring right now; each must leave this set when read.
# The rollout's tensor-parallel size: the native engine takes it (tp_size, tp_group from
# rayrl.rollout.native.tp.make_tp_groups); the actor worker passes it on next.
PENDING: set[str] = set()
SFT_PENDING: set[str] = set()
# verl's deprecated global micro-batch sizes: the config layer turns them into the
# per-GPU keys (`rayrl.config.compat.micro_batch`), which the code reads.
RESOLVED_AT_LOAD = set(GLOBAL_MICRO_BATCH)
# The profiler's per-role all_ranks is read through `ProfilerConfig.traced_ranks` (the
# config's own method, which the trainer calls); profile_continuous_steps=true is refused
# at load (`rayrl.config.profiler_checks`).
RESOLVED_AT_LOAD |= {f"global_profiler.{r}.all_ranks" for r in PROFILED_ROLES}
RESOLVED_AT_LOAD |= {"global_profiler.profile_continuous_steps"}


def leaf_paths(schema: type = RayRLConfig) -> list[str]:
    groups = {p for p in all_paths(schema) if _is_group(p, schema)}
    return [p for p in all_paths(schema) if p not in groups]


def _is_group(path: str, schema: type = RayRLConfig) -> bool:
    cls: type | None = schema
    for part in path.split("."):
        cls = schema_fields(cls)[part]
        if cls is None:
            return False
    return True


def followed_keys(schema: type = RayRLConfig) -> set[str]:
    """Keys whose value other keys follow (a default written `"${.key}"`): read through
    the keys that follow them (`actor.clip_ratio` through `clip_ratio_low` / `_high`)."""
    from dataclasses import fields, is_dataclass

    found: set[str] = set()

    def walk(cls: type, prefix: str) -> None:
        for f in fields(cls):
            default = f.default_factory() if callable(f.default_factory) else f.default
            if is_dataclass(default):
                walk(type(default), f"{prefix}{f.name}.")
            elif isinstance(default, str) and default.startswith("${."):
                found.add(prefix + default[3:-1])

    walk(schema, "")
    return found


def _source_text() -> str:
    files = [f for f in SRC.rglob("*.py") if "config" not in f.relative_to(SRC).parts[:1]]
    return "\n".join(f.read_text() for f in files)


def unread_keys(paths: list[str], text: str) -> list[str]:
    """The dotted keys whose leaf name ``text`` never reads."""
    unread = []
    for path in paths:
        leaf = path.rsplit(".", 1)[-1]
        if not re.search(rf"\.{leaf}\b|[\"']{leaf}[\"']", text):
            unread.append(path)
    return unread


def test_every_schema_key_is_read_somewhere():
    exempt = PENDING | RESOLVED_AT_LOAD | followed_keys()
    unread = unread_keys([p for p in leaf_paths() if p not in exempt], _source_text())
    assert not unread, f"schema keys read nowhere in src/rayrl (wire or remove them): {unread}"


def test_every_sft_schema_key_is_read_somewhere():
    """`rayrl sft`'s schema (`rayrl.config.sft`) too."""
    unread = unread_keys([p for p in leaf_paths(SFTConfig) if p not in SFT_PENDING], _source_text())
    assert not unread, f"SFT schema keys read nowhere in src/rayrl (wire or remove them): {unread}"


def test_pending_keys_are_schema_keys():
    assert set(leaf_paths()) >= PENDING | RESOLVED_AT_LOAD | followed_keys()
    assert set(leaf_paths(SFTConfig)) >= SFT_PENDING
    assert "actor_rollout_ref.actor.clip_ratio" in followed_keys()


def test_the_check_flags_a_key_nothing_reads():
    text = _source_text()
    keys = ["actor_rollout_ref.rollout.stop_strings", "actor_rollout_ref.actor.ppo_epochs"]
    assert unread_keys(keys, text) == ["actor_rollout_ref.rollout.stop_strings"]
