"""How many of verl's launch scripts rayrl takes as they are (issue 28).

Reads every `*.sh` under the given directories, expands each as bash would
(`shell_words`: variables with defaults, `$((...))`, quotes, line continuations,
multi-line values, `$HOME`, a one-node SLURM job's variables, and for a script that
stops on too few arguments the two verl's SFT scripts ask for, `8 /tmp/verl_compat/save`;
nothing is run), finds the commands that start verl's
`main_ppo` or its SFT trainers (`fsdp_sft_trainer`, `sft_trainer`) and loads their
`key=value` arguments through the same function as `rayrl config show` and `rayrl
train` (`rayrl.cli.common.checked_config`; `checked_sft_config` for SFT), in process.

Prints JSON lines: one per command found (`script`, `kind`, `backend`, `accepted`,
`reason`, `warnings`), then per kind `accepted / total` (`metric`
`accepted_ratio/<kind>`, with the target of the issue where it sets one), then the
refusal reasons ranked by how many commands they stop (`metric` `refusals`). A kind is
`main_ppo/fsdp`, `main_ppo/megatron` (a Megatron config name, strategy or
`*.megatron.*` key) or `sft`.

    python bench/verl_compat.py DIR [DIR ...] [--home /home/user]

A command that names a verl config file (`--config-path`, `--config-name`) is loaded
with that file as `-c FILE` (its Hydra `defaults: [ppo_trainer, _self_]` are rayrl's
defaults); the file is looked up in the exported repository. Export the scripts and
config files of a repository first, e.g. `git --git-dir=MIRROR archive HEAD $(git
--git-dir=MIRROR ls-tree -r --name-only HEAD | grep -E '[.](sh|yaml)$') | tar -x -C DIR`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import warnings
from collections import Counter
from pathlib import Path

from shell_words import script_commands

BENCH = "verl_compat"
MODULES = {
    "verl.trainer.main_ppo": "main_ppo",
    "verl.trainer.fsdp_sft_trainer": "sft",
    "verl.trainer.sft_trainer": "sft",
}
TARGETS = {"main_ppo/fsdp": 0.9, "sft": 1.0}
HYDRA_FLAGS = ("--config-path", "--config-name", "-cp", "-cn", "--config-dir", "-cd")


# What the scripts find in their environment on a one-node job of 8 GPUs (SLURM sets
# the first two; `$1 $2` are what verl's SFT scripts ask for: GPUs and a save path).
ENV = {"SLURM_JOB_NUM_NODES": "1", "SLURM_GPUS_PER_NODE": "8", "PWD": "/workspace", "USER": "user"}
ARGS = ["8", "/tmp/verl_compat/save"]  # given one by one to a script that asks for them


def trainer_commands(path: Path, home: str) -> list[tuple[str, list[str]]]:
    """(module kind, the words after `-m MODULE`) for each trainer command of a script."""
    text = path.read_text(errors="replace")
    for k in range(len(ARGS) + 1):  # a script that exits on too few arguments gets more
        args = ARGS[:k]
        found = []
        for words in script_commands(text, {**ENV, "HOME": home}, str(path), args):
            for i, word in enumerate(words[:-1]):
                if word == "-m" and words[i + 1] in MODULES:
                    found.append((MODULES[words[i + 1]], words[i + 2 :]))
                    break
        if found:
            return found
    return []


def split_hydra(args: list[str]) -> tuple[dict[str, str], list[str]]:
    """Hydra's own flags (`--config-name X`, `--config-path=X`) and the overrides."""
    flags: dict[str, str] = {}
    overrides: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, value = arg.partition("=")
        if name in HYDRA_FLAGS:
            if not eq and i + 1 < len(args):
                value, i = args[i + 1], i + 1
            flags[name.lstrip("-").replace("cn", "config-name").replace("cp", "config-path")] = (
                value
            )
        else:
            overrides.append(arg)
        i += 1
    return flags, overrides


def backend(kind: str, flags: dict[str, str], overrides: list[str]) -> str:
    if kind != "main_ppo":
        return ""
    megatron = "megatron" in flags.get("config-name", "") or any(
        ".megatron." in o.split("=", 1)[0] or re.search(r"strategy=megatron", o) for o in overrides
    )
    return "megatron" if megatron else "fsdp"


