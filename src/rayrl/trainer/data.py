"""The prompts a run trains and validates on, chosen by the config's data group.

Training prompts come from `data.train_files` (or the synthetic task) through the
loader `data.loader` names: `default` (every row read and tokenised in the driver)
or `ray` (Ray Data reads, tokenises and shuffles in parallel and streams batches).
With `data.custom_cls` set, a dataset class of one's own reads both file lists
(`rayrl.data.custom`: verl's contract). Validation prompts come from `data.val_files`;
without them, a run on the synthetic task validates on its held-out split (rows the
training split does not contain), and a run on files of its own does not validate,
saying so once (`no_validation_notice`).
With multi-turn rollouts on, prompts show the configured tools' schemas through the
chat template and carry their rows' `agent_name` (`rayrl.workers.agent`). A
vision-language policy's prompts are read with its image processor (`vision_processor`):
rows with images carry their pixels (`rayrl.data.dataset`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from rayrl.config.schema import RayRLConfig
from rayrl.config.sft import SFTConfig
from rayrl.data import DataError, PromptDataset, RowSource, read_rows_with_sources, synthetic_rows
from rayrl.data.custom import build_custom_dataset, custom_rows
from rayrl.data.files import is_json
from rayrl.data.synthetic import held_out_rows
from rayrl.registry import Registry
from rayrl.workers.agent import configured_interactions, default_agent, tool_schemas

if TYPE_CHECKING:
    from rayrl.data.ray_loader import RayPromptLoader

log = logging.getLogger("rayrl.trainer")
LOADERS: Registry[Callable[..., Any]] = Registry("data loader", config_key="data.loader")


def _agent_settings(cfg: RayRLConfig) -> dict[str, Any]:
    """The tool schemas and default agent of the prompts (none with single-turn rollouts)."""
    if not cfg.actor_rollout_ref.rollout.multi_turn.enable:
        return {}
    configured_interactions(cfg)  # a bad interaction config fails here, before any reservation
    return {"tools": tool_schemas(cfg), "default_agent": default_agent(cfg)}


def _dataset(
    rows: list[dict[str, Any]],
    tokenizer: Any,
    cfg: RayRLConfig,
    sources: Sequence[RowSource] | None = None,
    vision: Any = None,
) -> PromptDataset:
    d = cfg.data
    return PromptDataset(
        rows,
        tokenizer,
        max_prompt_length=d.max_prompt_length,
        truncation=d.truncation,
        filter_overlong=d.filter_overlong_prompts,
        prompt_key=d.prompt_key,
        sources=sources,
        chat_template_kwargs=d.apply_chat_template_kwargs,
        image_key=d.image_key,
        video_key=d.video_key,
        vision=vision,
        **_agent_settings(cfg),
    )


def _files_dataset(
    files: Any, tokenizer: Any, cfg: RayRLConfig, vision: Any = None
) -> PromptDataset:
    if cfg.data.custom_cls.path is not None:
        return _custom_dataset(files, tokenizer, cfg, vision)
    rows, sources = read_rows_with_sources(files)
    return _dataset(rows, tokenizer, cfg, sources, vision)


def _custom_dataset(
    files: Any, tokenizer: Any, cfg: RayRLConfig, vision: Any = None
) -> PromptDataset:
    """The rows of the user's dataset class (`data.custom_cls`) on `files`."""
    from dataclasses import asdict

    from omegaconf import OmegaConf

    from rayrl.usercode import load_object

    path, name = cfg.data.custom_cls.path, cfg.data.custom_cls.name
    if path is None or not name:  # `check_run_keys` refuses it
        raise ValueError(f"data.custom_cls: path={path!r} and name={name!r}: give both")
    where = f"data.custom_cls {path}:{name}"
    spec = f"{path.removeprefix('pkg://')}:{name}" if path.startswith("pkg://") else None
    cls = load_object(spec or (path, name), kind="data.custom_cls")
    files = [files] if isinstance(files, str) else list(files)
    data_config = OmegaConf.create(asdict(cfg.data))
    dataset = build_custom_dataset(cls, files, tokenizer, data_config, where)
    rows, sources = custom_rows(dataset, cfg.data.prompt_key, where)
    return _dataset(rows, tokenizer, cfg, sources, vision)


@LOADERS.register("default")
def default_loader(cfg: RayRLConfig, tokenizer: Any, vision: Any = None) -> PromptDataset:
    d = cfg.data
    if d.train_files:
        return _files_dataset(d.train_files, tokenizer, cfg, vision)
    rows = synthetic_rows(d.synthetic_task, d.synthetic_size, cfg.trainer.seed, d.synthetic_images)
    return _dataset(rows, tokenizer, cfg, vision=vision)


@LOADERS.register("ray")
def ray_loader(cfg: RayRLConfig, tokenizer: Any, vision: Any = None) -> RayPromptLoader:
    from rayrl.data.ray_loader import RayPromptLoader

    if vision is not None:  # the config refuses it first (`rayrl.config.vision_checks`)
        raise DataError("data.loader=ray reads no prompts with images; set data.loader=default")
    d = cfg.data
    files = [d.train_files] if isinstance(d.train_files, str) else list(d.train_files)
    seed = cfg.trainer.seed
    rows = (
        None
        if files
        else synthetic_rows(d.synthetic_task, d.synthetic_size, seed, d.synthetic_images)
    )
    if any(is_json(f) for f in files):  # Ray Data reads Parquet here; JSON rows as items
        rows, files = read_rows_with_sources(files)[0], []
    return RayPromptLoader(
        files=files or None,
        rows=rows,
        tokenizer=tokenizer,
        max_prompt_length=d.max_prompt_length,
        truncation=d.truncation,
        filter_overlong=d.filter_overlong_prompts,
        prompt_key=d.prompt_key,
        num_blocks=d.dataloader_num_workers,
        chat_template_kwargs=d.apply_chat_template_kwargs,
        image_key=d.image_key,
        video_key=d.video_key,
        **_agent_settings(cfg),
    )


