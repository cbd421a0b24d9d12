"""`rayrl rm` and `rayrl dpo` run as a user types them (`python -m rayrl.cli.main ...`
in a process of its own), tiny and short: parquet pairs in OpenRLHF's layout, the
demo's synthetic pairs, the metrics under TRL's names, and the reward model's `hf/`
loaded by `rayrl train`'s reward-model loader with the scores the run validated with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import start_local_ray
from rayrl.data import write_parquet
from rayrl.data.synthetic import preference_pairs
from test_cli_commands import rayrl

pytestmark = pytest.mark.command


@pytest.fixture(scope="module")
def gcs():
    """The session's local Ray, which the commands below join."""
    return start_local_ray().get_runtime_context().gcs_address


TRL_METRICS = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def _conversation_pairs(rows: list[dict]) -> list[dict]:
    """OpenRLHF's layout: chosen and rejected are whole conversations, no prompt column."""
    out = []
    for row in rows:
        user = {"role": "user", "content": row["prompt"]}
        out.append(
            {
                "chosen": [user, {"role": "assistant", "content": row["chosen"]}],
                "rejected": [user, {"role": "assistant", "content": row["rejected"]}],
            }
        )
    return out


SMALL = [
    "data.train_batch_size=4",
    "data.micro_batch_size_per_gpu=2",
    "trainer.total_training_steps=2",
    "trainer.test_freq=2",
    "trainer.n_gpus_per_node=1",
    "trainer.device=cpu",
    "trainer.logger=[console]",
]


@pytest.mark.timeout(900)
def test_rayrl_rm_on_openrlhf_parquet_exports_a_reward_model_train_loads(tmp_path, gcs):
    train, val = preference_pairs("larger", 8, seed=2, val_size=8)
    train_file = write_parquet(_conversation_pairs(train), tmp_path / "train.parquet")
    val_file = write_parquet(_conversation_pairs(val), tmp_path / "val.parquet")
    out = tmp_path / "rm"
    done = rayrl(
        "rm",
        f"data.train_files={train_file}",
        f"data.val_files={val_file}",
        "data.max_length=64",
        *SMALL,
        f"trainer.output_dir={out}",
        f"resources.address={gcs}",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "reward_model.model.path=" in done.stdout
    rows = _rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(f"train/{k}" in rows[1] for k in TRL_METRICS)
    assert "val/preference_accuracy" in rows[0] and "val/rewards/accuracies" in rows[2]

    from rayrl.rewards.model import ModelReward

    config = json.loads((out / "hf" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"]
    model = ModelReward(out / "hf")
    prompts = [[{"role": "user", "content": r["prompt"]}] for r in val]
    chosen = model.score_chats(prompts, [r["chosen"] for r in val])
    rejected = model.score_chats(prompts, [r["rejected"] for r in val])
    n = len(val)
    # the exported model scores the held-out pairs as the run's last validation did
    assert sum(chosen) / n == pytest.approx(rows[2]["val/rewards/chosen"], abs=1e-4)
    assert sum(rejected) / n == pytest.approx(rows[2]["val/rewards/rejected"], abs=1e-4)


@pytest.mark.timeout(900)
def test_rayrl_dpo_demo_and_ipo_with_label_smoothing(tmp_path, gcs):
    out = tmp_path / "dpo"
    joined = f"resources.address={gcs}"
    done = rayrl(
        "dpo", *SMALL, "objective.label_smoothing=0.1", f"trainer.output_dir={out}", joined
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the built-in `rayrl dpo` config 'demo'" in done.stderr
    assert "held-out preference accuracy:" in done.stdout
    rows = _rows(out)
    assert rows[1]["train/loss"] == pytest.approx(0.693147, abs=1e-5)  # log 2: pi = ref
    assert rows[1]["train/rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert all(f"train/{k}" in rows[2] for k in TRL_METRICS)
    assert (out / "hf" / "config.json").is_file()

    ipo = tmp_path / "ipo"
    done = rayrl(
        "dpo",
        *SMALL,
        "objective.name=ipo",
        "objective.beta=0.5",
        f"trainer.output_dir={ipo}",
        joined,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert _rows(ipo)[1]["train/loss"] == pytest.approx(1.0, abs=1e-5)  # (0 - 1/(2 beta))^2

    wrong = rayrl("rm", "objective.name=dpo", f"trainer.output_dir={tmp_path / 'x'}")
    assert wrong.returncode == 2 and "`rayrl dpo` runs it" in wrong.stderr
