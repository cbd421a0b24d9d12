"""The config of `rayrl sft`: its schema (verl's SFT trainer names), loading and checks.

Supervised fine-tuning has its own schema, with the names and defaults of verl's
`sft_trainer.yaml` where verl has the key: `data.prompt_key` / `response_key` (with
`prompt_dict_keys` / `response_dict_keys` for nested columns), `data.train_batch_size`,
`data.micro_batch_size_per_gpu`, `data.max_length`, `data.truncation`,
`model.partial_pretrain`, `model.lora_rank`, `optim.lr`, `optim.lr_scheduler`,
`trainer.total_epochs`, `trainer.max_ckpt_to_keep`, ... It is loaded and checked like
`rayrl train`'s (`rayrl.config.load`): unknown keys are errors with a "did you mean",
verl keys for features rayrl lacks are dropped with a one-line warning, verl's
`trainer.default_local_dir` sets the run directory, `trainer.output_dir`, and verl
0.9.1's engine SFT trainer's names (`model.path`, `engine.*`, `optim.lr_scheduler_type`)
set rayrl's (`rayrl.config.compat.verl_sft`).

Departures from verl's defaults: `model.partial_pretrain` None builds the tiny demo
model and empty `data.train_files` trains on demonstrations of a synthetic task (the
demo's; verl has placeholder paths); `trainer.logger` is `[console]`; `trainer.device`
is `auto`. The built-in configs live in `config/sft/` (`rayrl sft -c demo`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rayrl.config.compat import apply_rules, map_bool_frequencies, rule_table
from rayrl.config.compat.verl_sft import RULES
from rayrl.config.errors import ConfigError
from rayrl.config.errors import warn as _warn
from rayrl.config.load import (
    as_str_list,
    check_keys,
    load_structured,
)
from rayrl.config.nulls import settle_nulls
from rayrl.config.paths import absolute_paths
from rayrl.config.schema import ResourcesConfig
from rayrl.config.validate import check_choice, check_cpus_per_worker, check_role_parallel

SFT_BUILTIN_DIR = Path(__file__).resolve().parent / "sft"
EACH_EPOCH = "after_each_epoch"  # a save or validation frequency: the steps of an epoch


@dataclass
class SFTMultiturnConfig:
    """verl's multi-turn SFT (`data.multiturn.*`): rows hold whole conversations (a
    list of chat messages under `messages_key`, tool schemas under `tools_key`); the loss
    covers the assistant messages only."""

    enable: bool = False
    messages_key: str = "messages"
    tools_key: str = "tools"


@dataclass
class SFTDataConfig:
    train_files: Any = field(default_factory=list)  # a path or a list; empty: synthetic task
    val_files: Any = field(default_factory=list)
    train_batch_size: int = 256  # sequences per optimizer step, all ranks together
    micro_batch_size_per_gpu: int = 4  # sequences per forward/backward (also validation)
    use_dynamic_bsz: bool = False  # micro-batches by a token budget instead
    max_token_len_per_gpu: int = 8192  # the token budget of a micro-batch (dynamic)
    train_max_samples: int = -1  # -1: every row
    val_max_samples: int = -1
    prompt_key: str = "question"  # a string (one user turn) or a list of chat messages
    response_key: str = "answer"
    prompt_dict_keys: Any = None  # keys into a nested prompt column, outermost first
    response_dict_keys: Any = None
    max_length: int = 1024  # prompt + response tokens
    truncation: str = "error"  # error | left | right
    apply_chat_template_kwargs: dict[Any, Any] = field(default_factory=dict)
    shuffle: bool = True  # a new order every epoch (seeded)
    synthetic_task: str = "larger"  # used when train_files is empty
    synthetic_size: int = 512
    synthetic_val_size: int = 64  # held-out rows (when no val_files)
    synthetic_correct_rate: float = 1.0  # share of demonstrations that are right
    synthetic_images: bool = True  # false: a visual task's rows without images (a control)
    # rows with images (a vision-language model): verl's image column, `<image>` in the prompt
    image_key: str = "images"
    mm_processor_kwargs: dict[Any, Any] = field(
        default_factory=dict
    )  # min_pixels / max_pixels, ...
    multiturn: SFTMultiturnConfig = field(default_factory=SFTMultiturnConfig)


@dataclass
class SFTFSDPConfig:
    model_dtype: str = "fp32"  # master weights: fp32 | bf16 | fp16
    dtype: str = "bfloat16"  # compute dtype on GPU: bfloat16 (mixed precision) | float32
    cpu_offload: bool = False  # with offload_params: weights and optimizer in host memory
    offload_params: bool = False
    # ranks per sharding group: -1 (or the world or more) all of them; a divisor of the
    # world below it shards within groups and replicates across them (HSDP)
    fsdp_size: int = -1


@dataclass
class SFTModelConfig:
    partial_pretrain: str | None = None  # HF model directory; None: the tiny demo model
    fsdp_config: SFTFSDPConfig = field(default_factory=SFTFSDPConfig)
    enable_gradient_checkpointing: bool = True
    trust_remote_code: bool = False
    attn_implementation: str = "sdpa"
    lora_rank: int = 0  # 0 disables LoRA
    lora_alpha: int = 16
    target_modules: Any = "all-linear"
    exclude_modules: Any = None  # modules without adapters: a regex or a list of names
    override_config: dict[Any, Any] = field(default_factory=dict)  # set on the HF model config


@dataclass
class SFTOptimConfig:
    lr: float = 1e-5
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.01
    lr_scheduler: str = "cosine"  # cosine | constant
    lr_warmup_steps: int = -1  # < 0: lr_warmup_steps_ratio x total steps
    lr_warmup_steps_ratio: float = 0.1
    min_lr_ratio: float = 0.0
    num_cycles: float = 0.5
    clip_grad: float = 1.0


@dataclass
class SFTTrainerConfig:
    device: str = "auto"  # auto | cpu | cuda
    nnodes: int = 1
    n_gpus_per_node: int = 8  # workers per node (processes on CPU)
    seed: int = 1
    total_epochs: int = 4
    total_training_steps: int | None = None  # None: total_epochs over the data
    output_dir: str = "outputs/${.project_name}/${.experiment_name}"  # one per experiment
    project_name: str = "gsm8k-sft"
    experiment_name: str = "test"
    logger: Any = field(default_factory=lambda: ["console"])
    # the tensorboard tracker's directory (as `rayrl train`'s): else $TENSORBOARD_DIR,
    # else OUTPUT_DIR/tensorboard
    tensorboard_dir: str | None = None
    # every N steps, or after_each_epoch (verl's SFT trainer's word); -1: never
    save_freq: Any = -1
    test_freq: Any = -1  # validation loss every N steps (and at the end) when val data exist
    max_ckpt_to_keep: int | None = None
    resume_mode: str = "auto"  # auto | disable | resume_path
    resume_from_path: str | None = None
    resume_check: str = "strict"  # strict | warn: a resume of a run that differs
    export_hf: bool = True  # hf/ at the end: a model directory `rayrl train` starts from
    log_worker_output: bool = True
    debug: bool = False
    debugger: str = "vscode"


class RankSizes:
    """The ranks of a run of one pool (`rayrl sft`, `rayrl rm`, `rayrl dpo`), from its
    `trainer.nnodes`, `trainer.n_gpus_per_node` and `ulysses_sequence_parallel_size`."""

    trainer: SFTTrainerConfig
    ulysses_sequence_parallel_size: int

    @property
    def world_size(self) -> int:
        return self.trainer.nnodes * self.trainer.n_gpus_per_node

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: the ranks of a sequence-parallel group share their rows."""
        return self.world_size // max(self.ulysses_sequence_parallel_size, 1)


