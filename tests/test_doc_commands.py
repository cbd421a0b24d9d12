"""Every command in README.md and docs/*.md runs as it is typed.

Each fenced ```bash, ```sh or ```console block is a list of commands (a `\\` at a line's
end continues it; `# ...` after a command is a comment; in a console block only the
lines that start with `$ ` are commands). A block runs unless the line right above its
fence is one of two markers:

- `<!-- not run: REASON -->`: it cannot run on a CI machine (a GPU, several machines,
  your own model); the reason must be given;
- `<!-- covered by tests/FILE.py -->`: a `command` test runs it already; each of the
  block's commands must appear, exactly as typed, in that file's source, so the two
  cannot drift apart.

A ```text block, or one with no language, that shows commands (lines starting with
`rayrl `, `make `, `python`, `ray `, `$ `) must carry a `not run` marker with its reason.

The blocks that run, run in a temporary directory holding the files they name (GSM8K
rows, a JSONL of questions), with `rayrl` this checkout's, joining the session's local
Ray through RAY_ADDRESS (as a user's `rayrl` joins the cluster RAY_ADDRESS names), each
distinct command once. A command that exits non-zero, or prints a traceback, fails the
test with the page, the line and the command.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import start_local_ray, subprocess_pythonpath

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = ("bash", "sh", "console")
NOT_RUN = re.compile(r"^<!-- not run: (.*?) -->$")
COVERED = re.compile(r"^<!-- covered by (tests/[\w/]+\.py) -->$")
COMMANDISH = ("rayrl ", "make ", "python", "ray ", "$ ", ".venv/")


@dataclass
class Block:
    page: Path
    line: int  # the fence's line, 1-based
    lang: str
    lines: list[str]
    marker: str  # the line above the fence

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    out: list[Block] = []
    lines = page.read_text().split("\n")
    i = 0
    while i < len(lines):
        fence = re.match(r"^```(\S*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        above = lines[i - 1].strip() if i > 0 else ""
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        out.append(Block(page, i + 1, fence.group(1), lines[i + 1 : end], above))
        i = end + 1
    return out


def _strip_comment(line: str) -> str:
    """A command without its `# comment` (a # that starts a word, outside quotes)."""
    quote = None
    for k, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (k == 0 or line[k - 1].isspace()):
            return line[:k].rstrip()
    return line.rstrip()


def commands(block: Block) -> list[str]:
    out: list[str] = []
    pending = ""
    for raw in block.lines:
        line = raw
        if block.lang == "console":
            if not (line.startswith("$ ") or pending):
                continue
            line = line[2:] if line.startswith("$ ") else line
        line = _strip_comment(line)
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        command = " ".join((pending + line).split())
        pending = ""
        if command:
            out.append(command)
    return out


ALL = [b for page in PAGES for b in blocks(page)]


def test_every_block_that_does_not_run_says_why():
    problems = []
    for block in ALL:
        not_run = NOT_RUN.match(block.marker)
        if not_run and not not_run.group(1).strip():
            problems.append(f"{block.where}: a `not run` marker without its reason")
        if block.lang in RUN:
            continue
        shows = [x for x in block.lines if x.lstrip().startswith(COMMANDISH)]
        if shows and not not_run:
            problems.append(
                f"{block.where}: a ```{block.lang or '(no language)'} block shows commands "
                f"({shows[0].strip()!r}): run it (```bash) or mark it "
                "`<!-- not run: REASON -->`"
            )
    assert not problems, "\n".join(problems)


def test_covered_commands_appear_in_their_tests():
    problems = []
    for block in ALL:
        covered = COVERED.match(block.marker)
        if block.lang not in RUN or not covered:
            continue
        test = ROOT / covered.group(1)
        if not test.is_file():
            problems.append(f"{block.where}: {covered.group(1)} does not exist")
            continue
        source = test.read_text()
        if "pytest.mark.command" not in source:
            problems.append(f"{block.where}: {covered.group(1)} has no `command` tests")
        for command in commands(block):
            if command not in source:
                problems.append(f"{block.where}: {command!r} is not in {covered.group(1)}")
    assert not problems, "\n".join(problems)


GSM8K_ROWS = [
    {"question": f"Tom has {a} apples and buys {b} more. How many now?", "answer": f"#### {a + b}"}
    for a, b in ((1, 2), (3, 4), (5, 6), (7, 8))
]
QA_ROWS = [{"question": f"What is {a} + {a}?", "answer": str(2 * a)} for a in range(4)]


def _workdir(tmp: Path) -> dict[str, str]:
    """The files the docs' commands read, and an environment whose `rayrl` is this
    checkout's, joined to the session's local Ray."""
    for name in ("gsm8k_train.jsonl", "gsm8k_test.jsonl"):
        (tmp / name).write_text("".join(json.dumps(r) + "\n" for r in GSM8K_ROWS))
    (tmp / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in QA_ROWS))
    bin_dir = tmp / ".bin"
    bin_dir.mkdir()
    shim = bin_dir / "rayrl"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m rayrl.cli.main "$@"\n')
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    gcs = start_local_ray().get_runtime_context().gcs_address
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env["PYTHONPATH"] = subprocess_pythonpath(ROOT / "src")
    env["RAY_ADDRESS"] = gcs
    return env


@pytest.mark.slow
@pytest.mark.command
@pytest.mark.timeout(600)
def test_every_doc_command_runs_as_typed(tmp_path):
    env = _workdir(tmp_path)
    seen: dict[str, str] = {}
    failures = []
    for block in ALL:
        if block.lang not in RUN or NOT_RUN.match(block.marker) or COVERED.match(block.marker):
            continue
        for command in commands(block):
            if command in seen:
                continue
            done = subprocess.run(
                ["bash", "-c", command],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            seen[command] = block.where
            if done.returncode != 0 or "Traceback" in done.stderr:
                failures.append(
                    f"{block.where}: `{command}` exited {done.returncode}:\n"
                    f"{(done.stdout + done.stderr)[-1500:]}"
                )
    assert seen, "no command ran: the doc parser is broken"
    assert not failures, "\n\n".join(failures)
