"""On-policy distillation's configuration: verl 0.9.1's `distillation.*` keys.

A teacher model scores every token the student sampled with its log-prob; the student
trains on a per-token divergence to the teacher (`rayrl.algos.distill`), alone
(`distillation_loss.use_task_rewards=false`) or beside the task's policy loss.

rayrl's departure from verl: the teacher scores on rayrl's training engine, not on a
rollout engine. Scoring given tokens is one forward pass over prompt and response (a
prefill); a rollout engine's machinery (a KV cache kept across decode steps, decode
graphs, sampling) does nothing for it, while the training engine's forward brings
token-budget micro-batches, packing, sequence parallelism, FSDP sharding of a teacher
larger than one GPU, and the student's own log-prob numerics (a teacher equal to the
student is at divergence 0 exactly). So the teachers' `inference.*` keys are read for
nothing but are accepted; the teacher's forward takes `actor_rollout_ref.ref`'s
`fsdp_config` and log-prob micro-batch settings. `n_gpus_per_node` x `nnodes` > 0
gives the teachers a pool of their own; 0 (verl's `nnodes` default) puts them in the
actor's processes, beside the reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DEFAULT_TEACHER",
    "DistillationConfig",
    "DistillationLossConfig",
    "Teacher",
    "teacher_pool_size",
    "teachers",
]

DEFAULT_TEACHER = "teacher_model"  # verl's single-teacher entry
TEACHER_KEYS = ("key", "model_path", "num_replicas", "inference")


def _default_teachers() -> dict[str, Any]:
    """verl's `teacher_models` default: one entry, `teacher_model`, not configured."""
    return {DEFAULT_TEACHER: {"key": None, "model_path": None, "num_replicas": 0, "inference": {}}}


@dataclass
class DistillationLossConfig:
    """verl's `distillation.distillation_loss`: which divergence, and how it trains.
    verl's `topk` and `log_prob_min_clamp` (of forward_kl_topk), `clip_ratio` (rayrl
    reads the low and high ones) and `policy_loss_mode` (vanilla only) are compat rules."""

    # k1 (kl), abs, k2 (mse), k3 (low_var_kl): per-token estimators of the reverse KL
    # from the sampled token's log-probs (forward_kl_topk, verl's top-k forward KL, is
    # refused: the engines return no top-k log-probs yet)
    loss_mode: str = "k3"
    # the task's policy loss (and its entropy and KL terms) beside the distillation term
    use_task_rewards: bool = True
    distillation_loss_coef: float = 1.0  # the term's weight beside the task's loss
    loss_max_clamp: float | None = None  # each token's divergence clamped to +-this
    # true: the negative divergence is each token's advantage in a clipped policy loss
    # (Thinking Machines' on-policy distillation; k1 recommended); false: the
    # divergence itself is the loss, backpropagated (k3); the policy loss is PPO's clipped
    # one (verl's vanilla, its only choice)
    use_policy_gradient: bool = False
    clip_ratio_low: float = 0.2  # use_policy_gradient: the ratio's clip below, 1 - this
    clip_ratio_high: float = 0.2  # ... and above, 1 + this


@dataclass
class DistillationConfig:
    """On-policy distillation (verl's `distillation` group): teachers score each sampled
    token; the student trains on its divergence to them. The teachers run on rayrl's
    training engine with `actor_rollout_ref.ref`'s FSDP and micro-batch settings."""

    # a teacher scores every sampled token; the student trains toward it
    enabled: bool = False
    distillation_loss: DistillationLossConfig = field(default_factory=DistillationLossConfig)
    n_gpus_per_node: int = 8  # the teachers' own pool, with nnodes > 0
    nnodes: int = 0  # 0: the teachers live in the actor's processes
    # teacher entry name -> {key, model_path, num_replicas, inference}; one entry named
    # teacher_model is the single teacher (its key is `default`); with others beside it,
    # it is dropped, as verl drops it, and each teacher scores the rows whose
    # `teacher_key` column equals its `key`
    teacher_models: dict[Any, Any] = field(default_factory=_default_teachers)
    # what picks a row's teacher: a column of the rows (data_source) or an extra_info entry
    teacher_key: str = "data_source"


@dataclass(frozen=True)
class Teacher:
    """One resolved teacher: the rows it scores (`key`) and its model."""

    key: str
    model_path: str
    entry: str  # its name under distillation.teacher_models (for messages)


def teachers(cfg: DistillationConfig) -> dict[str, Teacher]:
    """The teachers by key, as verl resolves `teacher_models`: the lone `teacher_model`
    entry scores every row (key `default`); beside others it is dropped, and each of the
    others needs a key and a model path. Raises ValueError naming the key to set."""
    entries = dict(cfg.teacher_models or {})
    if not entries:
        raise ValueError(
            "distillation.enabled=true needs a teacher: set "
            f"distillation.teacher_models.{DEFAULT_TEACHER}.model_path=PATH"
        )
    if set(entries) == {DEFAULT_TEACHER}:
        entry = _entry(entries[DEFAULT_TEACHER], DEFAULT_TEACHER)
        return {"default": Teacher("default", _path(entry, DEFAULT_TEACHER), DEFAULT_TEACHER)}
    entries.pop(DEFAULT_TEACHER, None)
    found: dict[str, Teacher] = {}
    for name, raw in entries.items():
        entry = _entry(raw, name)
        key = entry.get("key")
        if key is None:
            raise ValueError(
                f"distillation.teacher_models.{name}.key is not set: with several teachers "
                f"each scores the rows whose `{cfg.teacher_key}` equals its key; set it"
            )
        if str(key) in found:
            raise ValueError(
                f"distillation.teacher_models: teachers {found[str(key)].entry} and {name} "
                f"share the key {key!r}; give each teacher its own key"
            )
        found[str(key)] = Teacher(str(key), _path(entry, name), name)
    return found


def _entry(raw: Any, name: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ValueError(
            f"distillation.teacher_models.{name} must be a mapping with model_path (and key "
            f"with several teachers), got {raw!r}"
        )
    unknown = sorted(set(raw) - set(TEACHER_KEYS) - {"_target_"})
    if unknown:
        raise ValueError(
            f"distillation.teacher_models.{name}: unknown key(s) {', '.join(unknown)}; a "
            f"teacher takes {', '.join(TEACHER_KEYS)}"
        )
    return raw


def _path(entry: dict[str, Any], name: str) -> str:
    path = entry.get("model_path")
    if not path:
        raise ValueError(
            f"distillation.teacher_models.{name}.model_path is not set: point it at the "
            "teacher model's directory (a Hugging Face checkpoint with the student's tokenizer)"
        )
    return str(path)


def teacher_pool_size(cfg: DistillationConfig) -> int:
    """The ranks of the teachers' own pool; 0: they live in the actor's processes."""
    if not cfg.enabled or cfg.nnodes <= 0:
        return 0
    return cfg.n_gpus_per_node * cfg.nnodes