@dataclass
class SFTConfig(RankSizes):
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    model: SFTModelConfig = field(default_factory=SFTModelConfig)
    optim: SFTOptimConfig = field(default_factory=SFTOptimConfig)
    use_remove_padding: bool = False  # sequence packing
    # Ulysses: ranks that split each packed row's tokens (verl's top-level key)
    ulysses_sequence_parallel_size: int = 1
    trainer: SFTTrainerConfig = field(default_factory=SFTTrainerConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)


_TABLE = rule_table(RULES, SFTConfig)


def sft_source_data(
    data: dict[str, Any], origin: str, warn: Callable[[str], None]
) -> dict[str, Any]:
    """What `load_sft_config` does with one source before merging it (`source_data`)."""
    try:
        data = apply_rules(data, _TABLE, warn)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (in {origin})") from None
    map_bool_frequencies(data)
    check_keys(data, SFTConfig, origin=origin)
    settle_nulls(data, SFTConfig, origin, warn)
    return data


def load_sft_config(
    source: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    validate: bool = True,
    warn: Callable[[str], None] = _warn,
) -> SFTConfig:
    """Defaults <- YAML file (a path, or a built-in name from `config/sft/`) <- dotted
    overrides, then checked (`validate_sft_config`)."""
    cfg = load_structured(
        SFTConfig,
        source,
        overrides,
        lambda d, origin: sft_source_data(d, origin, warn),
        builtin_dir=SFT_BUILTIN_DIR,
    )
    d = cfg.data
    d.train_files = as_str_list(d.train_files, "data.train_files")
    d.val_files = as_str_list(d.val_files, "data.val_files")
    for key in ("prompt_dict_keys", "response_dict_keys"):
        value = getattr(d, key)
        setattr(d, key, as_str_list(value, f"data.{key}"))
    cfg.trainer.logger = as_str_list(cfg.trainer.logger, "trainer.logger")
    modules = cfg.model.target_modules
    if not isinstance(modules, str):
        cfg.model.target_modules = as_str_list(modules, "model.target_modules")
    if validate:
        validate_sft_config(cfg)
    absolute_paths(cfg)  # the driver's paths, whatever directory a worker runs in
    return cfg


