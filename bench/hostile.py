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

SRC = Path(__file__).resolve().parents[1] / "src"
BASE = [
    "-c",
    "grpo",
    "trainer.device=cpu",
    "trainer.logger=[jsonl]",
    "trainer.val_before_train=false",
    "trainer.export_hf=false",
    "trainer.total_training_steps=2",
    "data.train_batch_size=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.rollout.n=2",
    "data.max_response_length=8",
    "resources.dashboard=false",
]


def train(out: Path, *extra: str, wait: bool = True, timeout: float = 600):
    """`rayrl train` with the small base settings in `out`; the finished process (or the
    running one with `wait=False`)."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "rayrl.cli.main", "train", *BASE]
    cmd += [f"trainer.output_dir={out}", *extra]
    if not wait:
        return subprocess.Popen(
            cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
    return subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=timeout)


def text(done) -> str:
    return (done.stdout or "") + (done.stderr or "")


def rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def until(predicate: Callable[[], bool], timeout: float = 300) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.3)
    return False


def verdict(handled: bool, detail: str) -> dict:
    return {"handled": bool(handled), "detail": detail}


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
MT = "actor_rollout_ref.rollout.multi_turn"
ALWAYS_CALLS = """
import json

from rayrl.envs import ToolEnvironment

CALLS = {calls!r}


class AlwaysCalls(ToolEnvironment):
    \"\"\"A random model never writes a tool call: its first turns are read as CALLS.\"\"\"

    def step(self, conversation, message):
        made = len(self.events)
        if made < len(CALLS):
            name, arguments = CALLS[made]
            call = json.dumps({{"name": name, "arguments": arguments}})
            message = "<tool_call>" + call + "</tool_call>"
        return super().step(conversation, message)
"""
RECORD_TOOL_ANSWERS = """
import json


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open({out!r}, "a") as f:
        for message in (extra_info or {{}}).get("trajectory", []):
            if message.get("role") == "tool":
                f.write(json.dumps(message["content"]) + "\\n")
    return 0.0
"""


def _agent_run(tmp: Path, calls: list, *extra: str, timeout: float = 600):
    """`rayrl train` with multi-turn episodes on a random model whose turns end after
    about 10 tokens, each episode making `calls` (tool name, arguments) first; the
    run and the tool answers the model saw (recorded by the reward function)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _agent_env import end_turns_often
    from rayrl.models import build_tiny_model

    model = build_tiny_model(tmp / "model", layers=1, hidden=32)
    end_turns_often(str(model), 0.1)
    env, reward, answers = tmp / "env.py", tmp / "reward.py", tmp / "answers.jsonl"
    env.write_text(ALWAYS_CALLS.format(calls=calls))
    reward.write_text(RECORD_TOOL_ANSWERS.format(out=str(answers)))
    done = train(
        tmp / "run",
        f"actor_rollout_ref.model.path={model}",
        f"{MT}.enable=true",
        f"actor_rollout_ref.rollout.agent.default_agent_loop={env}:AlwaysCalls",
        f"custom_reward_function.path={reward}",
        "trainer.total_training_steps=1",
        *extra,
        timeout=timeout,
    )
    seen = [json.loads(x) for x in answers.read_text().splitlines()] if answers.exists() else []
    return done, seen


def bad_tool_schema(tmp: Path) -> dict:
    """A tool YAML whose schema requires an argument it does not define: one line
    naming the tool and the mistake, exit 2, before Ray starts."""
    tools = tmp / "tools.yaml"
    tools.write_text(
        "tools:\n  - class_name: rayrl.envs.builtin.calculator.Calculator\n"
        "    config: {type: native}\n"
        "    tool_schema: {type: function, function: {name: calc, description: Math., "
        "parameters: {type: objekt, properties: {expression: {type: string}}}}}\n"
    )
    done = train(tmp / "run", f"{MT}.enable=true", f"{MT}.tool_config_path={tools}", timeout=120)
    said = text(done)
    named = "tool 'calc': its tool_schema is not valid JSON Schema: parameters.type='objekt'"
    ok = done.returncode == 2 and named in said
    return verdict(ok and "Traceback" not in said and "Ray" not in said, said[-400:])


