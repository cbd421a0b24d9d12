"""The typed configuration schema: one dataclass per group, verl's names where they exist.

The defaults describe the demo: a tiny model built on the fly, the synthetic
arithmetic task, GRPO, everything on the local machine. A YAML file and dotted
overrides change fields; `rayrl.config.load` merges and validates them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # parquet; empty: synthetic task
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    train_batch_size: int = 8  # prompts per step
    val_batch_size: int = 16
    max_prompt_length: int = 64
    max_response_length: int = 32
    truncation: str = "error"  # error | left | right
    filter_overlong_prompts: bool = True
    shuffle: bool = True
    dataloader_num_workers: int = 0
    synthetic_task: str = "arithmetic"  # used when train_files is empty
    synthetic_size: int = 512


@dataclass
class LoraConfig:
    rank: int = 0  # 0 disables LoRA
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )


@dataclass
class ModelConfig:
    path: str | None = None  # HF model directory; None: build the tiny demo model
    tokenizer_path: str | None = None  # defaults to path
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    attn_implementation: str = "sdpa"
    enable_gradient_checkpointing: bool = False
    use_remove_padding: bool = True  # sequence packing
    trust_remote_code: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class OptimConfig:
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    lr_scheduler: str = "constant"  # constant | cosine
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0


@dataclass
class FSDPConfig:
    param_offload: bool = False
    optimizer_offload: bool = False
    mixed_precision: bool = True  # bf16 compute, fp32 master weights (ignored on CPU)


@dataclass
class ActorConfig:
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    ppo_mini_batch_size: int = 4  # prompts per mini-batch (times rollout.n samples)
    ppo_micro_batch_size_per_gpu: int = 4  # samples per forward/backward on one rank
    use_dynamic_bsz: bool = False
    max_tokens_per_micro_batch: int = 4096
    ppo_epochs: int = 1
    shuffle: bool = False
    policy_loss: str = "ppo"
    loss_agg_mode: str = "token-mean"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    tis_cap: float | None = None  # truncated importance sampling cap (rollout vs train)


@dataclass
class RolloutConfig:
    engine: str = "hf"  # hf | native
    n: int = 4  # samples per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = True
    stop: list[str] = field(default_factory=list)
    log_prob_micro_batch_size_per_gpu: int = 8
    gpu_memory_utilization: float = 0.5
    val_temperature: float = 0.0


@dataclass
class RefConfig:
    enable: bool | None = None  # None: on when a KL term needs it
    log_prob_micro_batch_size_per_gpu: int = 8


@dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    hybrid_engine: bool = True


@dataclass
class CriticConfig:
    enable: bool | None = None  # None: on when the advantage estimator needs values (gae)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ppo_mini_batch_size: int = 4
    ppo_micro_batch_size_per_gpu: int = 4
    ppo_epochs: int = 1
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"


@dataclass
class RewardFunctionConfig:
    path: str | None = None  # a Python file with compute_score(...); None: built-in registry
    name: str = "compute_score"


@dataclass
class RewardHTTPConfig:
    url: str | None = None
    timeout_s: float = 30.0
    retries: int = 3


@dataclass
class RewardModelConfig:
    enable: bool = False
    path: str | None = None
    micro_batch_size_per_gpu: int = 8


@dataclass
class RewardConfig:
    function: RewardFunctionConfig = field(default_factory=RewardFunctionConfig)
    http: RewardHTTPConfig = field(default_factory=RewardHTTPConfig)
    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    timeout_s: float = 10.0  # per call of a rule-based function
    num_workers: int = 2


@dataclass
class KLControlConfig:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)


@dataclass
class TrainerConfig:
    device: str = "auto"  # auto | cpu | cuda
    nnodes: int = 1
    n_gpus_per_node: int = 1  # workers per node (processes on CPU)
    seed: int = 1
    total_steps: int | None = None  # None: total_epochs over the data
    total_epochs: int = 1
    output_dir: str = "outputs/demo"
    project_name: str = "rayrl"
    experiment_name: str = "demo"
    resume: str = "auto"  # auto | disable | a step directory
    save_freq: int = -1
    test_freq: int = -1
    logger: list[str] = field(default_factory=lambda: ["console"])


@dataclass
class ResourcesConfig:
    address: str | None = None  # Ray address; None: a local Ray started by rayrl
    wait_timeout_s: float = 60.0  # waiting for resources held by others
    create_timeout_s: float = 300.0  # worker processes start (imports included)
    capacity_factor: float = 1.0
    init_timeout_s: float = 600.0
    init_retries: int = 1
    cpus_per_worker: int = 1
    loader_workers: int = 0


@dataclass
class RayRLConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)

    @property
    def world_size(self) -> int:
        return self.trainer.nnodes * self.trainer.n_gpus_per_node


def schema_fields(cls: Any) -> dict[str, Any]:
    """Field name -> nested dataclass type (or None for a leaf) of a schema dataclass."""
    from dataclasses import fields, is_dataclass

    out: dict[str, Any] = {}
    for f in fields(cls):
        default = f.default_factory() if callable(f.default_factory) else f.default
        out[f.name] = type(default) if is_dataclass(default) else None
    return out
