"""The hostile trial, replayed as a user would meet it: `rayrl train` in its own process,
real signals, a full disk, a read-only directory, a damaged checkpoint, bad data.

Each case runs the product command and checks what a user needs: a clear message
naming what to do, nothing lost, the documented exit code. Prints one JSON object per
case (`case`, `handled`, `detail`) and a summary line (`cases`, `cases_handled`).
The full-disk and read-only cases mount small tmpfs filesystems and need root; they
are reported as skipped otherwise.

    python bench/hostile.py [--only NAME ...] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from hostile_agents import (
    bad_tool_schema,
    response_budget_too_small,
    sandbox_forks,
    sandbox_fusion_limits,
    strict_chat_template,
    tool_returns_no_text,
)
from hostile_async import (
    async_ranges_without_pool,
    collective_replica_killed,
    rollout_pool_too_large,
)
from hostile_run import SRC, rows, text, train, until, verdict


# --------------------------------------------------------------------------- cases
def same_output_dir(tmp: Path) -> dict:
    out = tmp / "run"
    first = train(out, "trainer.total_training_steps=6", wait=False)
    try:
        until(lambda: len(rows(out)) >= 1)
        first.send_signal(signal.SIGSTOP)  # alive, holding its lock, while the second starts
        second = train(out)
        named = f"pid {first.pid}" in text(second) and "in use by another run" in text(second)
        return verdict(second.returncode == 2 and named, text(second)[-400:])
    finally:
        first.send_signal(signal.SIGCONT)
        first.kill()
        first.wait()


def resume_other_model(tmp: Path) -> dict:
    out = tmp / "run"
    first = train(out, "trainer.save_freq=1")
    from rayrl.models import build_tiny_model

    other = build_tiny_model(tmp / "other", layers=2, hidden=32, seed=9)
    second = train(out, f"actor_rollout_ref.model.path={other}")
    ok = first.returncode == 0 and second.returncode == 2 and "model" in text(second)
    return verdict(ok and "differs from the one that wrote" in text(second), text(second)[-400:])


def resume_other_batch_size(tmp: Path) -> dict:
    out = tmp / "run"
    train(out, "trainer.save_freq=1", "trainer.total_training_steps=1")
    refused = train(out, "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8")
    said = "data.train_batch_size: 4 -> 8" in text(refused)
    moved = train(
        out,
        "data.train_batch_size=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "trainer.resume_check=warn",
        "trainer.total_training_steps=3",
    )
    kept = "row 4 of epoch 0) is batch 2 of 2 rows" in text(moved)
    ok = refused.returncode == 2 and said and moved.returncode == 0 and kept
    return verdict(ok, text(refused)[-200:] + " | " + text(moved)[-300:])


def reward_always_fails(tmp: Path) -> dict:
    fn = tmp / "bad_reward.py"
    fn.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return None\n"
    )
    done = train(tmp / "run", f"custom_reward_function.path={fn}", "trainer.total_training_steps=3")
    said = "reward error:" in text(done) and "Traceback" not in text(done)
    stopped = done.returncode == 1 and said and str(fn) in text(done)
    return verdict(stopped, text(done)[-400:])


def huge_reward(tmp: Path) -> dict:
    fn = tmp / "huge.py"
    fn.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 1e30 if len(solution_str) % 2 else 0.0\n"
    )
    out = tmp / "run"
    done = train(out, f"custom_reward_function.path={fn}")
    warned = "scores are beyond" in text(done)
    # GRPO's advantages are the scores standardised within each prompt's group, so
    # they keep their usual size however large the scores; the update moves the
    # weights. (The on-policy pg_loss of a group of two with equal lengths is exactly
    # 0 at any scale: +a and -a average out; its gradient does not.)
    moved = any(
        r.get("critic/advantages/max", 0.0) > 0.1 and r.get("actor/grad_norm", 0.0) > 0
        for r in rows(out)
    )
    return verdict(done.returncode == 0 and warned and moved, text(done)[-300:])


def sigterm(tmp: Path) -> dict:
    out = tmp / "run"
    proc = train(out, "trainer.total_training_steps=8", "trainer.save_freq=5", wait=False)
    until(lambda: len(rows(out)) >= 2)
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=300)[0]
    saved = (out / "checkpoints" / "latest").is_file()
    ok = proc.returncode == 143 and "stopped by SIGTERM after step" in output and saved
    return verdict(ok, output[-300:])


def _mount_tmpfs(path: Path, options: str) -> bool:
    if os.geteuid() != 0:
        return False
    path.mkdir(parents=True, exist_ok=True)
    return (
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)]).returncode == 0
    )


def disk_full(tmp: Path) -> dict:
    small = tmp / "small"
    if not _mount_tmpfs(small, "size=3m"):
        return {"skipped": "needs root to mount a small tmpfs"}
    try:
        done = train(small / "run", "trainer.save_freq=1")
        said = "is full" in text(done) or "not enough space" in text(done)
        clean = (
            not list((small / "run" / "checkpoints").glob(".tmp-*"))
            if (small / "run" / "checkpoints").exists()
            else True
        )
        return verdict(done.returncode == 1 and said and clean, text(done)[-400:])
    finally:
        subprocess.run(["umount", "-l", str(small)])


def dashboard_race(tmp: Path) -> dict:
    procs = [train(tmp / f"run{i}", "resources.dashboard=true", wait=False) for i in range(2)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    ok = all(p.returncode == 0 for p in procs)
    return verdict(ok, " | ".join(o[-200:] for o in outputs))


def corrupted_checkpoint(tmp: Path) -> dict:
    out = tmp / "run"
    train(out, "trainer.save_freq=1", "trainer.total_training_steps=2")
    shard = next((out / "checkpoints" / "global_step_2" / "actor").rglob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    done = train(out, "trainer.total_training_steps=3")
    named = shard.name in text(done) and "global_step_1" in text(done)
    return verdict(done.returncode == 0 and named, text(done)[-400:])


def no_tokenizer(tmp: Path) -> dict:
    from rayrl.models import build_tiny_model

    model = build_tiny_model(tmp / "m", layers=1, hidden=32)
    for path in list(model.iterdir()):
        if path.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            path.unlink()
    done = train(tmp / "run", f"actor_rollout_ref.model.path={model}")
    return verdict(done.returncode == 2 and "no tokenizer files" in text(done), text(done)[-300:])


def bad_numbers(tmp: Path) -> dict:
    lr = train(tmp / "a", "actor_rollout_ref.actor.optim.lr=-1e-5")
    greedy = train(tmp / "b", "actor_rollout_ref.rollout.temperature=0")
    named = "actor_rollout_ref.actor.optim.lr=-1e-05 is out of range" in text(lr)
    ok = lr.returncode == 2 and named and greedy.returncode == 0
    return verdict(ok, text(lr)[-200:] + " | " + text(greedy)[-200:])


def read_only_dir(tmp: Path) -> dict:
    ro = tmp / "ro"
    if not _mount_tmpfs(ro, "ro,size=1m"):
        return {"skipped": "needs root to mount a read-only tmpfs"}
    try:
        done = train(ro / "run")
        named = (
            "cannot write the run directory",
            "cannot build the demo model in the run directory",
        )
        said = any(m in text(done) for m in named) and "Traceback" not in text(done)
        return verdict(done.returncode == 2 and said, text(done)[-300:])
    finally:
        subprocess.run(["umount", "-l", str(ro)])


def bad_rows(tmp: Path) -> dict:
    from rayrl.data import synthetic_rows, write_parquet

    rows_ = synthetic_rows(size=12, seed=1)
    for i in (2, 5, 9):
        rows_[i]["prompt"] = []
    data = write_parquet(rows_, tmp / "train.parquet")
    out = tmp / "run"
    done = train(out, f"data.train_files={data}")
    listed = (
        (out / "rejected_rows.jsonl").read_text().splitlines()
        if (out / "rejected_rows.jsonl").exists()
        else []
    )
    ok = done.returncode == 0 and len(listed) == 3 and "3 x 'prompt' has no messages" in text(done)
    return verdict(ok, text(done)[-300:])


def misnamed_reward(tmp: Path) -> dict:
    """A reward file whose function is misspelt: one line, before Ray starts."""
    reward = tmp / "reward.py"
    reward.write_text("def compute_scor(data_source, solution_str, ground_truth):\n    return 0\n")
    done = train(tmp / "run", f"custom_reward_function.path={reward}", timeout=120)
    said = text(done)
    ok = done.returncode == 2 and "Did you mean 'compute_scor'?" in said
    return verdict(ok and "Traceback" not in said and "Ray" not in said, said[-300:])


def misnamed_tool(tmp: Path) -> dict:
    """A multi-turn run naming a built-in tool misspelt: one line, before Ray starts."""
    done = train(
        tmp / "run",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.tools=[calculater]",
        timeout=120,
    )
    said = text(done)
    ok = done.returncode == 2 and "Did you mean 'calculator'?" in said
    return verdict(ok and "Traceback" not in said and "Ray" not in said, said[-300:])


def empty_override(tmp: Path) -> dict:
    """A launch script's ``key=${UNSET}``: on a number, one line naming the key and the
    unset variable, exit 2, before Ray starts."""
    done = train(tmp / "run", "actor_rollout_ref.rollout.temperature=", timeout=120)
    said = text(done)
    named = "'actor_rollout_ref.rollout.temperature' is given no value" in said
    ok = done.returncode == 2 and named and "shell variable" in said
    return verdict(ok and "Traceback" not in said and "Ray" not in said, said[-300:])


# ------------------------------------------------------------ agents: tools, sandbox


CASES: dict[str, Callable[[Path], dict]] = {
    "same_output_dir": same_output_dir,
    "resume_other_model": resume_other_model,
    "resume_other_batch_size": resume_other_batch_size,
    "reward_always_fails": reward_always_fails,
    "huge_reward": huge_reward,
    "sigterm": sigterm,
    "disk_full": disk_full,
    "dashboard_race": dashboard_race,
    "corrupted_checkpoint": corrupted_checkpoint,
    "no_tokenizer": no_tokenizer,
    "bad_numbers": bad_numbers,
    "read_only_dir": read_only_dir,
    "bad_rows": bad_rows,
    "misnamed_reward": misnamed_reward,
    "misnamed_tool": misnamed_tool,
    "empty_override": empty_override,
    "bad_tool_schema": bad_tool_schema,
    "strict_chat_template": strict_chat_template,
    "tool_returns_no_text": tool_returns_no_text,
    "sandbox_fusion_limits": sandbox_fusion_limits,
    "sandbox_forks": sandbox_forks,
    "response_budget_too_small": response_budget_too_small,
    "rollout_pool_too_large": rollout_pool_too_large,
    "async_ranges_without_pool": async_ranges_without_pool,
    "collective_replica_killed": collective_replica_killed,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", default=None, choices=sorted(CASES))
    parser.add_argument("--keep", default=None, help="run directories go here (kept)")
    args = parser.parse_args()
    sys.path.insert(0, str(SRC))
    handled = total = 0
    for name in args.only or list(CASES):
        tmp = Path(tempfile.mkdtemp(prefix=f"hostile-{name}-", dir=args.keep))
        start = time.time()
        try:
            result = CASES[name](tmp)
        except Exception as err:  # noqa: BLE001 - a case that crashed is a result
            result = verdict(False, f"{type(err).__name__}: {err}")
        result.update(bench="hostile", case=name, seconds=round(time.time() - start, 1))
        print(json.dumps(result), flush=True)
        if "skipped" not in result:
            total += 1
            handled += result["handled"]
        if args.keep is None:
            shutil.rmtree(tmp, ignore_errors=True)
    print(
        json.dumps(
            {
                "bench": "hostile",
                "metric": "cases_handled",
                "value": handled,
                "cases": total,
                "target": total,
                "better": "higher",
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