def strict_chat_template(tmp: Path) -> dict:
    """A model whose chat template allows no 'tool' role (strict role alternation):
    one line naming the template and the role, exit 2, before Ray starts."""
    from transformers import AutoTokenizer

    from rayrl.models import build_tiny_model

    model = build_tiny_model(tmp / "model", layers=1, hidden=32)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = (
        "{%- for m in messages %}{%- if m['role'] not in ['system', 'user', 'assistant'] %}"
        "{{- raise_exception('Conversation roles must alternate user/assistant') }}"
        "{%- endif %}{{- m['role'] + ': ' + m['content'] + '\\n' }}{%- endfor %}"
    )
    tokenizer.save_pretrained(model)
    done = train(
        tmp / "run",
        f"actor_rollout_ref.model.path={model}",
        f"{MT}.enable=true",
        f"{MT}.tools=[calculator]",
        timeout=120,
    )
    said = text(done)
    named = f"the chat template of actor_rollout_ref.model.path={model} cannot render a 'tool'"
    ok = done.returncode == 2 and named in said and len(done.stderr.strip().splitlines()) == 1
    return verdict(ok and "Traceback" not in said, said[-400:])


def tool_returns_no_text(tmp: Path) -> dict:
    """A function tool that returns a number: the model is shown "42", the call counts
    as the tool's error, the run goes on."""
    tool = tmp / "tools.py"
    tool.write_text(
        "from rayrl.envs import function_tool\n\n\n@function_tool\n"
        'def lookup(key: str) -> int:\n    """Look a key up."""\n    return 42\n'
    )
    done, seen = _agent_run(
        tmp,
        [["lookup", {"key": "a"}]],
        f"{MT}.function_tool_path={tool}",
        "data.max_response_length=64",
    )
    last = rows(tmp / "run")[-1] if rows(tmp / "run") else {}
    calls, errors = last.get("tool/lookup/calls", 0), last.get("tool/lookup/errors", 0)
    ok = done.returncode == 0 and calls > 0 and errors == calls and "42" in seen
    return verdict(ok, f"calls {calls}, errors {errors}, seen {seen[:2]} | {text(done)[-200:]}")


def sandbox_fusion_limits(tmp: Path) -> dict:
    """verl's SandboxFusion tool config: its default_timeout (3 s) stops an endless
    loop, its memory_limit_mb (256) fails a 600 MB allocation, and the service's keys
    that have no effect are named."""
    tools = tmp / "tools.yaml"
    tools.write_text(
        "tools:\n  - class_name: verl.tools.sandbox_fusion_tools.SandboxFusionTool\n"
        "    config: {sandbox_fusion_url: 'https://sandbox.example/run_code', num_workers: 10, "
        "default_timeout: 3, memory_limit_mb: 256, type: native}\n"
        "    tool_schema: {type: function, function: {name: code_interpreter, description: "
        "Run code., parameters: {type: object, properties: {code: {type: string}}, "
        "required: [code]}}}\n"
    )
    calls = [
        ["code_interpreter", {"code": "while True: pass"}],
        ["code_interpreter", {"code": 'x = b"x" * (600 << 20)\nprint("allocated")'}],
    ]
    start = time.monotonic()
    done, seen = _agent_run(
        tmp, calls, f"{MT}.tool_config_path={tools}", "data.max_response_length=512"
    )
    looped = [s for s in seen if "killed after 3." in s]
    failed = [s for s in seen if "MemoryError" in s and "allocated" not in s]
    named = "sandbox_fusion_url, num_workers of its config have no effect" in text(done)
    ok = done.returncode == 0 and looped and failed and named
    took = time.monotonic() - start
    return verdict(
        ok, f"{len(looped)} loops stopped, {len(failed)} allocations failed, {took:.0f} s"
    )


def sandbox_forks(tmp: Path) -> dict:
    """Code that forks 4 children of 200 MB under code_interpreter's memory_mb=512: the
    limit bounds the call's processes together, so the call is killed."""
    code = (
        "import os, time\nfor _ in range(4):\n    if os.fork() == 0:\n"
        "        data = b'x' * (200 << 20)\n        time.sleep(30)\n        os._exit(0)\n"
        "time.sleep(30)\n"
    )
    done, seen = _agent_run(
        tmp,
        [["code_interpreter", {"code": code}]],
        f"{MT}.tools=[{{name: code_interpreter, config: {{memory_mb: 512, timeout_s: 20}}}}]",
        "data.max_response_length=128",
    )
    killed = [s for s in seen if "MB together (memory limit)" in s]
    return verdict(done.returncode == 0 and killed, f"{len(killed)} of {len(seen)}: {seen[:1]}")


def response_budget_too_small(tmp: Path) -> dict:
    """`-c grpo`'s 32 tokens with a tool called every episode: the tool turns do not
    fit, and the log says so once, naming data.max_response_length; the tiny model's
    template, which drops the tools= list, is warned about too."""
    calls = [["calculator", {"expression": "457*823"}]]
    done, _ = _agent_run(
        tmp,
        calls,
        f"{MT}.tools=[calculator]",
        "data.max_response_length=32",
        "trainer.total_training_steps=2",
    )
    said = text(done)
    cut = said.count("the response budget cut a tool turn short")
    named = "data.max_response_length=32" in said and "ignores the tools= list" in said
    return verdict(done.returncode == 0 and cut == 1 and named, said[-600:])


