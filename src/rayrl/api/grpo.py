"""`GRPOTrainer`: GRPO from Python, in the shape a TRL user knows.

    from rayrl import GRPOTrainer

    def exact(completions, answer, **kwargs):
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

    trainer = GRPOTrainer(
        model="path/to/hf_dir",
        reward_funcs=[exact],
        train_dataset=[{"prompt": "Which is larger, 3 or 7?", "answer": "7"}, ...],
        learning_rate=1e-6,
        **{"data.train_batch_size": 16},
    )
    result = trainer.train()  # result.history, result.model_dir

It is the same run as `rayrl train -c grpo` (`rayrl.trainer.run.Run` driving
`PPOTrainer`): the constructor builds the config (the base config, then TRL-named
settings and dotted keys: `rayrl.api.keywords`), writes in-memory data as parquet under
the run directory (`rayrl.api.datasets`) and pickles the reward functions into the
config (`rayrl.rewards.callables`), so a mistake in any of them is an error here, before
Ray starts. `train()` sets up, trains, exports and shuts down; a first Ctrl-C stops at
a safe point with a checkpoint (`rayrl.trainer.interrupt`) and `train()` returns what
was trained with `stopped` set; the run resumes from there when trained again.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rayrl.api.datasets import DataFiles, DatasetLike, dataset_files
from rayrl.api.keywords import TRL_KEYS, config_overrides
from rayrl.config.load import load_config
from rayrl.config.schema import RayRLConfig
from rayrl.rewards.callables import RewardFuncs, check_function, pickle_funcs

DEFAULT_CONFIG = "grpo"  # the built-in config a GRPOTrainer starts from
MODEL_KEY = "actor_rollout_ref.model.path"
RewardFunc = Callable[..., object]


@dataclass(frozen=True)
class TrainResult:
    """What `GRPOTrainer.train()` returns.

    Attributes:
        history: one dict of metrics per step trained (verl's names, as metrics.jsonl).
        model_dir: the trained model as a Hugging Face directory (`<run_dir>/hf`), or
            None when the run exported none (stopped early, `trainer.export_hf=false`).
        run_dir: the run directory (config, metrics, checkpoints, data).
        stopped: whether a Ctrl-C or SIGTERM ended the run early (with a checkpoint).
    """

    history: list[dict[str, float]]
    model_dir: Path | None
    run_dir: Path
    stopped: bool = False


class GRPOTrainer:
    """GRPO training of `model` on `train_dataset`, rewarded by `reward_funcs`.

    Args:
        model: a Hugging Face model directory; None: the config's, else rayrl's tiny
            demo model (built in the run directory).
        reward_funcs: one function or several, summed with `reward_weights`; each either
            TRL's style ``fn(prompts, completions, **columns) -> list[float]`` or rayrl's
            ``fn(data_source, solution_str, ground_truth, extra_info) -> float``
            (`rayrl.rewards.callables`); each must pickle (an importable function, or a
            closure over values that pickle). None: the config's reward.
        train_dataset, eval_dataset: a list of dicts, a pandas DataFrame, a
            `datasets.Dataset` or data file path(s), in TRL's columns or rayrl's
            (`rayrl.api.datasets`). None: the config's data.
        reward_weights: one weight per reward function (default 1 each).
        config: the base config: a built-in name, a YAML path, or a `RayRLConfig`.
        print_fn: receives the run's messages (default: print).
        learning_rate ... eval_steps: TRL's names for config keys (`rayrl.api.keywords`);
            None: the base config's value.
        **overrides: rayrl's dotted config keys, as `rayrl train` takes them
            (``**{"data.train_batch_size": 16}``).

    Raises TypeError for an unknown keyword, `ConfigError` for a bad key or value,
    `DataError` for a bad dataset and `RewardFunctionError` for a reward function that
    does not fit or does not pickle, each naming what to fix.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        reward_funcs: RewardFunc | Sequence[RewardFunc] | None = None,
        train_dataset: DatasetLike | None = None,
        eval_dataset: DatasetLike | None = None,
        *,
        reward_weights: Sequence[float] | None = None,
        config: str | os.PathLike[str] | RayRLConfig = DEFAULT_CONFIG,
        print_fn: Callable[[str], None] = print,
        learning_rate: float | None = None,
        num_generations: int | None = None,
        max_prompt_length: int | None = None,
        max_completion_length: int | None = None,
        max_steps: int | None = None,
        num_train_epochs: int | None = None,
        temperature: float | None = None,
        beta: float | None = None,
        seed: int | None = None,
        output_dir: str | os.PathLike[str] | None = None,
        save_steps: int | None = None,
        eval_steps: int | None = None,
        **overrides: object,
    ) -> None:
        trl = {name: value for name, value in locals().items() if name in TRL_KEYS}
        self.print = print_fn
        if model is not None:
            if MODEL_KEY in overrides:
                raise TypeError(f"'{MODEL_KEY}' is set twice: by model= and as a dotted key")
            overrides = {**overrides, MODEL_KEY: _model_path(model)}
        cfg = load_config(config, config_overrides(trl, overrides))
        data_dir = Path(cfg.trainer.output_dir).expanduser().absolute() / "data"
        more: dict[str, object] = {}
        train = eval_ = None
        if train_dataset is not None:
            train = dataset_files(train_dataset, data_dir, "train")
            more["data.train_files"] = train.files
        if eval_dataset is not None:
            eval_ = dataset_files(eval_dataset, data_dir, "val")
            more["data.val_files"] = eval_.files
        funcs = _reward_funcs(reward_funcs, reward_weights, train, eval_)
        if funcs is not None:
            more["custom_reward_function.pickled"] = pickle_funcs(funcs)
        self.reward = funcs
        self.cfg: RayRLConfig = load_config(cfg, more) if more else cfg

    def train(self) -> TrainResult:
        """Train to the end (module docstring): the per-step metrics and the model's
        directory. Ray is started here (or joined: `resources.address`, a Ray already
        initialised in this process) and released before this returns."""
        from rayrl.trainer.async_ppo import AsyncPPOTrainer
        from rayrl.trainer.ppo import PPOTrainer
        from rayrl.trainer.run import Run

        trainer_cls = AsyncPPOTrainer if self.cfg.asynchronous else PPOTrainer
        run = Run(trainer_cls(self.cfg, print_fn=self.print), print_fn=self.print)
        try:
            run.setup()
            history = run.fit()
        finally:
            run.shutdown()
        hf = run.run_dir.hf
        exported = not run.stopped and (hf / "config.json").is_file()
        return TrainResult(history, hf if exported else None, run.run_dir.root, run.stopped)


def _model_path(model: object) -> str:
    """`model` as the config's model path; a model object is a TypeError saying what to pass."""
    if not isinstance(model, str | os.PathLike):
        raise TypeError(
            f"model must be the path of a Hugging Face model directory, not a "
            f"{type(model).__name__}; save it first (model.save_pretrained(dir), and its "
            "tokenizer) and pass dir"
        )
    return str(Path(model).expanduser())


def _reward_funcs(
    funcs: RewardFunc | Sequence[RewardFunc] | None,
    weights: Sequence[float] | None,
    train: DataFiles | None,
    eval_: DataFiles | None,
) -> RewardFuncs | None:
    """The reward functions with their weights, each checked against the columns the
    datasets give (those of both when both are given); None when none are given."""
    if funcs is None:
        if weights is not None:
            raise TypeError("reward_weights were given without reward_funcs")
        return None
    listed = [funcs] if callable(funcs) else list(funcs)
    bundle = RewardFuncs(listed, weights)
    given = [d.columns for d in (train, eval_) if d is not None]
    columns = frozenset.intersection(*given) if given else None
    for fn in listed:
        check_function(fn, columns)
    return bundle
