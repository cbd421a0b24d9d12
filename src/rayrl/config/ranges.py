"""The range of every numeric config key, checked at load (`check_ranges`).

One table, `RANGES`: key -> `Range` (bounds, open or closed, the special values a key
also takes, such as -1 for "never" or null for "unset", and a note on what the key
means or verl's default). A value outside its range is refused before anything
starts, with a `ConfigError` naming the key, the value and the valid range, instead of
failing minutes later inside a worker. Rules between keys (batch sizes that must
divide each other, the rollout pool of asynchronous training, SAPO's temperatures)
stay in `rayrl.config.validate`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rayrl.config.errors import ConfigError

if TYPE_CHECKING:
    from rayrl.config.schema import RayRLConfig


@dataclass(frozen=True)
class Range:
    """Bounds of a numeric key: ``low``/``high`` (None: unbounded), each closed unless
    ``*_open``; ``also``: values allowed besides the range; ``note``: for the error."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    also: tuple[Any, ...] = ()
    note: str = ""

    def holds(self, value: object) -> bool:
        if any(value is a or (a is not None and value == a) for a in self.also):
            return True
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return False
        value = float(value)
        if math.isnan(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self) -> str:
        """The range in words: ">= 1", "> 0", "in (0, 1]", plus the special values."""
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            text = f"in {left}{_num(self.low)}, {_num(self.high)}{right}"
        elif self.low is not None:
            text = f"{'>' if self.low_open else '>='} {_num(self.low)}"
        else:
            assert self.high is not None, "every Range has a low or a high bound"
            text = f"{'<' if self.high_open else '<='} {_num(self.high)}"
        specials = [("null" if a is None else str(a)) for a in self.also]
        return text + (f" or {' or '.join(specials)}" if specials else "")


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def at_least(low: float, note: str = "", also: tuple[Any, ...] = ()) -> Range:
    return Range(low=low, also=also, note=note)


def positive(note: str = "", also: tuple[Any, ...] = ()) -> Range:
    return Range(low=0, low_open=True, also=also, note=note)


def fraction(note: str = "", also: tuple[Any, ...] = (), open_low: bool = False) -> Range:
    """[0, 1], or (0, 1] with ``open_low``."""
    return Range(low=0, high=1, low_open=open_low, also=also, note=note)


ACTOR = "actor_rollout_ref.actor"
ROLLOUT = "actor_rollout_ref.rollout"
UNSET = (None,)
COUNT = at_least(1)
COUNT_OR_UNSET = at_least(1, also=UNSET)
SECONDS = positive("seconds")
TOP_P = fraction(
    "the nucleus' probability mass; 1 keeps every token; verl's default 1.0", open_low=True
)
TOP_K = at_least(-1, "the most likely tokens kept; -1 or 0 keeps all; verl's default -1")
TEMPERATURE = at_least(0, "0 decodes greedily (the argmax of the logits); verl's default 1.0")


def _optim(group: str) -> dict[str, Range]:
    return {
        f"{group}.lr": at_least(0, "the learning rate; verl's default 1e-6"),
        f"{group}.weight_decay": at_least(0, "AdamW's decoupled weight decay; verl's default 0.01"),
        f"{group}.eps": positive("AdamW's epsilon; verl's default 1e-8"),
        f"{group}.lr_warmup_steps": at_least(-1, "-1: use lr_warmup_steps_ratio (verl's default)"),
        f"{group}.lr_warmup_steps_ratio": fraction("the share of the steps that warms up"),
        f"{group}.min_lr_ratio": fraction("the cosine schedule's floor, a share of lr"),
        f"{group}.num_cycles": at_least(0, "cosine cycles after warm-up; verl's default 0.5"),
        f"{group}.clip_grad": at_least(0, "the gradient norm clip; 0 disables; verl's default 1.0"),
    }


def _batches(group: str, keys: tuple[str, ...]) -> dict[str, Range]:
    return {f"{group}.{key}": COUNT_OR_UNSET for key in keys}


