"""The Python API's keyword arguments: TRL's names for a few settings, rayrl's dotted
config keys for the rest.

`GRPOTrainer` takes the settings a TRL `GRPOConfig` user reaches for first under TRL's
names, where one maps onto rayrl's config without doubt (`TRL_KEYS`; `beta` sets two
keys). Every other setting is a dotted key of rayrl's schema, the same keys as
`rayrl train` (`**{"data.train_batch_size": 16}`). A plain keyword that is neither is a
TypeError naming the nearest keyword or key; TRL names whose meaning differs in rayrl
(`NOT_MAPPED`) say which keys to use instead. Dotted keys are checked by the config
loader, as on the command line.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping

from rayrl.config.load import suggest

# TRL's GRPOConfig name -> rayrl's config key (the same meaning and unit)
TRL_KEYS: dict[str, str] = {
    "learning_rate": "actor_rollout_ref.actor.optim.lr",
    "num_generations": "actor_rollout_ref.rollout.n",
    "max_prompt_length": "data.max_prompt_length",
    "max_completion_length": "data.max_response_length",
    "max_steps": "trainer.total_training_steps",
    "num_train_epochs": "trainer.total_epochs",
    "temperature": "actor_rollout_ref.rollout.temperature",
    "beta": "actor_rollout_ref.actor.kl_loss_coef",  # and use_kl_loss = beta > 0
    "seed": "trainer.seed",
    "output_dir": "trainer.output_dir",
    "save_steps": "trainer.save_freq",
    "eval_steps": "trainer.test_freq",
}

KL_SWITCH = "actor_rollout_ref.actor.use_kl_loss"  # beta > 0 turns the KL loss on
STEPS = TRL_KEYS["max_steps"]

_BATCH = (
    "TRL counts completions per device; rayrl counts prompts per step: set "
    "'data.train_batch_size' (prompts per step, each sampled num_generations times) and "
    "'actor_rollout_ref.actor.ppo_mini_batch_size' (prompts per optimizer step)"
)
# TRL names with no single rayrl key of the same meaning -> what to set instead
NOT_MAPPED: dict[str, str] = {
    "per_device_train_batch_size": _BATCH,
    "gradient_accumulation_steps": _BATCH,
    "generation_batch_size": _BATCH,
    "steps_per_generation": _BATCH,
    "num_iterations": "set 'actor_rollout_ref.actor.ppo_epochs' (updates per batch)",
    "epsilon": "set 'actor_rollout_ref.actor.clip_ratio_low' and 'clip_ratio_high'",
    "report_to": "set 'trainer.logger' (e.g. ['console', 'wandb'])",
}


def config_overrides(trl: Mapping[str, object], other: Mapping[str, object]) -> dict[str, object]:
    """Dotted config overrides from TRL-named settings (`trl`; None: not given) and the
    other keywords (`other`: dotted keys). A plain keyword in `other` is a TypeError
    naming the nearest keyword or config key."""
    for key in other:
        if "." not in key:
            raise TypeError(unknown_keyword(key))
    out: dict[str, object] = {}
    origin: dict[str, str] = {}  # config key -> the TRL name that set it
    for name, value in trl.items():
        if value is None:
            continue
        out[TRL_KEYS[name]], origin[TRL_KEYS[name]] = value, name
        if name == "beta":
            out[KL_SWITCH], origin[KL_SWITCH] = float(value) > 0, name  # type: ignore[arg-type]
    if trl.get("num_train_epochs") is not None and trl.get("max_steps") is None:
        out[STEPS], origin[STEPS] = None, "num_train_epochs"  # epochs decide, as TRL's -1
    for key in sorted(set(out) & set(other)):
        raise TypeError(f"'{key}' is set twice: by {origin[key]}= and as a dotted key; give one")
    return {**out, **other}


def unknown_keyword(key: str) -> str:
    """The message of a plain keyword that is not one of the API's: what to use."""
    if key in NOT_MAPPED:
        return f"GRPOTrainer() takes no {key!r}: {NOT_MAPPED[key]}"
    close = difflib.get_close_matches(key, list(TRL_KEYS), n=1, cutoff=0.75)
    hint = close[0] if close else suggest(key)
    did = f"; did you mean '{hint}'?" if hint else ""
    return (
        f"GRPOTrainer() got an unexpected keyword argument {key!r}{did} Settings are "
        f"{', '.join(TRL_KEYS)}, or rayrl's dotted config keys: "
        "**{'data.train_batch_size': 16}"
    )
