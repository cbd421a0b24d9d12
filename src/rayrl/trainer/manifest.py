"""What a checkpoint holds and which run wrote it: `manifest.json` in every step directory.

The manifest lists every file of the step directory with its size and a CRC-32 of its
first and last MiB (cheap on a 100 GB checkpoint, and it catches the usual damage: a
truncated or overwritten file), and the run's *fingerprint*: what must not change
between a run and its resume (the model, every byte of its files hashed; the data
files, the batch geometry, the algorithm; each trainer says what that is). `check_files` names the first damaged
file; `fingerprint_changes` lists what differs, key by key.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any, TypeGuard, cast

from rayrl.trainer.content_digest import content_sha256

MANIFEST = "manifest.json"
EDGE_BYTES = 1 << 20  # the bytes checksummed at each end of a file


class CheckpointDamagedError(RuntimeError):
    """A checkpoint's file is missing, shorter or different from what its save wrote."""

    def __init__(self, step_dir: Path, file: str, problem: str) -> None:
        super().__init__(f"{Path(step_dir) / file}: {problem}")
        self.step_dir, self.file, self.problem = Path(step_dir), file, problem


def file_digest(path: Path) -> dict[str, int]:
    """Size and CRC-32 of the first and last `EDGE_BYTES` of a file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        crc = zlib.crc32(f.read(EDGE_BYTES))
        if size > EDGE_BYTES:
            f.seek(max(EDGE_BYTES, size - EDGE_BYTES))
            crc = zlib.crc32(f.read(EDGE_BYTES), crc)
    return {"size": size, "crc32": crc}


def write_manifest(step_dir: Path, fingerprint: dict[str, Any]) -> None:
    """List every file under `step_dir` (written last, before the directory is renamed
    into place) with the run's `fingerprint`."""
    files = {}
    for path in sorted(p for p in step_dir.rglob("*") if p.is_file()):
        files[str(path.relative_to(step_dir))] = file_digest(path)
    body = {"fingerprint": fingerprint, "files": files}
    (step_dir / MANIFEST).write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")


def read_manifest(step_dir: Path) -> dict[str, Any] | None:
    """The manifest of a step directory; None for checkpoints saved without one."""
    path = Path(step_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        return cast("dict[str, Any]", json.loads(path.read_text()))
    except ValueError as err:
        raise CheckpointDamagedError(step_dir, MANIFEST, f"not valid JSON ({err})") from None


def check_files(step_dir: Path) -> None:
    """Raise CheckpointDamagedError for the first file that is not as its save wrote it."""
    manifest = read_manifest(step_dir)
    if manifest is None:
        return
    for name, want in manifest["files"].items():
        path = Path(step_dir) / name
        if not path.is_file():
            raise CheckpointDamagedError(step_dir, name, "missing")
        got = file_digest(path)
        if got["size"] != want["size"]:
            raise CheckpointDamagedError(
                step_dir, name, f"{got['size']} bytes where the save wrote {want['size']}"
            )
        if got["crc32"] != want["crc32"]:
            raise CheckpointDamagedError(step_dir, name, "its contents changed since the save")


def fingerprint_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """`key: saved -> now` for every fingerprint key whose value differs; for a model
    directory, each file that changed, by name and by what told it apart."""
    changes = []
    for key in sorted(set(saved) | set(now)):
        old, new = saved.get(key), now.get(key)
        if _has_files(old) and _has_files(new):
            changes += [f"{key}: {change}" for change in _file_changes(old["files"], new["files"])]
        elif old != new:
            changes.append(f"{key}: {old!r} -> {new!r}")
    return changes


def _has_files(value: Any) -> TypeGuard[dict[str, Any]]:
    """A model directory is known by its files where they were read: the same model
    copied or moved elsewhere resumes; its path counts only when no files were read."""
    return isinstance(value, dict) and isinstance(value.get("files"), dict)


def _file_changes(saved: dict[str, dict[str, Any]], now: dict[str, dict[str, Any]]) -> list[str]:
    """Each file added, removed or changed. A file is compared by the digests both sides
    hold (a checkpoint saved before `sha256` was kept is compared by size and CRC)."""
    changes = []
    for name in sorted(set(saved) | set(now)):
        old, new = saved.get(name), now.get(name)
        if old is None or new is None:
            changes.append(
                f"{name}: {'absent' if old is None else 'present'} -> "
                f"{'absent' if new is None else 'present'}"
            )
            continue
        differ = [k for k in sorted(set(old) & set(new)) if old[k] != new[k]]
        changes += [f"{name}: {k} {old[k]!r} -> {new[k]!r}" for k in differ]
    return changes


def model_identity(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A model directory: where it is, and its config and weight files' sizes, a CRC of
    their ends and a SHA-256 of every byte (`rayrl.trainer.content_digest`): another
    model in the same place is told apart, weights swapped under the same config and
    size included."""
    root = Path(path)
    if not root.is_dir():
        return {"path": str(path)}
    files = {
        file.name: {**file_digest(file), "sha256": content_sha256(file)}
        for file in sorted(root.iterdir())
        if file.is_file() and file.suffix in (".json", ".safetensors", ".bin")
    }
    return {"path": str(root.resolve()), "files": files}


def data_identity(files: Any) -> list[dict[str, Any]]:
    """Data files by absolute path and size (empty: the built-in synthetic task)."""
    paths = [files] if isinstance(files, str | os.PathLike) else list(files or [])
    out = []
    for path in paths:
        p = Path(path)
        out.append({"path": str(p.resolve()), "size": p.stat().st_size if p.is_file() else None})
    return out
