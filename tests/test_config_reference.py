"""docs/config-reference.md is generated from the schema (scripts/config_reference.py):
it must be what the generator writes today, and it must hold every key of `rayrl
train`'s, `rayrl sft`'s and `rayrl rm` / `rayrl dpo`'s schemas."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from rayrl.config.load import all_paths
from rayrl.config.pref import PrefConfig
from rayrl.config.schema import RayRLConfig, schema_fields
from rayrl.config.sft import SFTConfig

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "config-reference.md"


def _generator():
    spec = importlib.util.spec_from_file_location(
        "config_reference", ROOT / "scripts" / "config_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _leaves(cls: type) -> list[str]:
    """Every dotted key of a schema that is not a group."""
    out = []
    for path in all_paths(cls):
        node: type | None = cls
        for part in path.split("."):
            node = schema_fields(node)[part]
        if node is None:
            out.append(path)
    return out


def test_the_config_reference_is_what_the_schema_generates():
    generator = _generator()
    text, _ = generator.render()
    assert PAGE.is_file(), f"{PAGE} is missing: run `{generator.COMMAND}`"
    assert PAGE.read_text() == text, (
        f"docs/config-reference.md differs from the schema: run `{generator.COMMAND}` "
        "and commit the page"
    )


def test_the_config_reference_names_every_schema_key():
    page = PAGE.read_text()
    train, rest = page.split("\n## `rayrl sft`\n")
    sft, pref = rest.split("\n## `rayrl rm` and `rayrl dpo`\n")
    for name, part, cls in (
        ("rayrl train", train, RayRLConfig),
        ("rayrl sft", sft, SFTConfig),
        ("rayrl rm / dpo", pref, PrefConfig),
    ):
        rows = set(re.findall(r"^\| `([^`]+)` \|", part, flags=re.M))
        missing = [key for key in _leaves(cls) if key not in rows]
        assert not missing, f"{name} keys missing from docs/config-reference.md: {missing}"
        empty = [
            key
            for key in _leaves(cls)
            if re.search(r"^\| `" + re.escape(key) + r"` \|.*\|\s*\|$", part, flags=re.M)
        ]
        assert not empty, (
            f"{name} keys without a description: {empty}; give the field a comment in "
            "the schema (or an entry in NOTES, scripts/config_reference.py)"
        )
