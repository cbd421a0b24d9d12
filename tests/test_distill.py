"""On-policy distillation (`distillation.*`): the divergence and its two ways of training,
the config's checks, the teachers' tokenizers, and `rayrl train` with teachers in the
actor's processes and on a pool of their own."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from rayrl.algos.aggregation import LossAggregation
from rayrl.algos.distill import DISTILL_LOSSES, DistillSpec, distillation_loss, token_divergence
from rayrl.batch import Batch
from rayrl.config import load_config
from rayrl.config.distill_checks import DISTILL_LOSS_MODES
from rayrl.config.errors import ConfigError
from rayrl.workers.losses import actor_loss_fn

TEACHER = "distillation.teacher_models.teacher_model.model_path"


def _config(*overrides: str):
    return load_config("grpo", ["distillation.enabled=true", *overrides])


# ------------------------------------------------------------------ the divergence
def test_loss_modes_are_the_registry_and_verl_names():
    assert set(DISTILL_LOSSES.names()) | {"forward_kl_topk"} == set(DISTILL_LOSS_MODES)
    for alias in ("kl", "mse", "low_var_kl"):  # verl's names for k1, k2, k3
        assert alias in DISTILL_LOSS_MODES


def test_token_divergence_is_the_estimators_of_the_reverse_kl():
    s = torch.tensor([[-1.0, -2.0, -0.5]])
    t = torch.tensor([[-1.5, -0.5, -9.0]])
    mask = torch.tensor([[1, 1, 0]])
    d = s - t
    assert torch.equal(token_divergence(s, t, mask, "k1"), torch.tensor([[0.5, -1.5, 0.0]]))
    k3 = torch.exp(-d) + d - 1
    assert torch.allclose(token_divergence(s, t, mask, "low_var_kl")[0, :2], k3[0, :2])
    assert token_divergence(s, t, mask, "k3")[0, 2] == 0  # padding
    assert torch.allclose(token_divergence(s, t, mask, "mse")[0, :2], d[0, :2] ** 2 / 2)


def test_supervised_k3_moves_the_student_toward_the_teacher():
    """Gradient descent on the supervised term brings the student's distribution to the
    teacher's (its tokens sampled from the student, as on-policy)."""
    torch.manual_seed(0)
    teacher = torch.log_softmax(torch.tensor([2.0, 0.0, -1.0, 0.5]), -1)
    theta = torch.zeros(4, requires_grad=True)
    opt = torch.optim.SGD([theta], lr=0.5)

    def kl() -> float:
        p = torch.softmax(theta.detach(), -1)
        return float((p * (torch.log(p) - teacher)).sum())

    start = kl()
    for _ in range(200):
        student = torch.log_softmax(theta, -1)
        tokens = torch.multinomial(student.exp().detach(), 64, replacement=True)[None]
        loss, _ = distillation_loss(
            student[tokens],
            teacher[tokens],
            student[tokens].detach(),
            torch.ones_like(tokens),
            DistillSpec("k3"),
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert kl() < start / 10


def test_policy_gradient_advantage_is_the_negative_divergence():
    """With the ratio at 1, the clipped loss's gradient on each token's log-prob is
    ``-advantage / tokens``, and the advantage is ``-(log p_s - log p_t)``."""
    s = torch.tensor([[-1.0, -2.0, -0.5, -3.0]], requires_grad=True)
    t = torch.tensor([[-1.5, -0.5, -0.7, -1.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    spec = DistillSpec("k1", use_policy_gradient=True)
    loss, metrics = distillation_loss(s, t, s.detach(), mask, spec, LossAggregation())
    loss.backward()
    expected = torch.where(mask.bool(), (s.detach() - t) / 3, torch.zeros(1, 4))
    assert torch.allclose(s.grad, expected)
    assert math.isclose(
        float(metrics["reverse_kl"]), float((s.detach() - t)[0, :3].mean()), rel_tol=1e-6
    )
    assert float(metrics["pg_clipfrac"]) == 0.0


def test_loss_max_clamp_bounds_each_token():
    s, t = torch.tensor([[0.0, 0.0]]), torch.tensor([[-20.0, -0.1]])
    mask = torch.ones(1, 2)
    clamped, m = distillation_loss(s, t, s, mask, DistillSpec("k2", loss_max_clamp=1.0))
    assert math.isclose(float(clamped), (1.0 + 0.005) / 2, rel_tol=1e-5)
    assert math.isclose(float(m["loss_max"]), 200.0)  # the largest, before the clamp


def _micro_batch(teacher_lp: torch.Tensor) -> Batch:
    mask = torch.tensor([[1.0, 1.0, 1.0]])
    return Batch(
        {
            "response_mask": mask,
            "old_log_probs": torch.tensor([[-1.0, -1.0, -1.0]]),
            "advantages": torch.tensor([[1.0, 1.0, 1.0]]),
            "teacher_log_prob": teacher_lp,
        },
        meta={"global_token_count": 3, "global_seq_count": 1},
    )


@pytest.mark.parametrize("with_task", [True, False])
def test_the_actor_loss_adds_the_term_or_is_the_term(with_task):
    mb = _micro_batch(torch.tensor([[-0.5, -2.0, -1.0]]))
    outputs = {"log_probs": torch.tensor([[-1.0, -1.0, -1.0]])}
    spec = DistillSpec("k3", with_task=with_task, coef=0.25)
    actor = dataclasses.replace(load_config("grpo").actor_rollout_ref.actor, use_kl_loss=False)
    loss, metrics = actor_loss_fn(actor, distill=spec)(outputs, mb)
    task, _ = actor_loss_fn(actor)(outputs, mb)
    term = float(metrics["distillation/loss"])
    d = torch.tensor([-0.5, 1.0, 0.0])
    assert math.isclose(term, float((torch.exp(-d) + d - 1).mean()), rel_tol=1e-6)
    expected = float(task) + 0.25 * term if with_task else term
    assert math.isclose(float(loss), expected, rel_tol=1e-6)


# ------------------------------------------------------------------ the config
def test_verl_keys_load_and_name_the_teachers(tmp_path):
    (tmp_path / "a").mkdir()
    cfg = load_config(
        "grpo",
        [
            "distillation.enabled=true",
            "+distillation.teacher_models.t1.key=gsm8k",
            "+distillation.teacher_models.t1.model_path=a",
            "+distillation.teacher_models.t1.inference.tensor_model_parallel_size=2",
            "+distillation.teacher_models.t2.key=math",
            "+distillation.teacher_models.t2.model_path=/models/b",
            "distillation.distillation_loss.loss_mode=low_var_kl",
        ],
    )
    from rayrl.config.distill import teachers

    found = teachers(cfg.distillation)
    assert sorted(found) == ["gsm8k", "math"]  # the lone default entry is dropped
    assert found["math"].model_path == "/models/b"


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ([], "model_path is not set"),
        ([f"{TEACHER}=/m", "distillation.distillation_loss.loss_mode=k1"], "use_policy_gradient"),
        ([f"{TEACHER}=/m", "distillation.distillation_loss.loss_mode=js"], "choose one of"),
        ([f"{TEACHER}=/m", "distillation.distillation_loss.loss_mode=forward_kl_topk"], "top-k"),
        ([f"{TEACHER}=/m", "distillation.distillation_loss.policy_loss_mode=gspo"], "vanilla"),
        ([f"{TEACHER}=/m", "distillation.nnodes=1", "distillation.n_gpus_per_node=0"], "one rank"),
        (
            [
                "+distillation.teacher_models.a.key=x",
                "+distillation.teacher_models.a.model_path=/m",
                "+distillation.teacher_models.b.key=x",
                "+distillation.teacher_models.b.model_path=/n",
            ],
            "share the key",
        ),
        (
            [
                "+distillation.teacher_models.a.model_path=/m",
                "+distillation.teacher_models.b.key=y",
            ],
            ".key is not set",
        ),
        ([f"{TEACHER}=/m", "+distillation.teacher_models.teacher_model.tp=2"], "unknown key"),
    ],
)
def test_bad_settings_say_what_to_change(overrides, says):
    with pytest.raises(ConfigError, match=says.replace(".", r"\.")):
        _config(*overrides)


def test_the_teachers_pool_of_their_own():
    from rayrl.trainer.resources import pools_from_config

    cfg = _config(f"{TEACHER}=/m", "distillation.nnodes=1", "distillation.n_gpus_per_node=2")
    pools = {p.name: p for p in pools_from_config(cfg, "cpu", 2)}
    assert pools["teacher"].per_node == [2]
    cfg = _config(f"{TEACHER}=/m")  # verl's nnodes=0: in the actor's processes
    assert "teacher" not in {p.name for p in pools_from_config(cfg, "cpu", 2)}


def test_a_teacher_of_another_vocabulary_is_refused(tmp_path):
    from rayrl.models import build_tiny_model
    from rayrl.models.loading import load_tokenizer
    from rayrl.trainer.teachers import check_teachers

    student = build_tiny_model(tmp_path / "s", layers=1, seed=1)
    same = build_tiny_model(tmp_path / "same", layers=2, hidden=32, seed=5)
    other = build_tiny_model(tmp_path / "o", layers=1, seed=1, vocab_size=300)
    tokenizer = load_tokenizer(student, key="actor_rollout_ref.model.path")
    check_teachers(_config(f"{TEACHER}={same}"), tokenizer)  # another model, same tokens
    with pytest.raises(ConfigError, match="teacher's tokenizer is not the student's"):
        check_teachers(_config(f"{TEACHER}={other}"), tokenizer)


# ------------------------------------------------------------------ the teachers' rows
class _Engine:
    """A stand-in engine: each row's log-prob is the engine's mark (routing only)."""

    def __init__(self, mark: float) -> None:
        self.mark, self.calls = mark, []

    def forward(self, batch: Batch, **_: object) -> Batch:
        self.calls.append(len(batch))
        return Batch({"log_probs": torch.full(batch["response_mask"].shape, self.mark)})


def test_each_row_goes_to_its_teacher_and_every_rank_runs_every_teacher():
    import numpy as np

    from rayrl.controller.worker import WorkerContext
    from rayrl.workers.teacher import TeacherWorker

    worker = TeacherWorker.__new__(TeacherWorker)
    worker.ctx = WorkerContext(group="teacher", role="teacher", rank=0, world_size=1)
    worker.cfg = _config(
        "+distillation.teacher_models.a.key=gsm8k",
        "+distillation.teacher_models.a.model_path=/a",
        "+distillation.teacher_models.b.key=math",
        "+distillation.teacher_models.b.model_path=/b",
    )
    worker.engines = {"gsm8k": _Engine(-1.0), "math": _Engine(-2.0)}
    rows = Batch(
        {"response_mask": torch.ones(3, 2)},
        non_tensors={"data_source": np.array(["math", "gsm8k", "math"], dtype=object)},
    )
    out = worker.compute_teacher_log_prob(rows)["teacher_log_prob"]
    assert out[:, 0].tolist() == [-2.0, -1.0, -2.0]
    only_math = rows.index([0, 2])  # no gsm8k row here: a stand-in row keeps FSDP in step
    worker.compute_teacher_log_prob(only_math)
    assert worker.engines["gsm8k"].calls == [1, 1]
    rows.non_tensors["data_source"][1] = "code"
    with pytest.raises(ValueError, match="data_source='code' have no teacher"):
        worker.compute_teacher_log_prob(rows)


# ------------------------------------------------------------------ rayrl train
def _train(out, *overrides: str) -> dict:
    """`rayrl train` for one GRPO step with distillation; the step's metrics."""
    from conftest import train_one_step

    return train_one_step(out, "distillation.enabled=true", *overrides)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from rayrl.models import build_tiny_model
    from rayrl.trainer.model_dir import DEMO_MODEL

    root = tmp_path_factory.mktemp("distill")
    student = build_tiny_model(root / "student", **DEMO_MODEL, seed=1)
    teacher = build_tiny_model(root / "teacher", layers=3, hidden=96, seed=2)
    return student, teacher


def test_rows_of_the_student_s_own_teacher_diverge_by_zero(tmp_path, models):
    """Two teachers in the actor's processes, picked by `data_source`: the task's rows
    go to the student's own weights, so the divergence is 0 exactly (the other teacher,
    another model, would not give it)."""
    student, teacher = models
    row = _train(
        tmp_path / "run",
        f"actor_rollout_ref.model.path={student}",
        "+distillation.teacher_models.own.key=arithmetic",  # the synthetic task's source
        f"+distillation.teacher_models.own.model_path={student}",
        "+distillation.teacher_models.other.key=elsewhere",
        f"+distillation.teacher_models.other.model_path={teacher}",
    )
    assert row["distillation/reverse_kl"] == 0 and row["distillation/abs_loss"] == 0
    assert row["timing_s/teacher"] > 0


def test_a_teacher_on_its_own_pool_trains_the_student_alone(tmp_path, models):
    """No task reward (every score is 0 on a random model: no task gradient), the
    teacher on a pool of its own, the divergence as each token's advantage: the
    student's gradient is the distillation's."""
    student, teacher = models
    row = _train(
        tmp_path / "run",
        f"actor_rollout_ref.model.path={student}",
        f"distillation.teacher_models.teacher_model.model_path={teacher}",
        "distillation.nnodes=1",
        "distillation.n_gpus_per_node=1",
        "distillation.distillation_loss.use_task_rewards=false",
        "distillation.distillation_loss.use_policy_gradient=true",
        "distillation.distillation_loss.loss_mode=k1",
    )
    assert row["critic/score/mean"] == 0  # no task signal
    assert row["distillation/abs_loss"] > 0.01 and row["actor/grad_norm"] > 0
    assert "distillation/pg_clipfrac" in row


def test_a_teacher_key_of_the_rows_extra_info_picks_the_teacher():
    """verl's `teacher_key` names a field of the data (`task`): in rayrl's rows the
    dataset's other fields travel in `extra_info`, where the key is looked up; a key the
    rows have nowhere is refused when the data loads."""
    import numpy as np

    from rayrl.controller.worker import WorkerContext
    from rayrl.trainer.teachers import check_teacher_key
    from rayrl.workers.teacher import TeacherWorker

    cfg = _config(
        "distillation.teacher_key=task",
        "+distillation.teacher_models.a.key=gsm8k",
        "+distillation.teacher_models.a.model_path=/a",
        "+distillation.teacher_models.b.key=math",
        "+distillation.teacher_models.b.model_path=/b",
    )
    infos = np.array([{"task": "math"}, {"task": "gsm8k"}], dtype=object)
    rows = Batch({"response_mask": torch.ones(2, 2)}, non_tensors={"extra_info": infos})
    worker = TeacherWorker.__new__(TeacherWorker)
    worker.ctx = WorkerContext(group="teacher", role="teacher", rank=0, world_size=1)
    worker.cfg, worker.engines = cfg, {"gsm8k": _Engine(-1.0), "math": _Engine(-2.0)}
    assert worker.compute_teacher_log_prob(rows)["teacher_log_prob"][:, 0].tolist() == [-2, -1]
    check_teacher_key(cfg, type("Rows", (), {"collate": lambda self, i: rows})())
    bare = Batch({"response_mask": torch.ones(2, 2)}, non_tensors={"data_source": infos})
    with pytest.raises(ConfigError, match="teacher_key='task': the training rows have no"):
        check_teacher_key(cfg, type("Rows", (), {"collate": lambda self, i: bare})())
