"""On-policy distillation's checks before anything is reserved: each teacher's model is
there and speaks the student's tokens.

A teacher scores the student's token ids: with another vocabulary those ids name other
words, and the divergence would train the student toward noise without an error. So a
teacher whose tokenizer maps any token differently from the student's stops the run
here, naming the teacher's key and a token that differs.
"""

from __future__ import annotations

from typing import Any

from rayrl.config.distill import teachers
from rayrl.config.errors import ConfigError
from rayrl.config.schema import RayRLConfig
from rayrl.models.loading import check_model_path, load_tokenizer

__all__ = ["check_teacher_key", "check_teachers"]


def check_teachers(cfg: RayRLConfig, student_tokenizer: Any) -> None:
    """Every teacher's model path exists and its vocabulary is the student's."""
    if not cfg.distillation.enabled:
        return
    student = student_tokenizer.get_vocab()
    for teacher in teachers(cfg.distillation).values():
        key = f"distillation.teacher_models.{teacher.entry}.model_path"
        check_model_path(teacher.model_path, key=key)
        vocab = load_tokenizer(
            teacher.model_path,
            key=key,
            trust_remote_code=cfg.actor_rollout_ref.model.trust_remote_code,
        ).get_vocab()
        if vocab != student:
            raise ConfigError(_mismatch(key, vocab, student))


def _mismatch(key: str, teacher: dict[str, int], student: dict[str, int]) -> str:
    differs = sorted(t for t in set(teacher) | set(student) if teacher.get(t) != student.get(t))
    token = differs[0]
    return (
        f"{key}: the teacher's tokenizer is not the student's ({len(differs)} token(s) "
        f"differ; {token!r} is id {teacher.get(token)} for the teacher, "
        f"{student.get(token)} for the student). The teacher scores the student's token "
        "ids, so both must share one vocabulary: distil from a teacher of the student's "
        "model family and tokenizer"
    )


def check_teacher_key(cfg: RayRLConfig, dataset: Any) -> None:
    """With several teachers, the training rows carry `distillation.teacher_key`: as a
    column, or in every row's `extra_info` (checked on the dataset's first row; a
    streamed dataset, which collates nothing up front, is checked by the teachers as
    rows come)."""
    from rayrl.workers.teacher import teacher_picks

    dist = cfg.distillation
    collate = getattr(dataset, "collate", None)
    if not dist.enabled or len(teachers(dist)) < 2 or collate is None:
        return
    rows = collate([0])
    if teacher_picks(rows, dist.teacher_key):
        return
    raise ConfigError(
        f"distillation.teacher_key={dist.teacher_key!r}: the training rows have no such "
        f"column ({', '.join(rows.keys())}) nor an extra_info entry of that name, so no row "
        "could pick its teacher; set it to data_source or to a key of the rows' extra_info"
    )
