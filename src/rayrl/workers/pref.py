"""The preference-pair role of `rayrl rm` and `rayrl dpo`: an SFT rank that trains on
pairs with a preference objective (`rayrl.algos.preference`).

It is `SFTWorker` (the same engine: FSDP2, packing, Ulysses, LoRA; the same
checkpoints, resume and export) with three differences:

* the engine of a reward model (`objective.name=bt`) carries a one-label value head;
  the head's bias is zeroed and frozen (a pair's loss does not depend on it, and the
  exported `*ForSequenceClassification` head has none), and its score of a sequence is the
  head's output at the conversation's last token (`rayrl.data.preference`, ``score``);
* DPO and IPO read the frozen reference policy's log-probs of each response, computed
  in `before_train` once per step, on the rank's rows, before the update. The reference
  is the starting model: without LoRA a second, frozen engine in this process filled
  from the policy's weights when the rank starts (`weights_from`: nothing read twice;
  it costs one more copy of the weights, sharded like the policy's, and a forward pass
  a step); with LoRA the policy's own base model, its adapters switched off, so no
  copy exists. A resumed run builds the reference from the model it started from, not
  from the checkpoint, so its reference is the run's;
* `pair_scores` gives the per-row numbers validation ranks the held-out pairs by.

A batch's rows come in pairs (each pair's chosen row, then its rejected row: `pair_role`
1 and 0); micro-batches hold `2 x data.micro_batch_size_per_gpu` rows, and a batch
splits over the ranks in whole pairs (`rayrl.config.pref` checks the sizes), so a
pair's two rows always meet in one loss call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rayrl.algos.preference import (
    PREFERENCE_LOSSES,
    pair_metrics,
    preference_loss,
    sequence_logps,
    split_pairs,
)
from rayrl.batch import Batch
from rayrl.config.pref import PrefConfig
from rayrl.controller import DP_SPLIT, ONE_TO_ALL, register
from rayrl.train.loss_contract import LossFn
from rayrl.workers.common import optim_spec
from rayrl.workers.sft import MicroBatchSizes, SFTWorker, sft_engine_kwargs

REWARD_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
POLICY_METRICS = (*REWARD_METRICS, "logps/chosen", "logps/rejected")


def pair_loss_fn(name: str, beta: float, label_smoothing: float) -> LossFn:
    """The engine's loss (`rayrl.train.loss_contract`) of an objective: each pair's loss
    over the mini-batch's pair count (all ranks), so the step's loss is the mean over its
    pairs; the metrics (TRL's names) are shares of their means in the same way."""
    scored = PREFERENCE_LOSSES.info(name)["model"] == "reward"

    def loss_fn(outputs: dict[str, Tensor], mb: Batch) -> tuple[Tensor, dict[str, Any]]:
        roles = mb["pair_role"]
        if not (bool((roles[0::2] == 1).all()) and bool((roles[1::2] == 0).all())):
            raise ValueError(
                "a micro-batch's rows are not whole (chosen, rejected) pairs; preference "
                "batches must split into micro-batches of an even number of rows"
            )
        mask = mb["response_mask"].float()
        tokens: tuple[Tensor, Tensor] | tuple[None, None] = (None, None)
        if scored:
            seq = outputs["values"][:, 0]
            ref: tuple[Tensor, Tensor] | tuple[None, None] = (None, None)
        else:
            seq = sequence_logps(outputs["log_probs"], mask)
            ref = split_pairs(mb["ref_logps"].to(seq.dtype))
            tokens = split_pairs(mask.sum(-1))
        chosen, rejected = split_pairs(seq)
        losses, chosen_r, rejected_r = preference_loss(
            name,
            chosen,
            rejected,
            *ref,
            beta=beta,
            label_smoothing=label_smoothing,
            chosen_tokens=tokens[0],
            rejected_tokens=tokens[1],
        )
        pairs = float(mb.meta["global_seq_count"]) / 2.0
        share = len(losses) / pairs  # this micro-batch's part of the mini-batch's mean
        means = pair_metrics(losses, chosen_r, rejected_r)
        metrics: dict[str, Any] = {k: means[k] * share for k in REWARD_METRICS}
        if not scored:
            metrics["logps/chosen"] = chosen.detach().mean() * share
            metrics["logps/rejected"] = rejected.detach().mean() * share
        return losses.sum() / pairs, metrics

    return loss_fn


class PrefWorker(SFTWorker):
    """A rank of preference-pair training (module docstring)."""

    def init_worker(  # type: ignore[override]  # a PrefConfig, not an SFTConfig
        self, config: PrefConfig, model_path: str, *, total_steps: int
    ) -> None:
        from rayrl.train.engine import TrainEngine  # in the worker only

        self.cfg = config  # type: ignore[assignment]
        o = config.objective
        name = o.name or "dpo"
        info = PREFERENCE_LOSSES.info(name)
        self.scored = info["model"] == "reward"
        kwargs = sft_engine_kwargs(config)
        self.engine = TrainEngine(
            model_path,
            value_head=self.scored,
            optim=optim_spec(config.optim, total_steps),
            total_steps=total_steps,
            **kwargs,
        )
        if self.scored:
            self._zero_head_bias()
        self.ref = None
        if info["reference"] and kwargs["lora"] is None:
            self.ref = TrainEngine(model_path, trainable=False, weights_from=self.engine, **kwargs)
        self.loss_fn = pair_loss_fn(name, o.beta, o.label_smoothing)
        self.loss_metrics = REWARD_METRICS if self.scored else POLICY_METRICS

    def rebuild(self) -> None:
        self.engine.rebuild()
        if self.ref is not None:
            self.ref.rebuild()

    def _zero_head_bias(self) -> None:
        from rayrl.train.lora import value_head_module

        bias = getattr(value_head_module(self.engine.model), "bias", None)
        if bias is not None:
            with torch.no_grad():
                bias.zero_()
            # frozen too: its gradient is zero only up to rounding, which Adam's
            # normalisation would turn into steps of the learning rate's size
            bias.requires_grad_(False)

    def _sizes(self) -> MicroBatchSizes:
        return {"micro_batch_size": self._rows()}

    def _rows(self) -> int:
        """Rows per micro-batch: two per pair."""
        return 2 * self.cfg.data.micro_batch_size_per_gpu

    def _reference_logps(self, batch: Batch) -> Tensor:
        """Per row: the reference policy's summed response log-probs."""
        if self.ref is not None:
            out = self.ref.forward(batch, micro_batch_size=self._rows())
        else:
            with self.engine.adapters_disabled():
                out = self.engine.forward(batch, micro_batch_size=self._rows())
        return sequence_logps(out["log_probs"], batch["response_mask"].float())

    def before_train(self, batch: Batch) -> Batch:
        if not self.scored:
            batch["ref_logps"] = self._reference_logps(batch)
        return batch

    @register(dispatch=DP_SPLIT, layout="train")
    def pair_scores(self, batch: Batch) -> Batch:
        """Per row, no gradients: ``score`` (a reward model's score; a policy's summed
        response log-probs), ``ref`` (the reference's summed log-probs; 0 for a reward
        model) and ``tokens`` (the response's token count)."""
        out = self.engine.forward(batch, micro_batch_size=self._rows())
        mask = batch["response_mask"].float()
        if self.scored:
            score = out["values"][:, 0].double()
            ref = torch.zeros_like(score)
        else:
            score = sequence_logps(out["log_probs"], mask).double()
            ref = self._reference_logps(batch).double()
        return Batch({"score": score, "ref": ref, "tokens": mask.sum(-1).double()})

    @register(dispatch=ONE_TO_ALL)
    def export_hf(self, path: str) -> None:
        """An HF model directory at `path`: a policy's as `rayrl sft`'s; a reward model's
        as `*ForSequenceClassification` with one label, the directory `rayrl train
        reward_model.model.path=...` loads (`rayrl.rewards.model.ModelReward`)."""
        self.engine.export_hf(path, dtype=self.engine.training_dtype)
        if self.scored and self.rank == 0:
            as_sequence_classifier(Path(path))


def as_sequence_classifier(path: Path) -> None:
    """Turn an exported one-label token-classification directory into the
    sequence-classification model of the same weights: its config's architecture and
    a head without bias (the bias, zero, is dropped)."""
    import json

    from safetensors.torch import load_file, save_file

    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config["architectures"] = [
        a.replace("ForTokenClassification", "ForSequenceClassification")
        for a in config.get("architectures", [])
    ]
    config["num_labels"] = 1
    config.setdefault("pad_token_id", config.get("eos_token_id"))
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for file in sorted(path.glob("*.safetensors")):
        state = load_file(str(file))
        bias = [k for k in state if k in ("score.bias", "classifier.bias")]
        for key in bias:
            if bool(state[key].abs().max() > 0):
                raise ValueError(f"{file}: {key} is not zero; a reward head has no bias")
            del state[key]
        if bias:
            save_file(state, str(file), metadata={"format": "pt"})
            index = path / "model.safetensors.index.json"
            if index.is_file():
                data = json.loads(index.read_text())
                for key in bias:
                    data.get("weight_map", {}).pop(key, None)
                index.write_text(json.dumps(data, indent=2) + "\n")