def rollout_pool_too_large(tmp: Path) -> dict:
    """64 rollout replicas on a CPU-only machine of a few cores: refused by `rayrl
    train` before Ray (exit 2, naming the key) as `rayrl plan` says it never fits; one
    replica still runs (3 logical CPUs on a 2-core machine)."""
    cores = len(os.sched_getaffinity(0))
    if 4 * cores >= 66:
        return {"skipped": f"{cores} cores hold 64 replicas at 4 a core"}
    pool = ["actor_rollout_ref.rollout.mode=async", "rollout.n_gpus_per_node=64"]
    big = train(tmp / "big", *pool, timeout=120)
    env = {**os.environ, "PYTHONPATH": str(SRC), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    plan = subprocess.run(
        [sys.executable, "-m", "rayrl.cli.main", "plan", *BASE, *pool],
        env=env,
        text=True,
        capture_output=True,
        timeout=120,
    )
    key = "Lower rollout.n_gpus_per_node=64"
    said = text(big)
    last = (big.stderr.strip().splitlines() or [""])[-1]  # after the demo model's build
    refused = big.returncode == 2 and last.startswith("resources error:") and key in last
    refused = refused and "Started a local Ray" not in said
    never = plan.returncode == 2 and "NEVER" in text(plan) and key in text(plan)
    one = train(
        tmp / "one",
        "actor_rollout_ref.rollout.mode=async",
        "rollout.n_gpus_per_node=1",
        "trainer.total_training_steps=1",
    )
    ok = refused and never and one.returncode == 0
    return verdict(ok, text(big)[-300:] + " | " + text(plan)[-200:] + " | " + text(one)[-200:])


def async_ranges_without_pool(tmp: Path) -> dict:
    """Out-of-range asynchronous keys with `rollout.mode=async` and no rollout pool
    declared: each one a config error (exit 2) before Ray starts, naming the key."""
    said, ok = [], True
    for key in (
        "async_training.staleness_threshold=-1",
        "async_training.trigger_parameter_sync_step=0",
    ):
        done = train(
            tmp / key.split("=")[0], "actor_rollout_ref.rollout.mode=async", key, timeout=120
        )
        name = key.split("=")[0].split(".")[-1]
        last = (done.stderr.strip().splitlines() or [""])[-1]
        ok = (
            ok and done.returncode == 2 and name in last and "Started a local Ray" not in text(done)
        )
        said.append(last[-200:])
    return verdict(ok, " | ".join(said))


def _descendants(root: int) -> list[int]:
    """Every process below ``root`` (the run's own Ray: its raylet and workers)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _replica_pids(root: int) -> list[int]:
    """The run's rollout replica processes (Ray names them after their class)."""
    pids = []
    for pid in _descendants(root):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if title.startswith(b"ray::RolloutWorker"):
            pids.append(pid)
    return pids


def collective_replica_killed(tmp: Path) -> dict:
    """An asynchronous run whose one rollout replica takes each version by a broadcast
    (`weight_transport=collective`), the replica SIGKILLed 3 times at random moments of
    training: each loss costs seconds, never the weight-sync timeout (900 s); the run
    ends with every step (exit 0), and a version a replica missed goes by the object
    store instead (counted in `async/weight_transport_fallbacks`)."""
    import random

    out, rng, steps, kills = tmp / "run", random.Random(7), 24, 0
    proc = train(
        out,
        "actor_rollout_ref.rollout.mode=async",
        "rollout.n_gpus_per_node=1",
        "async_training.weight_transport=collective",
        f"trainer.total_training_steps={steps}",
        wait=False,
    )
    for after in (2, 8, 14):  # once training runs: kills spread over the run
        until(lambda n=after: len(rows(out)) >= n or proc.poll() is not None, timeout=600)
        time.sleep(rng.uniform(0.0, 1.0))
        pids = _replica_pids(proc.pid)
        if pids and proc.poll() is None:
            os.kill(pids[0], signal.SIGKILL)
            kills += 1
    output = proc.communicate(timeout=900)[0]
    done = rows(out)
    publish = max((row.get("timing_s/weight_publish", 0.0) for row in done), default=0.0)
    fallbacks = sum(row.get("async/weight_transport_fallbacks", 0) for row in done)
    ok = proc.returncode == 0 and kills == 3 and len(done) == steps and publish < 10.0
    detail = f"exit {proc.returncode}, {kills} kills, {len(done)} steps, longest publish "
    detail += f"{publish:.2f} s, {fallbacks:g} fallback(s); " + output[-300:]
    return verdict(ok, detail)


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
