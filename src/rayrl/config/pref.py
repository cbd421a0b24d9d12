"""The config of `rayrl rm` and `rayrl dpo`: preference-pair training, its schema and checks.

Both commands train on (prompt, chosen, rejected) pairs with one trainer
(`rayrl.trainer.pref.PrefTrainer`) and an objective (`objective.name`, the registry
`rayrl.algos.preference.PREFERENCE_LOSSES`): `bt` (Bradley-Terry) trains a reward
model (`rayrl rm`'s default), `dpo` (sigmoid DPO), `ipo` or `robust` a policy against a
frozen reference (`rayrl dpo`'s default is `dpo`). `objective.beta` is DPO's and IPO's
beta (TRL's and OpenRLHF's name, default 0.1), `objective.label_smoothing` the label
noise of conservative DPO (`dpo`, and `bt`) and robust DPO (`robust`).

The model, optimizer and trainer groups are `rayrl sft`'s (`rayrl.config.sft`: verl's
SFT trainer names, `model.partial_pretrain`, `model.lora_rank`, `optim.lr`,
`trainer.total_epochs`, ...), and so are the loading rules (unknown keys are errors
with a "did you mean"). The data group names the pair columns: `data.prompt_key`,
`data.chosen_key`, `data.rejected_key` (verl's reward-model dataset's and OpenRLHF's
`prompt` / `chosen` / `rejected`; at those defaults common variants are read too,
`rayrl.data.preference`). `data.train_batch_size` and `data.micro_batch_size_per_gpu`
count pairs (each is two sequences through the model), as TRL's and OpenRLHF's
batch sizes do. With no `data.train_files`, the pairs are the synthetic task's
(`data.synthetic_task`): chosen the right answer, rejected the task's typical mistake.
The built-in configs live in `config/rm/` and `config/dpo/` (`rayrl dpo -c demo`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rayrl.config.compat import map_bool_frequencies
from rayrl.config.errors import ConfigError
from rayrl.config.errors import warn as _warn
from rayrl.config.load import as_str_list, check_keys, load_structured
from rayrl.config.nulls import settle_nulls
from rayrl.config.paths import absolute_paths
from rayrl.config.schema import ResourcesConfig
from rayrl.config.sft import (
    RankSizes,
    SFTModelConfig,
    SFTOptimConfig,
    SFTTrainerConfig,
    validate_run_keys,
)

CONFIG_DIR = Path(__file__).resolve().parent
COMMANDS = {"rm": "bt", "dpo": "dpo"}  # command -> its default objective
MODEL_OF = {"rm": "reward", "dpo": "policy"}  # command -> the kind of model it trains


@dataclass
class PrefDataConfig:
    train_files: Any = field(default_factory=list)  # a path or a list; empty: synthetic task
    val_files: Any = field(default_factory=list)
    train_batch_size: int = 256  # pairs per optimizer step, all ranks together
    micro_batch_size_per_gpu: int = 4  # pairs per forward/backward (also validation)
    train_max_samples: int = -1  # -1: every row
    val_max_samples: int = -1
    prompt_key: str = "prompt"  # a string (one user turn) or a list of chat messages
    chosen_key: str = "chosen"  # a string, or a conversation ending in the response
    rejected_key: str = "rejected"
    max_length: int = 1024  # prompt + response tokens, each of the two sequences
    truncation: str = "error"  # error | left | right
    apply_chat_template_kwargs: dict[Any, Any] = field(default_factory=dict)
    shuffle: bool = True  # a new order every epoch (seeded)
    synthetic_task: str = "larger"  # used when train_files is empty
    synthetic_size: int = 512
    synthetic_val_size: int = 64  # held-out pairs (when no val_files)


@dataclass
class PrefObjectiveConfig:
    name: str | None = None  # bt | dpo | ipo | robust; None: the command's (rm: bt, dpo: dpo)
    beta: float = 0.1  # DPO's and IPO's beta
    label_smoothing: float = 0.0  # conservative DPO / Bradley-Terry label noise


@dataclass
class PrefTrainerConfig(SFTTrainerConfig):
    # validate on the held-out pairs before the first step (verl's trainer key): the
    # start of val/preference_accuracy
    val_before_train: bool = True


@dataclass
class PrefConfig(RankSizes):
    data: PrefDataConfig = field(default_factory=PrefDataConfig)
    model: SFTModelConfig = field(default_factory=SFTModelConfig)
    optim: SFTOptimConfig = field(default_factory=SFTOptimConfig)
    objective: PrefObjectiveConfig = field(default_factory=PrefObjectiveConfig)
    use_remove_padding: bool = False  # sequence packing
    ulysses_sequence_parallel_size: int = 1
    trainer: PrefTrainerConfig = field(default_factory=PrefTrainerConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)


def pref_source_data(
    data: dict[str, Any], origin: str, warn: Callable[[str], None]
) -> dict[str, Any]:
    map_bool_frequencies(data)
    check_keys(data, PrefConfig, origin=origin)
    settle_nulls(data, PrefConfig, origin, warn)
    return data


def load_pref_config(
    command: str,
    source: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    validate: bool = True,
    warn: Callable[[str], None] = _warn,
) -> PrefConfig:
    """`rayrl rm`'s or `rayrl dpo`'s config (`command`): defaults <- YAML file (a path,
    or a built-in name from `config/<command>/`) <- dotted overrides, then checked."""
    if command not in COMMANDS:
        raise ValueError(f"command={command!r} is not one of {sorted(COMMANDS)}")
    cfg = load_structured(
        PrefConfig,
        source,
        overrides,
        lambda d, origin: pref_source_data(d, origin, warn),
        builtin_dir=CONFIG_DIR / command,
    )
    d = cfg.data
    d.train_files = as_str_list(d.train_files, "data.train_files")
    d.val_files = as_str_list(d.val_files, "data.val_files")
    cfg.trainer.logger = as_str_list(cfg.trainer.logger, "trainer.logger")
    modules = cfg.model.target_modules
    if not isinstance(modules, str):
        cfg.model.target_modules = as_str_list(modules, "model.target_modules")
    if cfg.objective.name is None:
        cfg.objective.name = COMMANDS[command]
    if validate:
        validate_pref_config(cfg, command)
    absolute_paths(cfg)
    return cfg


PREF_POSITIVE = (
    "trainer.nnodes",
    "trainer.n_gpus_per_node",
    "trainer.total_epochs",
    "data.train_batch_size",
    "data.micro_batch_size_per_gpu",
    "data.max_length",
    "trainer.total_training_steps",
    "trainer.max_ckpt_to_keep",
)


def validate_pref_config(cfg: PrefConfig, command: str | None = None) -> None:
    """Raise ConfigError for the first rule the config breaks, with the numbers."""
    from rayrl.algos.preference import PREFERENCE_LOSSES

    validate_run_keys(cfg, PREF_POSITIVE)
    o = cfg.objective
    name = o.name or "dpo"
    if name not in PREFERENCE_LOSSES:
        raise ConfigError(
            f"objective.name={name!r}: {PREFERENCE_LOSSES.unknown_message(name, 'objective.name')}"
        )
    kind = PREFERENCE_LOSSES.info(name)["model"]
    if command is not None and kind != MODEL_OF[command]:
        fits = [
            n
            for n in PREFERENCE_LOSSES.names()
            if PREFERENCE_LOSSES.info(n)["model"] == MODEL_OF[command]
        ]
        other = "dpo" if command == "rm" else "rm"
        raise ConfigError(
            f"objective.name={name!r} trains a {kind} model: `rayrl {other}` runs it; "
            f"`rayrl {command}` takes {', '.join(fits)}"
        )
    if not o.beta > 0:
        raise ConfigError(f"objective.beta={o.beta} must be above 0")
    if not 0.0 <= o.label_smoothing < 0.5:
        raise ConfigError(f"objective.label_smoothing={o.label_smoothing} must be in [0, 0.5)")
    d, world = cfg.data, cfg.dp_size
    if d.train_batch_size % world:
        raise ConfigError(
            f"data.train_batch_size={d.train_batch_size} pairs do not split over {world} "
            "data-parallel ranks (trainer.nnodes x trainer.n_gpus_per_node / "
            f"ulysses_sequence_parallel_size); {d.train_batch_size} % {world} = "
            f"{d.train_batch_size % world}"
        )
    per_rank = d.train_batch_size // world
    if per_rank % d.micro_batch_size_per_gpu:
        raise ConfigError(
            f"each rank's share of a batch, {d.train_batch_size} / {world} ranks = "
            f"{per_rank} pairs, does not split into micro-batches of "
            f"data.micro_batch_size_per_gpu={d.micro_batch_size_per_gpu} pairs"
        )