def config_file(flags: dict[str, str], root: Path, script: Path) -> Path | None:
    """The YAML file `--config-path` / `--config-name` name, found in the exported
    repository `root` (the scripts' `$(pwd)` is its top; a relative path is Hydra's:
    from `verl/trainer/`, where main_ppo lives, or from the script's folder)."""
    name = flags.get("config-name", "").removesuffix(".yaml")
    path = flags.get("config-path", "")
    if path.startswith(ENV["PWD"]):
        path = path[len(ENV["PWD"]) :].lstrip("/")
    parts = Path(path).parts
    tails = [Path(*parts[k:]) if parts[k:] else Path() for k in range(len(parts) + 1)]
    for tail in tails:  # `${BASEDIR}/recipe/x/config` is `x/config` in the recipe repo
        for base in (root, root / "verl" / "trainer", script.parent):
            candidate = base / tail / f"{name}.yaml"
            if candidate.is_file():
                return candidate.resolve()
    return None


def check(
    kind: str, flags: dict[str, str], overrides: list[str], source: Path | None
) -> tuple[bool, str, int]:
    """(accepted, refusal reason, number of config warnings) of one command; `source`:
    the verl config file it names, which rayrl reads as `-c FILE`."""
    from rayrl.cli.common import (
        DEMO_TRIGGERS,
        SFT_DEMO_TRIGGERS,
        checked_config,
        checked_sft_config,
        config_source,
    )
    from rayrl.config import ConfigError

    name = flags.get("config-name", "").removesuffix(".yaml")
    if "megatron" in name:
        return False, f"Megatron-LM training (--config-name={name})", 0
    if name and name not in ("ppo_trainer", "sft_trainer", "sft_trainer_engine") and not source:
        return False, f"verl Hydra config file --config-name={name} (not found)", 0
    messages: list[str] = []
    if kind == "main_ppo":
        load, triggers, demo = checked_config, DEMO_TRIGGERS, "grpo"
    else:
        load, triggers, demo = checked_sft_config, SFT_DEMO_TRIGGERS, "demo"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            start = str(source) if source else config_source(None, overrides, triggers, demo)
            load(start, overrides, messages.append)
    except ConfigError as exc:
        return False, str(exc), len(messages)
    return True, "", len(messages)


def reason_class(message: str) -> str:
    """A refusal's kind, for ranking: the unknown key, the missing feature, or the rule."""
    m = re.match(r"unknown config key '([^']+)'", message)
    if m:
        return "unknown key " + m.group(1).lstrip("+")
    m = re.search(r"^([\w.]+)=.*: rayrl does not support ([^;(]+)", message)
    if m:
        return f"unsupported: {m.group(2).strip()} ({m.group(1)})"
    if message.startswith("Megatron-LM"):
        return "Megatron-LM training (--config-name=*megatron*)"
    if message.startswith("verl Hydra config file"):
        return message
    text = re.sub(r"'[^']*'", "'...'", message)
    text = re.sub(r"\d+", "N", text)
    return text.split(";")[0][:120]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="directories of verl launch scripts")
    parser.add_argument("--home", default="/home/user", help="$HOME for the expansion")
    args = parser.parse_args()
    results = []
    for root in args.dirs:
        for path in sorted(root.rglob("*.sh")):
            for kind, words in trainer_commands(path, args.home):
                flags, overrides = split_hydra(words)
                full = f"{kind}/{backend(kind, flags, overrides)}".rstrip("/")
                name = flags.get("config-name", "").removesuffix(".yaml")
                source = None
                if name and name not in ("ppo_trainer", "sft_trainer", "sft_trainer_engine"):
                    source = config_file(flags, root, path)
                accepted, reason, warned = check(kind, flags, overrides, source)
                row = {
                    "bench": BENCH,
                    "script": str(path.relative_to(root.parent)),
                    "kind": full,
                    "accepted": accepted,
                    "reason": reason,
                    "warnings": warned,
                }
                results.append(row)
                print(json.dumps(row), flush=True)
    for kind in sorted({r["kind"] for r in results}):
        rows = [r for r in results if r["kind"] == kind]
        ok = sum(r["accepted"] for r in rows)
        line = {
            "bench": BENCH,
            "metric": f"accepted_ratio/{kind}",
            "value": round(ok / len(rows), 4),
            "unit": "fraction",
            "accepted": ok,
            "total": len(rows),
        }
        if kind in TARGETS:
            line |= {"target": TARGETS[kind], "better": "higher"}
        print(json.dumps(line))
    ranked = Counter(reason_class(r["reason"]) for r in results if not r["accepted"])
    for rank, (reason, count) in enumerate(ranked.most_common(), 1):
        kinds = sorted({r["kind"] for r in results if reason_class(r["reason"]) == reason})
        print(
            json.dumps(
                {
                    "bench": BENCH,
                    "metric": "refusals",
                    "rank": rank,
                    "reason": reason,
                    "value": count,
                    "unit": "commands",
                    "kinds": kinds,
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