def synthetic_val_rows(cfg: RayRLConfig) -> list[dict[str, Any]]:
    """The synthetic task's held-out split: rows after the training ones, minus any
    whose question the training split also asks."""
    d = cfg.data
    return held_out_rows(
        d.synthetic_task,
        d.synthetic_size,
        d.synthetic_val_size,
        cfg.trainer.seed,
        d.synthetic_images,
    )


def require_batch(train: Any, batch_size: int) -> None:
    """DataError unless the training data holds at least one batch of usable rows."""
    if hasattr(train, "require_rows"):
        train.require_rows(batch_size)  # names the rows set aside, if any
    elif len(train) < batch_size:
        raise DataError(
            f"the training data has {len(train)} usable row(s), fewer than one batch of "
            f"data.train_batch_size={batch_size}; add data or lower data.train_batch_size"
        )


def _warn_single_turn_rows(cfg: RayRLConfig, train: Any) -> None:
    """Multi-turn on, yet every row would run verl's single-turn agent: say how to change it."""
    agent = default_agent(cfg)
    rows = getattr(train, "rows", None)
    if agent not in ("single_turn_agent", "single_turn") or not rows:
        return
    if not any(getattr(train, "agent_of", lambda r: agent)(r) != agent for r in rows):
        log.warning(
            "multi_turn.enable=true but no training row names an agent_name, and "
            "actor_rollout_ref.rollout.agent.default_agent_loop=%s: every episode is one "
            "turn without tools. Give rows agent_name='tool_agent' (verl's) or set "
            "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
            agent,
        )


def no_validation_notice(cfg: RayRLConfig | SFTConfig) -> str | None:
    """The line a run prints when validation was asked for (`trainer.val_before_train`
    or `trainer.test_freq`) but it has no validation prompts: training files of its own
    and no `data.val_files` (the synthetic held-out split is not of its task)."""
    t, d = cfg.trainer, cfg.data
    asked = getattr(t, "val_before_train", False) or getattr(t, "test_freq", -1) > 0
    if not asked or not d.train_files or d.val_files:
        return None
    return (
        "no validation: data.val_files is not set (the synthetic task's held-out split "
        "serves only runs on the synthetic task); set data.val_files to validate on "
        "held-out prompts of your own"
    )


def truncation_notes(data: Any, d: Any) -> list[str]:
    """One line per split whose prompts `data.truncation=left|right` cut to
    `data.max_prompt_length`: how many of how many, and which end went."""
    notes = []
    for split, dataset in (("train", data.dataset), ("val", data.val)):
        cut = getattr(dataset, "truncated", 0)
        if cut:
            total = getattr(dataset, "total_rows", "?")
            end = "start" if d.truncation == "left" else "end"
            notes.append(
                f"NOTE: data.truncation={d.truncation} cut {cut} of {total} {split} prompts "
                f"to data.max_prompt_length={d.max_prompt_length} tokens (their {end} dropped)"
            )
    return notes


def vision_processor(cfg: RayRLConfig, model_path: str, tokenizer: Any) -> Any:
    """The image processor of a vision-language policy (`model_vision_processor`, with
    ``data.mm_processor_kwargs``), or None for a text-only one."""
    kwargs = dict(cfg.data.mm_processor_kwargs or {})
    return model_vision_processor(model_path, tokenizer, kwargs, "actor_rollout_ref.model.path")


def model_vision_processor(
    model_path: str, tokenizer: Any, mm_processor_kwargs: dict[str, Any], key: str
) -> Any:
    """The image processor of a vision-language model directory (`rayrl.data.vision`),
    or None for a text-only one; a DataError names the config ``key`` of a family rayrl
    does not train (`rayrl.models.vision_language`)."""
    from rayrl.models.vision_language import is_vision_language, local_config, unsupported_reason

    config = local_config(model_path)
    if config is None or not is_vision_language(config):
        return None
    why = unsupported_reason(config)
    if why is not None:
        raise DataError(f"{key}={model_path}: {why}")
    from rayrl.data.vision import load_vision_processor

    return load_vision_processor(model_path, tokenizer, mm_processor_kwargs=mm_processor_kwargs)


def load_datasets(
    cfg: RayRLConfig, tokenizer: Any, vision: Any = None
) -> tuple[Any, PromptDataset | None]:
    """(training prompts, validation prompts or None); whether they fill a batch is the
    run's check (`require_batch`), after it has listed the rows set aside. ``vision``:
    the policy's image processor (`vision_processor`), for prompts with images."""
    d = cfg.data
    train = LOADERS.get(d.loader)(cfg, tokenizer, vision)
    if class_path := d.sampler.class_path:  # verl's data.sampler: the class orders the epochs
        from dataclasses import asdict

        from omegaconf import OmegaConf

        from rayrl.data.sampler import build_sampler

        class_name = d.sampler.class_name
        if not class_name:  # `check_sampler` refuses it
            raise ValueError(
                f"data.sampler.class_path={class_path!r} needs data.sampler.class_name"
            )
        data_config = OmegaConf.create(asdict(d))
        train.sampler = build_sampler(class_path, class_name, train, data_config)
    _warn_single_turn_rows(cfg, train)
    if d.val_files:
        val = _files_dataset(d.val_files, tokenizer, cfg, vision)
    elif not d.train_files and d.synthetic_val_size > 0:
        val = _dataset(synthetic_val_rows(cfg), tokenizer, cfg, vision=vision)
    else:
        val = None
    return train, (val if val is not None and len(val) else None)
