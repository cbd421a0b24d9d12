"""A training run keeps what it makes, through `rayrl train` with the real roles.

One small GRPO run (2 epochs x 2 steps, a checkpoint every step, validation before
training and every 2 steps, every tracker) is shared by the assertions below; a
second run resumes from its epoch-boundary checkpoint and must end bitwise equal.
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

from conftest import start_local_ray
from rayrl.cli.main import main
from rayrl.config import load_config
from rayrl.trainer.ppo import PPOTrainer
from rayrl.trainer.run import Run
from rayrl.workers.context import StepContext

pytestmark = pytest.mark.slow

RUN = [
    "data.train_batch_size=2",
    "data.max_response_length=8",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=1",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "trainer.device=cpu",
    "data.synthetic_size=4",
    "trainer.total_epochs=2",
    "trainer.total_training_steps=null",
    "data.synthetic_val_size=4",
    "data.val_batch_size=null",
    "actor_rollout_ref.rollout.val_kwargs.n=2",
    "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
    "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "trainer.save_freq=1",
    "trainer.max_actor_ckpt_to_keep=3",
    "trainer.test_freq=2",
]
# The optional trackers installed here (all of them in CI; a machine may lack some).
OPTIONAL = [t for t in ("tensorboard", "wandb", "mlflow") if importlib.util.find_spec(t)]
TRACKERS = f"trainer.logger=[{','.join(['console', 'jsonl', *OPTIONAL])}]"


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    """The uninterrupted run, through the CLI."""
    start_local_ray()
    out = tmp_path_factory.mktemp("run_a")
    assert main(["train", "-c", "grpo", *RUN, TRACKERS, f"trainer.output_dir={out}"]) == 0
    return out


@pytest.fixture(scope="module")
def run_b(run_a, tmp_path_factory):
    """A run resumed from run A's checkpoint at the end of epoch 0; also probes the live
    policy's log-probs before shutting down, to compare with its HF export."""
    out = tmp_path_factory.mktemp("run_b")
    resume = run_a / "checkpoints" / "global_step_2"
    cfg = load_config(
        "grpo",
        [
            *RUN,
            f"trainer.output_dir={out}",
            "trainer.resume_mode=resume_path",
            f"trainer.resume_from_path={resume}",
        ],
    )
    printed: list[str] = []
    run = Run(PPOTrainer(cfg, print_fn=printed.append))
    try:
        history = run.setup().fit()
        actor = run.trainer.roles.actor
        prompts = run.data.dataset.collate([0, 1])
        prompts.meta["step"] = 99
        probe = actor.generate(prompts, StepContext(step=99)).batch
        probe = probe.union(actor.compute_log_prob(probe).select("old_log_probs"))
    finally:
        run.shutdown()
    return {"dir": out, "history": history, "printed": printed, "probe": probe}


def _rows(run_dir) -> dict[int, list[dict]]:
    rows: dict[int, list[dict]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(row["step"], []).append(row)
    return rows


def _deterministic(row: dict) -> dict:
    """Every metric but wall-clock ones (stage times, usage, reward scoring time)."""
    clocks = ("timing_s/", "perf/", "reward/elapsed_s/")
    return {k: v for k, v in row.items() if not k.startswith(clocks)}


def test_run_directory_checkpoints_and_validation(run_a):
    assert (run_a / "config.yaml").read_text().startswith("data:")
    rows = _rows(run_a)
    assert sorted(rows) == [0, 1, 2, 3, 4]
    assert "val-core/arithmetic/reward/mean@2" in rows[0][0]  # before training
    for step in (2, 4):  # test_freq=2, and the last step
        row = rows[step][0]
        for key in (
            "val-core/arithmetic/reward/mean@2",
            "val-core/arithmetic/reward/pass@2",
            "val-core/arithmetic/acc/mean@2",
            "val-aux/arithmetic/reward/pass@1",
        ):
            assert math.isfinite(row[key]), key
    assert "val-core/arithmetic/reward/mean@2" not in rows[3][0]
    step1 = rows[1][0]
    assert "reward/acc/mean" in step1  # the reward dict's extra key
    # per role: on a CPU run of one rank the reward shares the actor's process, and
    # a fused process reports each role's stages under the role's own name
    assert step1["perf/max_memory_allocated_gb/actor"] > 0
    assert any(k.startswith("perf/cpu_util/") for k in step1)
    assert step1["training/epoch"] == 0 and rows[3][0]["training/epoch"] == 1
    generations = (run_a / "val_generations" / "step_2.jsonl").read_text().splitlines()
    assert generations and {"prompt", "response", "score"} <= set(json.loads(generations[0]))
    ckpts = run_a / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("global_step_*")) == [
        "global_step_2",
        "global_step_3",
        "global_step_4",
    ]  # max_actor_ckpt_to_keep=3 of 4 saves
    assert (ckpts / "latest").read_text().strip() == "global_step_4"
    workers = json.loads((run_a / "workers.json").read_text())["workers"]
    # one rank on CPU: the reward scores in the actor's process (reward.colocate)
    assert [(w["group"], sorted(w["roles"])) for w in workers] == [
        ("actor_rollout_ref", ["actor", "reward"])
    ]


