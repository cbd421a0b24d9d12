"""Preference-pair training: the `Trainer` of `rayrl rm` and `rayrl dpo`.

`PrefTrainer` is `SFTTrainer` (`rayrl.trainer.sft`: one pool of ranks, FSDP2 over
them, `rayrl.trainer.run.Run` around the steps for checkpoints, resume, metrics and the
final `hf/`) with `PrefWorker` ranks, pair data (`rayrl.data.preference`) and the
objective `objective.name` (`rayrl.algos.preference`): `bt` trains a reward model
whose `hf/` is what `rayrl train reward_model.enable=true
reward_model.model.path=OUTPUT_DIR/hf` scores with; `dpo` / `ipo` train a policy whose
`hf/` is an actor's starting point.

Metrics carry TRL's names under `train/` (as `rayrl sft`'s `train/loss`):
`train/loss`, `train/rewards/chosen`, `train/rewards/rejected`,
`train/rewards/accuracies`, `train/rewards/margins` (a reward model's scores; a
policy's implicit rewards `beta * (logp - ref_logp)`), for a policy also
`train/logps/chosen` and `train/logps/rejected`. Validation (`trainer.test_freq` and
the end) reports the same under `val/` over the held-out pairs, and
`val/preference_accuracy`: the share of held-out pairs the model itself ranks right
(a reward model's higher score; a policy's higher likelihood of the whole response),
which, unlike DPO's implicit-reward accuracy (0 before the first step: every margin
is 0), says where a policy starts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch

from rayrl.algos.preference import PREFERENCE_LOSSES, pair_metrics, preference_loss, split_pairs
from rayrl.config.pref import PrefConfig
from rayrl.models.loading import load_tokenizer
from rayrl.trainer.contract import TrainData
from rayrl.trainer.names import check_pref_names
from rayrl.trainer.sft import SFTTrainer
from rayrl.workers.pref import PrefWorker

__all__ = ["PrefTrainer", "pair_summary"]


class PrefTrainer(SFTTrainer):
    """Preference-pair training for one `PrefConfig` (module docstring)."""

    role = "pref"
    worker_cls = PrefWorker

    def __init__(self, cfg: PrefConfig, print_fn: Callable[[str], None] = print) -> None:
        check_pref_names(cfg)
        super().__init__(cfg, print_fn, check=False)  # type: ignore[arg-type]
        info = PREFERENCE_LOSSES.info(cfg.objective.name or "dpo")
        self.scored = info["model"] == "reward"
        self.kind = "rm" if self.scored else "dpo"

    def load_data(self) -> TrainData:
        """Tokenizer and the preference pairs, before anything is reserved."""
        from rayrl.trainer.pref_data import load_pair_datasets

        cfg = cast(PrefConfig, self.cfg)
        tokenizer = load_tokenizer(
            self.model_path,
            key="model.partial_pretrain",
            trust_remote_code=cfg.model.trust_remote_code,
        )
        train, val = load_pair_datasets(cfg, tokenizer, "score" if self.scored else "policy")
        d = cfg.data
        self.data = TrainData(train, d.train_batch_size, d.shuffle, val)
        return self.data

    def fingerprint(self) -> dict[str, Any]:
        o = cast(PrefConfig, self.cfg).objective
        return {
            **super().fingerprint(),
            "objective.name": o.name,
            "objective.beta": o.beta,
            "objective.label_smoothing": o.label_smoothing,
        }

    def validate(self, step: int) -> dict[str, float]:
        """The held-out pairs' loss, TRL's reward metrics and `preference_accuracy`."""
        val = self.data.val if self.data is not None else None
        if val is None:
            raise RuntimeError("no validation data to validate on (data.val_files)")
        size = self.cfg.data.train_batch_size
        parts = []
        for start in range(0, len(val), size):
            batch = val.collate(list(range(start, min(start + size, len(val)))))
            parts.append(cast(Any, self._group()).pair_scores(batch))
        columns = {k: torch.cat([p[k] for p in parts]) for k in ("score", "ref", "tokens")}
        o = cast(PrefConfig, self.cfg).objective
        return {f"val/{k}": v for k, v in pair_summary(columns, o).items()}


def pair_summary(columns: dict[str, torch.Tensor], objective: Any) -> dict[str, float]:
    """A set of pairs' metrics from per-row ``score``, ``ref`` and ``tokens`` (rows in
    pairs): the objective's mean loss, TRL's reward metrics and `preference_accuracy`
    (the share of pairs whose chosen score, or summed log-prob, is the higher)."""
    chosen, rejected = split_pairs(columns["score"])
    scored = PREFERENCE_LOSSES.info(objective.name)["model"] == "reward"
    ref = (None, None) if scored else split_pairs(columns["ref"])
    tokens = split_pairs(columns["tokens"])
    losses, chosen_r, rejected_r = preference_loss(
        objective.name,
        chosen,
        rejected,
        *ref,
        beta=objective.beta,
        label_smoothing=objective.label_smoothing,
        chosen_tokens=tokens[0],
        rejected_tokens=tokens[1],
    )
    metrics = {k: float(v) for k, v in pair_metrics(losses, chosen_r, rejected_r).items()}
    metrics["preference_accuracy"] = float((chosen > rejected).double().mean())
    return metrics