RANGES: dict[str, Range] = {
    # data
    "data.train_batch_size": COUNT,
    "data.gen_batch_size": COUNT_OR_UNSET,
    "data.val_batch_size": at_least(1, "null: all validation prompts at once", UNSET),
    "data.max_prompt_length": at_least(1, "tokens"),
    "data.max_response_length": at_least(1, "tokens"),
    "data.dataloader_num_workers": at_least(0),
    "data.synthetic_size": COUNT,
    "data.synthetic_val_size": at_least(0),
    # the actor, its rollout and the reference
    "actor_rollout_ref.model.lora_rank": at_least(0, "0: no LoRA"),
    # 0 is read only with LoRA off (verl's scripts pass lora_alpha=lora_rank=0); with
    # LoRA on it is refused by `rayrl.config.validate.check_lora`
    "actor_rollout_ref.model.lora_alpha": positive(
        "LoRA's scale numerator; verl's default 16", also=(0,)
    ),
    **_optim(f"{ACTOR}.optim"),
    **_batches(
        ACTOR, ("ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "ppo_micro_batch_size")
    ),
    f"{ACTOR}.ppo_max_token_len_per_gpu": COUNT,
    f"{ACTOR}.ppo_epochs": at_least(1, "passes over each step's samples; verl's default 1"),
    f"{ACTOR}.clip_ratio": at_least(0, "PPO's clip range; verl's default 0.2"),
    f"{ACTOR}.clip_ratio_low": at_least(0, "PPO's lower clip range; verl's default 0.2"),
    f"{ACTOR}.clip_ratio_high": at_least(0, "PPO's upper clip range; verl's default 0.2"),
    f"{ACTOR}.clip_ratio_c": Range(
        low=1, low_open=True, note="dual-clip's bound; verl's default 3.0"
    ),
    f"{ACTOR}.entropy_coeff": at_least(0, "the entropy bonus; 0 is off; verl's default 0"),
    f"{ACTOR}.kl_loss_coef": at_least(0, "the KL loss's weight; verl's default 0.001"),
    f"{ACTOR}.ulysses_sequence_parallel_size": COUNT,
    f"{ROLLOUT}.n": at_least(1, "samples per prompt"),
    f"{ROLLOUT}.temperature": TEMPERATURE,
    f"{ROLLOUT}.top_p": TOP_P,
    f"{ROLLOUT}.top_k": TOP_K,
    f"{ROLLOUT}.val_kwargs.n": at_least(1, "samples per validation prompt"),
    f"{ROLLOUT}.val_kwargs.temperature": Range(
        low=0, note="0 decodes greedily; verl's default for validation"
    ),
    f"{ROLLOUT}.val_kwargs.top_p": TOP_P,
    f"{ROLLOUT}.val_kwargs.top_k": TOP_K,
    **_batches(ROLLOUT, ("log_prob_micro_batch_size_per_gpu", "log_prob_micro_batch_size")),
    f"{ROLLOUT}.log_prob_max_token_len_per_gpu": COUNT,
    f"{ROLLOUT}.gpu_memory_utilization": fraction(
        "the share of each GPU the rollout engine may use (e.g. 0.5)", open_low=True
    ),
    f"{ROLLOUT}.max_num_seqs": COUNT,
    f"{ROLLOUT}.max_num_batched_tokens": COUNT,
    f"{ROLLOUT}.max_model_len": at_least(1, "null: prompt + response lengths", UNSET),
    **_batches(
        "actor_rollout_ref.ref", ("log_prob_micro_batch_size_per_gpu", "log_prob_micro_batch_size")
    ),
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": COUNT,
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": COUNT,
    "actor_rollout_ref.ref.expert_parallel_size": COUNT,
    "actor_rollout_ref.nccl_timeout": SECONDS,
    # the critic
    **_optim("critic.optim"),
    **_batches(
        "critic",
        (
            "ppo_mini_batch_size",
            "ppo_micro_batch_size_per_gpu",
            "forward_micro_batch_size_per_gpu",
            "ppo_micro_batch_size",
            "forward_micro_batch_size",
        ),
    ),
    "critic.ppo_max_token_len_per_gpu": COUNT,
    "critic.forward_max_token_len_per_gpu": COUNT,
    "critic.ppo_epochs": COUNT,
    "critic.cliprange_value": at_least(0, "the value clip range; verl's default 0.5"),
    "critic.ulysses_sequence_parallel_size": COUNT,
    # rewards
    "reward_model.micro_batch_size_per_gpu": COUNT_OR_UNSET,
    "reward_model.micro_batch_size": COUNT_OR_UNSET,
    "reward_model.max_length": at_least(1, "tokens; null: no limit", UNSET),
    "reward_model.score_scale": positive("the clip or tanh bound of the scores"),
    "reward_model.overlong_buffer.len": at_least(0, "tokens"),
    "reward_model.overlong_buffer.penalty_factor": at_least(0),
    "reward.http.timeout_s": SECONDS,
    "reward.http.retries": at_least(0),
    "reward.http.max_error_rate": fraction("null: reward.max_error_rate", UNSET),
    "reward.max_error_rate": fraction(
        "the failed fraction of the samples scored so far that stops the run; 1.0 never stops"
    ),
    "reward.timeout_s": SECONDS,
    "reward.sandbox_fusion.max_concurrent": at_least(1, "requests at once (verl's default 64)"),
    "reward.sandbox_fusion.memory_limit_mb": at_least(1, "MB per run (verl's default 1024)"),
    "reward.num_workers": at_least(1, "scoring processes"),
    "reward.workers_per_node": at_least(1, "reward workers on each node of the training pool"),
    "reward.cpus_per_worker": positive("CPUs of each reward worker's bundle"),
    # the algorithm
    "algorithm.gamma": fraction("the discount; verl's default 1.0"),
    "algorithm.lam": fraction("GAE's lambda; verl's default 1.0"),
    "algorithm.kl_ctrl.kl_coef": at_least(0, "the KL penalty's weight; verl's default 0.001"),
    "algorithm.kl_ctrl.horizon": COUNT,
    "algorithm.kl_ctrl.target_kl": positive(),
    "algorithm.filter_groups.max_num_gen_batches": at_least(0, "0: no limit"),
    "algorithm.rollout_correction.rollout_is_threshold": positive(),
    "algorithm.pf_ppo.weight_pow": at_least(0),
    # the trainer and resources
    "trainer.nnodes": COUNT,
    "trainer.n_gpus_per_node": COUNT,
    "trainer.total_training_steps": at_least(1, "null: total_epochs over the data", UNSET),
    "trainer.total_epochs": COUNT,
    "trainer.critic_warmup": at_least(0, "steps"),
    "trainer.save_freq": at_least(1, "steps between checkpoints; -1: never", (-1,)),
    "trainer.test_freq": at_least(1, "steps between validations; -1: never", (-1,)),
    "trainer.max_actor_ckpt_to_keep": at_least(1, "null: keep all", UNSET),
    "trainer.max_critic_ckpt_to_keep": at_least(1, "null: keep all", UNSET),
    "trainer.val_examples": at_least(0),
    "trainer.usage_interval_s": SECONDS,
    "trainer.stage_timeout_s": SECONDS,
    "trainer.max_worker_restarts": at_least(0),
    "trainer.snapshot_replicas": at_least(0, "copies of each step snapshot on other nodes"),
    "resources.wait_timeout_s": SECONDS,
    "resources.create_timeout_s": SECONDS,
    "resources.init_timeout_s": SECONDS,
    "resources.init_retries": at_least(0),
    "resources.capacity_factor": at_least(
        1, "1.0 reserves no spare bundles; 1.25 reserves a spare for every 4 workers"
    ),
    "resources.loader_workers": at_least(0),
    "resources.dashboard_port": Range(
        low=1, high=65535, note="the first port tried; the next free one above is taken"
    ),
}


def _get(cfg: object, path: str) -> Any:
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


def check_ranges(cfg: RayRLConfig, ranges: dict[str, Range] = RANGES) -> None:
    """Raise ConfigError for the first key of `ranges` whose value in `cfg` is outside
    its range: the key, the value, the range and the note."""
    for key, rule in ranges.items():
        value = _get(cfg, key)
        if not rule.holds(value):
            note = f": {rule.note}" if rule.note else ""
            raise ConfigError(
                f"{key}={value!r} is out of range: use a value {rule.describe()}{note}"
            )
