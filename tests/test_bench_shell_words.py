"""bench/shell_words.py expands a launch script's commands as bash does (it runs nothing):
the words checked here are the ones `bash -c 'printf "%s\\n" ...'` prints for the same
lines."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from shell_words import script_commands  # noqa: E402

SCRIPT = r"""#!/bin/bash
set -x
if [ "$#" -lt 2 ]; then
    echo "Usage: $0 <nproc> <save_path>"
    exit 1
fi
nproc=$1
save_path=$2
shift 2
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B}   # a default
export LEN=$((1024 * 2))
unset_default=${NOT_SET-fallback}
name="run_${MODEL##*/}"
if [ "$nproc" = "8" ]; then
    tp=2
else
    tp=1
fi
args=(a=1 "b=two words")
python3 -m verl.trainer.main_ppo \
    data.train_files=$HOME/data/train.parquet \
    trainer.logger='["console",
        "wandb"]' \
    data.max_prompt_length=$LEN \
    actor_rollout_ref.model.path="$MODEL" \
    rollout.tp=$tp \
    trainer.default_local_dir=$save_path/$name \
    x=$unset_default "${args[@]}" "$@" 2>&1 | tee log.txt
"""


def test_a_script_expands_as_bash_would():
    commands = list(script_commands(SCRIPT, {"HOME": "/home/u"}, "run.sh", ["8", "/ckpt"]))
    (ppo,) = [c for c in commands if "verl.trainer.main_ppo" in c]
    assert ppo[3:] == [
        "data.train_files=/home/u/data/train.parquet",
        'trainer.logger=["console",\n        "wandb"]',
        "data.max_prompt_length=2048",
        "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B",
        "rollout.tp=2",
        "trainer.default_local_dir=/ckpt/run_Qwen2.5-0.5B",
        "x=fallback",
        "a=1",
        "b=two words",
    ]
    assert ["tee", "log.txt"] in commands  # the pipe ends the command, the redirection goes


def test_too_few_arguments_stop_at_the_scripts_exit():
    commands = list(script_commands(SCRIPT, {"HOME": "/h"}, "run.sh", []))
    assert not any("verl.trainer.main_ppo" in c for c in commands)
    assert ["echo", "Usage: run.sh <nproc> <save_path>"] in commands
