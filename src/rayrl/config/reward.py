"""The reward's configuration groups: verl's `custom_reward_function` and `reward_model`
(top-level here; verl 0.9.1's `reward.custom_reward_function` and `reward.reward_model`
land there, `rayrl.config.compat`), and `reward.*`: the manager, the scoring processes,
a remote service, SandboxFusion, the error budget, placement, and the LLM judge
(`rayrl.config.judge`). Part of the schema (`rayrl.config.schema` imports them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rayrl.config.judge import JudgeConfig, JudgeRolloutConfig


@dataclass
class CustomRewardFunctionConfig:
    path: str | None = None  # a Python file with compute_score(...); None: built-in scorers
    name: str = "compute_score"
    reward_kwargs: dict[Any, Any] = field(
        default_factory=dict
    )  # extra keyword arguments of every call
    # Python callables given to `rayrl.GRPOTrainer(reward_funcs=...)`, pickled (base64 of
    # cloudpickle's bytes; `rayrl.rewards.callables`); set by that API, not by hand
    pickled: str | None = None


@dataclass
class RewardModelPathConfig:
    path: str | None = None  # a sequence-classification reward model directory


@dataclass
class OverlongBufferConfig:
    enable: bool = False  # DAPO's soft overlong penalty
    len: int = 0  # the last `len` tokens before max_response_length ramp the penalty
    penalty_factor: float = 0.0
    log: bool = False  # report reward/overlong_penalty/mean
    max_resp_len: int = "${data.max_response_length}"  # type: ignore[assignment]  # the limit


@dataclass
class RewardModelConfig:
    enable: bool = False
    model: RewardModelPathConfig = field(default_factory=RewardModelPathConfig)
    micro_batch_size_per_gpu: int | None = None  # None: 8 sequences per forward pass
    micro_batch_size: int | None = None  # verl's deprecated size for all GPUs together
    max_length: int | None = None
    score_transform: str = "none"  # none | clip | tanh (of the reward model's score)
    score_scale: float = 1.0  # clip to +-scale, or scale * tanh(score / scale)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    # A generative reward model (an LLM judge: with custom_reward_function.path, verl's
    # GenRM, or reward.judge.template) is served by this engine (`rayrl.config.judge`)
    rollout: JudgeRolloutConfig = field(default_factory=JudgeRolloutConfig)
    # The judge on a pool of its own (n_gpus_per_node x nnodes replicas); false: one
    # replica in each reward worker's process
    enable_resource_pool: bool = False
    n_gpus_per_node: int = 8  # judge replicas on each node of its pool (a GPU each, or CPUs)
    nnodes: int = 0  # nodes of the judge's pool


@dataclass
class RewardHTTPConfig:
    url: str | None = None
    timeout_s: float = 30.0
    retries: int = 3
    # the HTTP service's own budget; None: reward.max_error_rate
    max_error_rate: float | None = None


@dataclass
class RewardSandboxFusionConfig:
    """verl's SandboxFusion reward (`rayrl.rewards.code_sandbox`): with a url and no
    custom_reward_function, the code data sources (codecontests, apps, codeforces, taco)
    are scored by running each answer against its test cases on that server."""

    url: str | None = None  # the server's run_code endpoint, e.g. http://host:8080/run_code
    max_concurrent: int = 64  # requests at once from each reward worker
    memory_limit_mb: int = 1024  # each run's memory limit


@dataclass
class RewardManagerConfig:
    """How a reward function is called (verl's reward managers, `rayrl.rewards.managers`):
    naive or prime (one sample per call, in reward.num_workers processes), dapo (as naive,
    and a plain-number score is also reported as `acc`), batch (one call with the lists
    of a whole batch: compute_score(data_sources, solution_strs, ground_truths, extra_infos))."""

    name: str = "naive"


@dataclass
class RewardConfig:
    """How rewards are computed: verl 0.9.1's `reward.*` keys (the manager, the scoring
    processes, extra arguments) and rayrl's own (a remote service, timeouts, placement).
    verl's `reward.custom_reward_function` and `reward.reward_model` are the top-level
    `custom_reward_function` and `reward_model` groups here (`rayrl.config.compat`)."""

    reward_manager: RewardManagerConfig = field(default_factory=RewardManagerConfig)
    reward_kwargs: dict[Any, Any] = field(
        default_factory=dict
    )  # extra keyword arguments of every call
    http: RewardHTTPConfig = field(default_factory=RewardHTTPConfig)
    sandbox_fusion: RewardSandboxFusionConfig = field(default_factory=RewardSandboxFusionConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)  # the built-in LLM judge
    # The failed fraction of the samples scored so far (a function that raised, hung or
    # returned no finite number; an HTTP outage; a reward model's NaN) past which the
    # run stops (rayrl.rewards.budget); 1.0: never stop, failed samples score 0.
    max_error_rate: float = 0.5
    timeout_s: float = 10.0  # per call of a rule-based function (x samples for batch)
    # scoring processes of each reward worker (verl's default 8 is sized for a GPU node;
    # verl's older name: reward_model.num_workers)
    num_workers: int = 2
    # Reward workers on each node of the training pool (trainer.nnodes of them, where the
    # actor's ranks are): a step's rows are split over every reward worker, the rows of
    # the ranks on node k to the workers on node k. With a reward model on GPUs each
    # worker holds one GPU: a data-parallel rank of the reward model.
    workers_per_node: int = 1
    # CPUs of each reward worker's bundle (its scoring processes share them)
    cpus_per_worker: float = 1.0
    # On a CPU-only run of one actor rank with a rule-based or HTTP reward, score in the
    # actor's process (its bundle gets the reward's CPU) instead of a process of its own.
    colocate: bool = True