SFT_CHOICES = {
    "trainer.device": ("auto", "cpu", "cuda"),
    "trainer.resume_mode": ("auto", "disable", "resume_path"),
    "trainer.resume_check": ("strict", "warn"),
    "trainer.debugger": ("vscode", "cli"),
    "data.truncation": ("error", "left", "right"),
    "model.fsdp_config.model_dtype": ("fp32", "float32", "bf16", "bfloat16", "fp16", "float16"),
    "model.fsdp_config.dtype": ("bfloat16", "bf16", "float32", "fp32"),
}
SFT_POSITIVE = (
    "trainer.nnodes",
    "trainer.n_gpus_per_node",
    "trainer.total_epochs",
    "data.train_batch_size",
    "data.micro_batch_size_per_gpu",
    "data.max_token_len_per_gpu",
    "data.max_length",
    "trainer.total_training_steps",
    "trainer.max_ckpt_to_keep",
)


def _get(cfg: object, path: str) -> Any:
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


def validate_sft_config(cfg: SFTConfig) -> None:
    """Raise ConfigError for the first rule the config breaks, with the numbers."""
    validate_run_keys(cfg, SFT_POSITIVE)
    d = cfg.data
    if not 0.0 <= d.synthetic_correct_rate <= 1.0:
        raise ConfigError(
            f"data.synthetic_correct_rate={d.synthetic_correct_rate} must be in [0, 1]"
        )
    _check_batch(cfg)


class RunKeys(Protocol):
    """A config with the groups `rayrl sft`, `rayrl rm` and `rayrl dpo` share
    (`SFTConfig`, `rayrl.config.pref.PrefConfig`)."""

    data: Any
    model: SFTModelConfig
    resources: ResourcesConfig
    ulysses_sequence_parallel_size: int
    use_remove_padding: bool

    @property
    def trainer(self) -> Any: ...

    @property
    def world_size(self) -> int: ...


def validate_run_keys(cfg: RunKeys, positive: Sequence[str]) -> None:
    """The checks `rayrl sft` shares with `rayrl rm` and `rayrl dpo` (same model,
    optimizer and trainer groups): choices, positive numbers, sample limits,
    frequencies, resume, and the ranks' layout."""
    for path, allowed in SFT_CHOICES.items():
        check_choice(path, _get(cfg, path), allowed)
    for path in positive:
        value = _get(cfg, path)
        if value is not None and value < 1:
            raise ConfigError(f"{path}={value} must be at least 1")
    check_cpus_per_worker(cfg.resources.cpus_per_worker)
    d, t = cfg.data, cfg.trainer
    for key in ("train_max_samples", "val_max_samples"):
        if getattr(d, key) == 0 or getattr(d, key) < -1:
            raise ConfigError(f"data.{key}={getattr(d, key)} must be -1 (every row) or >= 1")
    for key in ("save_freq", "test_freq"):
        value = getattr(t, key)
        if value != EACH_EPOCH and (type(value) is not int or value == 0 or value < -1):
            raise ConfigError(
                f"trainer.{key}={value!r}: a number of steps, {EACH_EPOCH}, or -1 for never"
            )
    if t.resume_mode == "resume_path" and not t.resume_from_path:
        raise ConfigError(
            "trainer.resume_mode=resume_path needs trainer.resume_from_path (a "
            "checkpoints/global_step_N directory)"
        )
    check_role_parallel(
        cfg.world_size,
        "ulysses_sequence_parallel_size",
        cfg.ulysses_sequence_parallel_size,
        "model.fsdp_config.fsdp_size",
        cfg.model.fsdp_config.fsdp_size,
        "use_remove_padding",
        cfg.use_remove_padding,
        cfg.model.partial_pretrain,
    )


def _check_batch(cfg: SFTConfig) -> None:
    """The batch splits evenly over the ranks, and each rank's share into micro-batches."""
    d, world = cfg.data, cfg.dp_size
    if d.train_batch_size % world:
        raise ConfigError(
            f"data.train_batch_size={d.train_batch_size} does not split over {world} "
            f"data-parallel ranks (trainer.nnodes x trainer.n_gpus_per_node / "
            f"ulysses_sequence_parallel_size); "
            f"{d.train_batch_size} % {world} = {d.train_batch_size % world}"
        )
    per_rank = d.train_batch_size // world
    if not d.use_dynamic_bsz and per_rank % d.micro_batch_size_per_gpu:
        raise ConfigError(
            f"each rank's share of a batch, {d.train_batch_size} / {world} ranks = {per_rank} "
            f"sequences, does not split into micro-batches of data.micro_batch_size_per_gpu="
            f"{d.micro_batch_size_per_gpu}; use a micro-batch size dividing {per_rank} or set "
            "data.use_dynamic_bsz=true"
        )
