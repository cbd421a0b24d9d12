"""rayrl's DPO loss and reward metrics against TRL's DPOTrainer on the same batch (issue 50).

One batch of preference pairs of the synthetic `larger` task, tokenized by rayrl
(`rayrl.data.preference.PairDataset`, the chat template's prompt, the response and
its end-of-sequence token), goes through both:

- rayrl: the policy's and the reference's response log-probs from `TrainEngine.forward`
  (two tiny models of different seeds, so the log-ratios are not zero), then
  `rayrl.workers.pref.pair_loss_fn`, the loss `rayrl dpo` trains with;
- TRL: `DPOTrainer.compute_loss` on the same token ids, collated by TRL's
  `DataCollatorForPreference` (prompt ids, chosen ids, rejected ids), with the same
  two models as `model` and `ref_model`; its metrics from the trainer's log buffer.

For each objective (`dpo` = TRL's `sigmoid`, `ipo`, `robust` with label smoothing 0.1)
it prints one JSON line per quantity: `loss`, `rewards/chosen`, `rewards/rejected`,
`rewards/accuracies`, `rewards/margins`, `logps/chosen`, `logps/rejected`, with both
values and `abs_diff` (target <= 1e-5), and a last line `max_abs_diff` over all of
them. Exit code 1 when a difference is over 1e-5.

Needs TRL 1.16 (`pip install -e .[bench]`); without it the script says so and exits 2.
Usage: `python bench/dpo_vs_trl.py [--pairs 8] [--beta 0.1]`. Seen on CPU with TRL 1.16.0
(2026-12-06): every quantity of the three objectives within 2e-6 (the summed log-probs,
about -17 in float32), the losses and rewards within 2e-8.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
from pathlib import Path

from _common import emit_line

BENCH = "dpo_vs_trl"
emit = functools.partial(emit_line, BENCH)
TOLERANCE = 1e-5
OBJECTIVES = {"dpo": ("sigmoid", 0.0), "ipo": ("ipo", 0.0), "robust": ("robust", 0.1)}
KEYS = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def rayrl_side(policy_dir, ref_dir, data, name, beta, smoothing) -> dict[str, float]:
    """rayrl's loss and metrics of the batch: engine log-probs, then `pair_loss_fn`."""
    import torch

    from rayrl.algos.preference import sequence_logps
    from rayrl.train.engine import TrainEngine
    from rayrl.workers.pref import pair_loss_fn

    batch = data.collate(list(range(len(data))))
    policy = TrainEngine(policy_dir, device="cpu", trainable=False, use_remove_padding=True)
    ref = TrainEngine(ref_dir, device="cpu", trainable=False, use_remove_padding=True)
    mask = batch["response_mask"].float()
    batch["ref_logps"] = sequence_logps(ref.forward(batch)["log_probs"], mask)
    outputs = {"log_probs": policy.forward(batch)["log_probs"]}
    batch.meta["global_seq_count"] = float(len(batch))
    with torch.no_grad():
        loss, metrics = pair_loss_fn(name, beta, smoothing)(outputs, batch)
    return {"loss": float(loss), **{k: float(v) for k, v in metrics.items()}}


def trl_side(policy_dir, ref_dir, data, tokenizer, loss_type, beta, smoothing, out):
    """TRL's loss and metrics of the same token ids (`DPOTrainer.compute_loss`)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    examples = [
        {"prompt_ids": chosen[0], "chosen_ids": chosen[1], "rejected_ids": rejected[1]}
        for chosen, rejected in data.pairs
    ]
    text = Dataset.from_list([{"prompt": "Q?", "chosen": "a", "rejected": "b"}] * 2)
    args = DPOConfig(
        output_dir=str(out),
        beta=beta,
        loss_type=[loss_type],
        label_smoothing=smoothing,
        report_to="none",
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=len(examples),
        gradient_checkpointing=False,
    )
    model = AutoModelForCausalLM.from_pretrained(policy_dir)
    ref_model = AutoModelForCausalLM.from_pretrained(ref_dir)
    trainer = DPOTrainer(
        model=model, ref_model=ref_model, args=args, train_dataset=text, processing_class=tokenizer
    )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    inputs = DataCollatorForPreference(pad_token_id=pad)(examples)
    trainer.model.train()
    import torch

    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, inputs)
    metrics = trainer._metrics["train"]
    return {"loss": float(loss), **{k: float(metrics[k][-1]) for k in KEYS if k != "loss"}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--beta", type=float, default=0.1)
    args = parser.parse_args()
    try:
        import trl
    except ImportError:
        print(
            "dpo_vs_trl: TRL is not installed here; install the bench extra "
            "(pip install -e '.[bench]', TRL 1.16) to compare rayrl's DPO with TRL's. "
            "The loss formulas are checked without it by tests/test_pref_loss.py.",
            file=sys.stderr,
        )
        return 2
    from transformers import AutoTokenizer

    from rayrl.data.preference import PairDataset
    from rayrl.data.synthetic import preference_pairs
    from rayrl.models import build_tiny_model

    root = Path(tempfile.mkdtemp(prefix="rayrl-dpo-trl-"))
    policy_dir = build_tiny_model(root / "policy", seed=1)
    ref_dir = build_tiny_model(root / "ref", seed=2)
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    rows, _ = preference_pairs("larger", args.pairs, seed=4)
    data = PairDataset(rows, tokenizer, max_length=128)
    worst = 0.0
    for name, (loss_type, smoothing) in OBJECTIVES.items():
        ours = rayrl_side(policy_dir, ref_dir, data, name, args.beta, smoothing)
        theirs = trl_side(
            policy_dir, ref_dir, data, tokenizer, loss_type, args.beta, smoothing, root / name
        )
        for key in KEYS:
            diff = abs(ours[key] - theirs[key])
            worst = max(worst, diff)
            emit(
                key,
                ours[key],
                "value",
                objective=name,
                trl_loss_type=loss_type,
                trl=theirs[key],
                abs_diff=diff,
                target=TOLERANCE,
                trl_version=trl.__version__,
            )
    emit("max_abs_diff", f"{worst:.3e}", "abs", target=TOLERANCE, better="lower")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
