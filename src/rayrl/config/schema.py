"""The typed configuration schema: one dataclass per group, with verl's names and defaults.

A key verl has keeps verl's name, meaning and default (verl's `ppo_trainer.yaml`), so
verl command lines mean here what they mean there; `rayrl.config.compat` lists verl
keys accepted with no effect. Departures from verl's defaults, each for a reason:

- `trainer.device` is `auto` (cuda when the cluster has GPUs, else cpu).
- `trainer.logger` is `[console]`: wandb needs an account and a network.
- `model.path` None builds the tiny demo model; `data.train_files` empty uses the
  synthetic task (verl's defaults are placeholder paths).
- `rollout.name` is `auto`: rayrl's `native` engine on a GPU for the models it runs,
  else `hf` (verl's names `vllm` / `sglang` mean `auto` too).
- `data.seed` None seeds the data order from `trainer.seed` (verl: unseeded).
- `reward.num_workers` is 2 (verl 0.9.1: 8) and `trainer.val_examples`, verl's
  `trainer.log_val_generations`, is 8 (verl: 0).
- `trainer.output_dir` is the run directory; verl's `trainer.default_local_dir` sets it
  (checkpoints go to its `checkpoints/global_step_N`, verl's to `global_step_N`).

A value written `"${group.key}"` follows that key unless set, as in verl (the critic's
mini-batch size follows the actor's, ...). The built-in configs
(`src/rayrl/config/*.yaml`) hold the demo's small values. Keys without a verl
counterpart are rayrl's own (`resources.*`, `reward.*`, `data.synthetic_*`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rayrl.config.async_training import (  # part of the schema: re-exported
    WEIGHT_TRANSPORTS as WEIGHT_TRANSPORTS,
)
from rayrl.config.async_training import (
    AsyncTrainingConfig as AsyncTrainingConfig,
)
from rayrl.config.async_training import (
    RolloutPoolConfig as RolloutPoolConfig,
)
from rayrl.config.distill import DistillationConfig
from rayrl.config.multi_turn import AgentConfig, MultiTurnConfig
from rayrl.config.profiler import ProfilerConfig
from rayrl.config.reward import (  # part of the schema: re-exported
    CustomRewardFunctionConfig as CustomRewardFunctionConfig,
)
from rayrl.config.reward import (
    OverlongBufferConfig as OverlongBufferConfig,
)
from rayrl.config.reward import (
    RewardConfig as RewardConfig,
)
from rayrl.config.reward import (
    RewardHTTPConfig as RewardHTTPConfig,
)
from rayrl.config.reward import (
    RewardManagerConfig as RewardManagerConfig,
)
from rayrl.config.reward import (
    RewardModelConfig as RewardModelConfig,
)
from rayrl.config.reward import (
    RewardModelPathConfig as RewardModelPathConfig,
)
from rayrl.config.reward import (
    RewardSandboxFusionConfig as RewardSandboxFusionConfig,
)

_ACTOR = "actor_rollout_ref.actor"


@dataclass
class CustomDatasetConfig:
    """A dataset class of one's own (verl's `data.custom_cls`, `rayrl.data.custom`)."""

    path: str | None = None  # a Python file (or pkg://module) defining the class
    name: str | None = None  # the class's name in it


@dataclass
class SamplerConfig:
    """A sampler class of one's own (`data.sampler` of verl versions other than 0.9.1,
    `rayrl.data.sampler`): the order of the training rows."""

    class_path: str | None = None  # a Python file (or pkg://module) defining the class
    class_name: str | None = None  # the class's name in it


@dataclass
class DataConfig:
    train_files: Any = field(default_factory=list)  # a path or a list; empty: synthetic task
    val_files: Any = field(default_factory=list)
    prompt_key: str = "prompt"
    train_batch_size: int = 1024  # prompts per step
    gen_batch_size: int | None = None  # prompts per extra generation round (dynamic sampling)
    val_batch_size: int | None = None
    max_prompt_length: int = 512
    max_response_length: int = 512
    truncation: str = "error"  # error | left | right
    filter_overlong_prompts: bool = False
    shuffle: bool = True
    seed: int | None = None  # the shuffle's seed; None: trainer.seed (verl: unseeded)
    dataloader_num_workers: int = 8
    synthetic_task: str = "arithmetic"  # used when train_files is empty
    synthetic_size: int = 512
    synthetic_val_size: int = 32  # held-out rows of the synthetic task (when no val_files)
    synthetic_images: bool = True  # false: a visual task's rows without images (a control)
    loader: str = "default"  # default (in memory) | ray (Ray Data: parallel read, streamed)
    # extra arguments of the chat template for prompts and multi-turn episodes
    # (e.g. {reasoning_effort: medium} for gpt-oss, {enable_thinking: false} for Qwen3)
    apply_chat_template_kwargs: dict[Any, Any] = field(default_factory=dict)
    # the column of a row's images (verl's): entries as bytes, paths or dicts of them, one
    # per `<image>` in the prompt; they need a vision-language model's processor (rayrl.data.vision)
    image_key: str = "images"
    # the column of a row's videos (verl's); rayrl reads no videos yet: such rows are set aside
    video_key: str = "videos"
    # options of the image processor (verl's): min_pixels / max_pixels bound each image,
    # the others go to the processor call as they are (rayrl.data.vision)
    mm_processor_kwargs: dict[Any, Any] = field(default_factory=dict)
    custom_cls: CustomDatasetConfig = field(default_factory=CustomDatasetConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)


@dataclass
class FSDPConfig:
    param_offload: bool = False
    optimizer_offload: bool = False
    model_dtype: str = "fp32"  # master weights: fp32 | bf16 | fp16
    dtype: str = "bfloat16"  # compute dtype on GPU: bfloat16 (mixed precision) | float32
    # One GPU: wrap in FSDP2 too (bf16 compute weights cast once per micro-batch, fp32
    # master weights) instead of autocast. Faster than autocast at large micro-batches,
    # slower at verl's default token budget (docs/benchmarks.md): off by default.
    wrap_one_gpu: bool = False
    # ranks per sharding group: -1 shards over every rank; a divisor of the world below it
    # (e.g. trainer.n_gpus_per_node) shards within groups and replicates across them (HSDP)
    fsdp_size: int = -1


@dataclass
class RefFSDPConfig:
    param_offload: bool = False
    # None (verl's default): bf16 weights where compute is bf16 on a GPU, else fp32
    model_dtype: str | None = None
    dtype: str = "bfloat16"
    # as the actor's: the reference then takes its shards from the actor's load as they are
    fsdp_size: int = f"${{{_ACTOR}.fsdp_config.fsdp_size}}"  # type: ignore[assignment]


@dataclass
class ModelConfig:
    path: str | None = None  # HF model directory; None: build the tiny demo model
    tokenizer_path: str | None = None  # defaults to path
    trust_remote_code: bool = False
    attn_implementation: str = "sdpa"
    enable_gradient_checkpointing: bool = True
    use_remove_padding: bool = True  # sequence packing
    # rows with the same prompt (the n samples of one) run it once in training and
    # log-prob passes, packed with their responses (`rayrl.train.shared_prompts`):
    # true, false, or auto (on a GPU, where a packed row is one attention kernel; on a
    # CPU its segments attend one by one, slower than the prompts they save)
    share_prompts: Any = "auto"
    lora_rank: int = 0  # 0 disables LoRA
    lora_alpha: int = 16
    target_modules: Any = "all-linear"  # "all-linear" or a list of module names
    exclude_modules: Any = None  # modules without adapters: a regex or a list of names
    # values set on the HF model config of every role that builds this model (actor,
    # reference, rollout; the critic's own): `rayrl.models.config_overrides`
    override_config: dict[Any, Any] = field(default_factory=dict)
    # a Jinja chat template that replaces the tokenizer's for prompts and multi-turn
    # episodes (the exported hf/ directory keeps the model's own)
    custom_chat_template: str | None = None


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    lr_scheduler_type: str = "constant"  # constant | cosine
    lr_warmup_steps: int = -1  # < 0: lr_warmup_steps_ratio x total training steps
    lr_warmup_steps_ratio: float = 0.0
    min_lr_ratio: float = 0.0
    num_cycles: float = 0.5  # cosine cycles over the run (0.5: one half-cosine decay)
    clip_grad: float = 1.0


@dataclass
class PolicyLossConfig:
    loss_mode: str = "vanilla"  # vanilla (PPO) | gspo | reinforce | gpg | geo_mean | cispo | sapo


@dataclass
class RouterReplayConfig:
    # mixture-of-experts models (rayrl.train.router_replay): disabled | R2 (the log-prob
    # pass records the router's experts, the update replays them) | R3 (both replay the
    # rollout's record: rollout.enable_rollout_routing_replay)
    mode: str = "disabled"


@dataclass
class ActorConfig:
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    ppo_mini_batch_size: int = 256  # prompts per mini-batch (times rollout.n samples)
    ppo_micro_batch_size_per_gpu: int | None = None  # samples per forward/backward
    ppo_micro_batch_size: int | None = None  # verl's deprecated size for all GPUs together
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384  # token budget of a micro-batch (dynamic)
    ppo_epochs: int = 1
    shuffle: bool = False  # reshuffle the rows before each epoch's mini-batches
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    loss_agg_mode: str = "token-mean"
    clip_ratio: float = 0.2  # both bounds, unless clip_ratio_low / clip_ratio_high are set
    clip_ratio_low: float = "${.clip_ratio}"  # type: ignore[assignment]
    clip_ratio_high: float = "${.clip_ratio}"  # type: ignore[assignment]  # DAPO: e.g. 0.28
    clip_ratio_c: float = 3.0
    tau_pos: float = 1.0  # SAPO's gate temperature where the advantage is positive
    tau_neg: float = 1.05  # ... and where it is not
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    # on CUDA: compile each decoder layer and the log-prob head's chunk math (regional
    # torch.compile, `rayrl.train.regional_compile`; figures in docs/benchmarks.md);
    # ignored on a CPU, where compile time would dominate
    use_torch_compile: bool = True
    # ranks that split each packed row's tokens (Ulysses; 1: off): must divide the world
    # and the model's attention heads; the data-parallel size is the world over it
    ulysses_sequence_parallel_size: int = 1
    # ranks that split a mixture-of-experts model's experts (1: off;
    # `rayrl.train.expert_parallel`): must divide the world and the model's experts
    expert_parallel_size: int = 1
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)
    # a vision-language model's vision tower gets no gradients and no optimizer state
    freeze_vision_tower: bool = False
    # the log-prob pass also returns each token's sum over the vocabulary of squared
    # probabilities (`sum_pi_squared`): algorithm.adv_estimator=optimal_token_baseline
    # reads it, and the step reports verl's variance_proxy/* metrics from it
    calculate_sum_pi_squared: bool = False


@dataclass
class SamplingConfig:
    top_k: int = -1
    top_p: float = 1.0
    temperature: float = 0.0
    n: int = 1
    do_sample: bool = False


@dataclass
class RolloutConfig:
    name: str = "auto"  # auto | hf | native (auto: native on a GPU where it runs the model)
    n: int = 1  # samples per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = True
    ignore_eos: bool = False  # training responses run to max_response_length (benchmarks)
    # the rollout's log-probs of its samples are kept (rollout correction needs them) and
    # compared with the actor's: training/rollout_probs_diff_* metrics
    calculate_log_probs: bool = True
    log_prob_micro_batch_size_per_gpu: int | None = None
    log_prob_micro_batch_size: int | None = None  # verl's deprecated size for all GPUs
    log_prob_use_dynamic_bsz: bool = f"${{{_ACTOR}.use_dynamic_bsz}}"  # type: ignore[assignment]
    log_prob_max_token_len_per_gpu: int = f"${{{_ACTOR}.ppo_max_token_len_per_gpu}}"  # type: ignore[assignment]
    val_kwargs: SamplingConfig = field(default_factory=SamplingConfig)
    # native engine (verl's vLLM keys, verl's defaults): the GPU share for weights + KV
    # cache, batch slots, prompt tokens per prefill step, no CUDA graphs, longest prompt +
    # response (None: data.max_prompt_length + data.max_response_length), and whether
    # the KV cache is released between generations (sleep/wake)
    gpu_memory_utilization: float = 0.5
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 8192
    enforce_eager: bool = False
    max_model_len: int | None = None
    free_cache_engine: bool = True
    # native engine: full KV blocks found again by the tokens they hold (a prompt seen
    # before, an episode recomputed after a preemption); rollout/prefix_cache_hit_rate
    enable_prefix_caching: bool = True
    # native engine, mixture-of-experts models: record the experts each token was routed
    # to (routed_experts), for the actor to replay (router_replay.mode=R3) and compare
    # (actor/routing_mismatch_frac)
    enable_rollout_routing_replay: bool = False
    # native engine: GPUs one model copy is split over (tensor parallelism; verl's key, not
    # effective for hf). verl's yaml says 2, and verl then refuses one-GPU runs; rayrl
    # keeps 1 so a run that fits one GPU needs no setting (TP changes speed and memory,
    # not the samples: rayrl.rollout.native.tp)
    tensor_model_parallel_size: int = 1
    # native engine: fp8 keeps the dense layers' matrices in FP8 (e4m3, a scale per
    # output row), quantized at every weight sync; matmuls in FP8 where the GPU has FP8
    # tensor cores, emulated elsewhere. Truncated importance sampling is then on by
    # default (algorithm.rollout_correction.rollout_is=token; rayrl.rollout.native.fp8)
    quantization: str | None = None
    # agents: multi-turn episodes with tools (verl's keys; `rayrl.config.multi_turn`)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    # sync: generation inside each step, on the training workers (the hybrid engine);
    # async: rollout replicas on a pool of their own generate while the trainer trains
    # (the top-level `rollout` and `async_training` groups; `rayrl.trainer.async_ppo`)
    mode: str = "sync"


@dataclass
class RefConfig:
    enable: bool | None = None  # None: on when a KL term needs it
    fsdp_config: RefFSDPConfig = field(default_factory=RefFSDPConfig)
    log_prob_micro_batch_size_per_gpu: int | None = None
    log_prob_micro_batch_size: int | None = None  # verl's deprecated size for all GPUs
    log_prob_use_dynamic_bsz: bool = f"${{{_ACTOR}.use_dynamic_bsz}}"  # type: ignore[assignment]
    log_prob_max_token_len_per_gpu: int = f"${{{_ACTOR}.ppo_max_token_len_per_gpu}}"  # type: ignore[assignment]
    use_torch_compile: bool = f"${{{_ACTOR}.use_torch_compile}}"  # type: ignore[assignment]
    ulysses_sequence_parallel_size: int = f"${{{_ACTOR}.ulysses_sequence_parallel_size}}"  # type: ignore[assignment]
    # ranks that split a mixture-of-experts reference's experts, as the actor's do
    # (`rayrl.train.expert_parallel`); the actor's size unless set, as verl's reference
    # takes the actor's ulysses_sequence_parallel_size (verl's FSDP reference has no such
    # key): must divide the world and the model's experts
    expert_parallel_size: int = f"${{{_ACTOR}.expert_parallel_size}}"  # type: ignore[assignment]


@dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    nccl_timeout: float = 600.0  # s; the process group's collectives (gloo too) time out


@dataclass
class CriticModelConfig:
    path: str | None = None  # None: the actor's model
    tokenizer_path: str | None = None
    trust_remote_code: bool = "${actor_rollout_ref.model.trust_remote_code}"  # type: ignore[assignment]
    attn_implementation: str = "sdpa"
    enable_gradient_checkpointing: bool = True
    use_remove_padding: bool = False
    share_prompts: Any = "${actor_rollout_ref.model.share_prompts}"
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    override_config: dict[Any, Any] = field(default_factory=dict)  # set on the critic's HF config


def _critic_optim() -> OptimConfig:
    return OptimConfig(lr=1e-5)


@dataclass
class CriticConfig:
    enable: bool | None = None  # None: on when the advantage estimator needs values (gae)
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    optim: OptimConfig = field(default_factory=_critic_optim)
    ppo_mini_batch_size: int = f"${{{_ACTOR}.ppo_mini_batch_size}}"  # type: ignore[assignment]
    ppo_micro_batch_size_per_gpu: int | None = None
    forward_micro_batch_size_per_gpu: int | None = "${.ppo_micro_batch_size_per_gpu}"  # type: ignore[assignment]
    # verl's deprecated sizes for all GPUs together
    ppo_micro_batch_size: int | None = None
    forward_micro_batch_size: int | None = "${.ppo_micro_batch_size}"  # type: ignore[assignment]
    use_dynamic_bsz: bool = f"${{{_ACTOR}.use_dynamic_bsz}}"  # type: ignore[assignment]
    ppo_max_token_len_per_gpu: int = 32768
    forward_max_token_len_per_gpu: int = "${.ppo_max_token_len_per_gpu}"  # type: ignore[assignment]
    ppo_epochs: int = f"${{{_ACTOR}.ppo_epochs}}"  # type: ignore[assignment]
    shuffle: bool = f"${{{_ACTOR}.shuffle}}"  # type: ignore[assignment]
    cliprange_value: float = 0.5
    loss_agg_mode: str = f"${{{_ACTOR}.loss_agg_mode}}"
    ulysses_sequence_parallel_size: int = 1


@dataclass
class KLControlConfig:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@dataclass
class FilterGroupsConfig:
    enable: bool = False  # DAPO's dynamic sampling
    metric: str | None = None  # score | seq_reward | a reward extra such as acc
    max_num_gen_batches: int = 0  # <= 0: no bound


@dataclass
class RolloutCorrectionConfig:
    rollout_is: str | None = None  # None | token | sequence
    rollout_is_threshold: float = 2.0
    # verl's: divide the weights by their mean over the training batch (mean 1)
    rollout_is_batch_normalize: bool = False
    # verl's rejection sampling (`rayrl.algos.rejection`): tokens or whole responses whose
    # rollout/training log-probs diverge beyond the threshold leave the loss. Options,
    # comma-separated: token_k1..k3, seq_sum_k1..k3, seq_mean_k1..k3, seq_max_k2/k3
    rollout_rs: str | None = None
    # one entry for all options or one per option, comma-separated; a k1 option takes
    # lower_upper ratio bounds (0.5_2.0; one number u means 1/u_u), the others an upper
    # bound. Write bounds with a decimal point or quote them: YAML reads 1_2 as 12.
    rollout_rs_threshold: str | float | int | None = None
    # verl's bypass mode: the rollout's log-probs serve as the old ones (no separate pass);
    # loss_type ppo_clip (the ratio to the rollout, no extra weights) or reinforce
    # (-A * log_prob weighted by the truncated current/rollout ratio)
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"


@dataclass
class PFPPOConfig:
    reweight_method: str = "pow"  # pow | max_min | max_random
    weight_pow: float = 2.0  # the exponent of `pow`


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    mask_truncated_samples: bool = False  # DAPO: no loss on responses cut at the length limit
    use_pf_ppo: bool = False  # PF-PPO: resample the batch by score after GAE (verl: gae only)
    pf_ppo: PFPPOConfig = field(default_factory=PFPPOConfig)


@dataclass
class TrainerConfig:
    device: str = "auto"  # auto | cpu | cuda
    nnodes: int = 1
    n_gpus_per_node: int = 8  # workers per node (processes on CPU)
    seed: int = 1
    total_training_steps: int | None = None  # None: total_epochs over the data
    total_epochs: int = 30
    critic_warmup: int = 0  # steps that train only the critic
    balance_batch: bool = True  # reorder rows so every data-parallel rank gets ~equal tokens
    rows_on_workers: bool = True  # a step's token columns stay with the workers (kept.py)
    # one directory per experiment (as verl's checkpoints/${project}/${experiment}): two
    # experiments never share one by default; the same one run again resumes there
    output_dir: str = "outputs/${.project_name}/${.experiment_name}"
    project_name: str = "verl_examples"
    experiment_name: str = "gsm8k"
    resume_mode: str = "auto"  # auto | disable | resume_path
    resume_from_path: str | None = None
    # what a resume does when the run differs from its checkpoint's (model, data files,
    # batch geometry, algorithm): strict refuses, warn goes on saying what changed
    resume_check: str = "strict"
    save_freq: int = -1
    test_freq: int = -1
    val_before_train: bool = True
    val_only: bool = False  # validate the starting model, then stop (no training, no export)
    max_actor_ckpt_to_keep: int | None = None
    max_critic_ckpt_to_keep: int | None = None
    logger: Any = field(default_factory=lambda: ["console"])  # a name or a list
    # the tensorboard tracker's event directory; None: $TENSORBOARD_DIR (verl's), else
    # OUTPUT_DIR/tensorboard
    tensorboard_dir: str | None = None
    # example generations written per validation (val_generations/); verl's name:
    # trainer.log_val_generations (verl's default 0 logs none)
    val_examples: int = 8
    # verl's: every training step's samples (prompt, response, score, uid, policy
    # version, an agent's turns) as JSON Lines, <dir>/<step>.jsonl; None: not kept.
    # Relative: from the working directory (`rayrl.trainer.generations`)
    rollout_data_dir: str | None = None
    # verl's: every validation's samples, all of them, as <dir>/<step>.jsonl (the
    # fields of rollout_data_dir's); None: only val_generations/'s val_examples
    validation_data_dir: str | None = None
    export_hf: bool = True  # write hf/ (a transformers model directory) at the end
    log_worker_output: bool = True  # worker prints reach the driver, prefixed role/rank
    debug: bool = False  # Ray distributed debugger: breakpoint() in workers, post-mortem
    debugger: str = "vscode"  # vscode (debugpy, the VS Code extension) | cli (`ray debug`)
    usage_interval_s: float = 0.5  # CPU/GPU/memory sampling period of every worker
    stage_timeout_s: float | None = 900.0  # a call without progress this long is hung
    max_worker_restarts: int = 3  # replacements of one rank within a step; 0: no recovery
    # state kept at every step boundary, for step replay: true | false | auto (on while
    # the trainable state, Adam moments included, fits half of Ray's object store; a 7B
    # model's is ~90 GB of host memory per step). Off: a lost worker rewinds to the last
    # checkpoint
    step_snapshots: Any = "auto"
    # copies of each rank's step snapshot on other nodes (0: none): the loss of a node
    # then costs one step instead of a rewind to the last checkpoint; each copy takes
    # as much object store on its buddy node as the snapshot on its own (counted by
    # step_snapshots=auto)
    snapshot_replicas: int = 0


@dataclass
class ResourcesConfig:
    address: str | None = None  # Ray address; None: a local Ray started by rayrl
    wait_timeout_s: float = 60.0  # waiting for resources held by others
    create_timeout_s: float = 300.0  # worker processes start (imports included)
    capacity_factor: float = 1.0
    init_timeout_s: float = 600.0
    init_retries: int = 1
    # CPUs of each model worker's bundle: a number, or auto (GPU runs: about two thirds of
    # a node's CPUs shared among its GPU workers, the rest left to Ray, the driver and
    # the reward; CPU-only runs: 1, each rank being its own worker)
    cpus_per_worker: Any = "auto"
    # the GPU share of each training worker's bundle: 0.5 lets a rollout replica of
    # `rollout.mode=async` (rollout.gpus_per_replica=0.5) share its GPU
    gpus_per_worker: float = 1.0
    loader_workers: int = 0
    dashboard: bool = True  # when rayrl starts Ray: the Ray dashboard, URL printed
    dashboard_host: str = "127.0.0.1"  # 0.0.0.0 exposes it to the network
    dashboard_port: int = 8265


@dataclass
class RayRLConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(
        default_factory=CustomRewardFunctionConfig
    )
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    rollout: RolloutPoolConfig = field(default_factory=RolloutPoolConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    global_profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    distillation: DistillationConfig = field(default_factory=DistillationConfig)

    @property
    def world_size(self) -> int:
        return self.trainer.nnodes * self.trainer.n_gpus_per_node

    @property
    def asynchronous(self) -> bool:
        """Asynchronous training: `actor_rollout_ref.rollout.mode=async` with a rollout
        pool of its own (`rollout.n_gpus_per_node` >= 1)."""
        return self.actor_rollout_ref.rollout.mode == "async" and self.rollout.n_gpus_per_node > 0


def schema_fields(cls: Any) -> dict[str, Any]:
    """Field name -> nested dataclass type (or None for a leaf) of a schema dataclass."""
    from dataclasses import fields, is_dataclass

    out: dict[str, Any] = {}
    for f in fields(cls):
        default = f.default_factory() if callable(f.default_factory) else f.default
        out[f.name] = type(default) if is_dataclass(default) else None
    return out