def test_trackers_write_their_outputs(run_a):
    if set(OPTIONAL) != {"tensorboard", "wandb", "mlflow"}:
        pytest.skip(f"the optional trackers are not all installed here (only {OPTIONAL})")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_a / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("critic/score/mean")] == [1, 2, 3, 4]
    assert list((run_a / "wandb").glob("offline-run-*/run-*.wandb"))
    metric_files = list((run_a / "mlruns").glob("*/*/metrics/critic/score/mean"))
    assert len(metric_files) == 1
    assert len(metric_files[0].read_text().splitlines()) == 4
    assert list((run_a / "mlruns").glob("*/*/metrics/val-core/arithmetic/reward/mean_at_2"))


def test_resume_at_epoch_boundary_is_exact(run_a, run_b):
    assert any("resumed from" in p and "next epoch 1 batch 0" in p for p in run_b["printed"])
    assert [m["training/global_step"] for m in run_b["history"]] == [3, 4]
    a, b = _rows(run_a), _rows(run_b["dir"])
    assert sorted(b) == [3, 4]  # the resumed run logs from the step after its checkpoint
    for step in (3, 4):
        assert _deterministic(b[step][0]) == _deterministic(a[step][0]), step
    weights_a = (run_a / "hf" / "model.safetensors").read_bytes()
    assert (run_b["dir"] / "hf" / "model.safetensors").read_bytes() == weights_a


def test_hf_export_loads_and_matches_the_trained_policy(run_b):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = run_b["dir"] / "hf"
    model = AutoModelForCausalLM.from_pretrained(hf)
    assert model.dtype == torch.float32  # trained in float32 on CPU
    assert AutoTokenizer.from_pretrained(hf).pad_token_id is not None
    probe = run_b["probe"]
    width = probe["responses"].shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=probe["input_ids"],
            attention_mask=probe["attention_mask"],
            position_ids=probe["position_ids"],
        ).logits[:, -width - 1 : -1]
    log_probs = torch.log_softmax(logits.float(), -1).gather(-1, probe["responses"].unsqueeze(-1))
    mask = probe["response_mask"].bool()
    torch.testing.assert_close(
        log_probs.squeeze(-1)[mask], probe["old_log_probs"][mask], atol=1e-4, rtol=1e-4
    )


def test_rayrl_export_of_the_last_checkpoint_equals_the_final_export(run_a, tmp_path):
    out = tmp_path / "exported"
    assert main(["export", str(run_a / "checkpoints" / "global_step_4"), str(out)]) == 0
    assert (out / "model.safetensors").read_bytes() == (
        run_a / "hf" / "model.safetensors"
    ).read_bytes()


def test_report_writes_plots_and_html(run_a):
    assert main(["report", str(run_a)]) == 0
    report = run_a / "report"
    for name in (
        "score",
        "val_score",
        "kl",
        "entropy",
        "response_length",
        "grad_norm",
        "timing",
        "throughput",
    ):
        png = report / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    page = (report / "report.html").read_text()
    assert 'src="timing.png"' in page and "train_batch_size: 2" in page
