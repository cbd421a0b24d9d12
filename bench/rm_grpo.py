"""GRPO scored by a reward model that `rayrl rm` trained, on CPU: does the policy learn?

Stages (the built-in `demo` configs, seed `--seed`):

1. `rayrl rm -c demo`: a reward model from preference pairs of the synthetic `larger`
   task (chosen: the right answer; rejected: the smaller number); its held-out pair
   accuracy (`val/preference_accuracy`) and that of `rayrl.rewards.model.ModelReward`
   scoring the held-out pairs from the exported `hf/` (the loader `rayrl train` uses);
2. `rayrl demo`'s stages (a tiny model, `rayrl sft -c demo` on demonstrations right
   30% of the time, then `rayrl train -c demo`'s GRPO) with GRPO scored by that reward
   model (`reward_model.enable=true reward_model.model.path=RM/hf`) instead of the
   exact reward, and a KL loss against the SFT model (`--kl`, default 1.0; the demo's
   GRPO has none). Without it (`--kl 0`) GRPO learns what the tiny reward model
   overrates, answers that are not in the question, and the exact accuracy falls
   (seen: 17% -> 12%, while the reward model's score rose from -1.2 to 3.8);
3. the exact reward's greedy validation accuracy (the held-out questions) of the model
   GRPO started from and of the one it ended with (`trainer.val_only=true`, rule-based
   scorer): the policy learned the task if the second is higher.

Prints one JSON object per line: `rm_val_pair_accuracy`, `rm_export_pair_accuracy`,
`rm_score_before_rl` / `rm_score_after_rl` (mean reward-model score at the RL run's
first and last validation), `accuracy_before_rl` / `accuracy_after_rl` (exact reward)
and `rl_gain` in points, `wall_s`. Usage: `python bench/rm_grpo.py [--seed 1]
[--output-dir DIR] [--kl 1.0]`.
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
import time
from pathlib import Path

from _common import emit_line

BENCH = "rm_grpo"
emit = functools.partial(emit_line, BENCH)


def export_pair_accuracy(hf: Path, seed: int) -> float:
    """ModelReward's held-out pair accuracy from the exported reward model."""
    from rayrl.config.pref import load_pref_config
    from rayrl.data.synthetic import preference_pairs
    from rayrl.rewards.model import ModelReward

    d = load_pref_config("rm", "demo").data
    _, val = preference_pairs(d.synthetic_task, d.synthetic_size, seed, d.synthetic_val_size)
    model = ModelReward(hf)
    prompts = [r["prompt"] for r in val]
    chosen = model.score_chats(prompts, [r["chosen"] for r in val])
    rejected = model.score_chats(prompts, [r["rejected"] for r in val])
    return sum(c > r for c, r in zip(chosen, rejected, strict=True)) / len(val)


def exact_accuracy(model: Path, out: Path, seed: int, console) -> float:
    """Greedy validation accuracy of `model` with the exact (rule-based) reward."""
    from rayrl.cli.demo_cmd import _val
    from rayrl.cli.train_cmd import train
    from rayrl.config import load_config

    cfg = load_config(
        "demo",
        [
            f"actor_rollout_ref.model.path={model}",
            "trainer.val_only=true",
            f"trainer.seed={seed}",
            f"trainer.output_dir={out}",
            "trainer.logger=[]",
            "trainer.resume_mode=disable",
        ],
    )
    train(cfg, console)
    return _val(out, last=True)[0]


def main() -> None:
    from rayrl.cli.common import console
    from rayrl.cli.demo_cmd import REWARD_KEY
    from rayrl.cli.pref_cmd import train_pairs
    from rayrl.cli.sft_cmd import sft
    from rayrl.cli.train_cmd import train
    from rayrl.config import load_config
    from rayrl.config.pref import load_pref_config
    from rayrl.config.sft import load_sft_config
    from rayrl.models import build_tiny_model
    from rayrl.trainer.run_dir import read_metrics

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--output-dir", default=None, help="default: a temporary directory")
    parser.add_argument("--kl", type=float, default=1.0, help="GRPO's KL loss coefficient")
    args = parser.parse_args()
    root = Path(args.output_dir or tempfile.mkdtemp(prefix="rayrl-rm-grpo-"))
    err = console(stderr=True)
    start = time.perf_counter()
    common = [f"trainer.seed={args.seed}", "trainer.logger=[]", "trainer.resume_mode=disable"]
    rm_cfg = load_pref_config("rm", "demo", [*common, f"trainer.output_dir={root / 'rm'}"])
    train_pairs(rm_cfg, err, table_rows=5)
    rm_val = [r for r in read_metrics(root / "rm") if "val/preference_accuracy" in r]
    emit("rm_val_pair_accuracy", rm_val[-1]["val/preference_accuracy"], "fraction", target=0.9)
    emit("rm_export_pair_accuracy", export_pair_accuracy(root / "rm" / "hf", args.seed), "fraction")

    demo = root / "demo"
    build_tiny_model(demo / "base-model", seed=args.seed, overwrite=True)
    sft_cfg = load_sft_config(
        "demo",
        [
            *common,
            f"trainer.output_dir={demo / 'sft'}",
            f"model.partial_pretrain={demo / 'base-model'}",
        ],
    )
    sft(sft_cfg, err, table_rows=5)
    rl_cfg = load_config(
        "demo",
        [
            *common,
            f"trainer.output_dir={demo / 'rl'}",
            f"actor_rollout_ref.model.path={demo / 'sft' / 'hf'}",
            "trainer.export_hf=true",
            # the KL term keeps the policy near its start, where the reward model was
            # trained; without it GRPO finds the answers the tiny reward model overrates
            # (numbers not in the question) and the exact accuracy falls
            "actor_rollout_ref.actor.use_kl_loss=true",
            f"actor_rollout_ref.actor.kl_loss_coef={args.kl}",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=128",
            "reward_model.enable=true",
            f"reward_model.model.path={root / 'rm' / 'hf'}",
        ],
    )
    train(rl_cfg, err, table_rows=10)
    scores = [
        next(v for k, v in r.items() if REWARD_KEY.match(k))
        for r in read_metrics(demo / "rl")
        if any(REWARD_KEY.match(k) for k in r)
    ]
    emit("rm_score_before_rl", scores[0], "score", reward="reward model")
    emit("rm_score_after_rl", scores[-1], "score", reward="reward model")
    before = exact_accuracy(demo / "sft" / "hf", root / "val-sft", args.seed, err)
    after = exact_accuracy(demo / "rl" / "hf", root / "val-rl", args.seed, err)
    emit("accuracy_before_rl", before, "fraction", reward="exact")
    emit("accuracy_after_rl", after, "fraction", reward="exact")
    emit("rl_gain", 100 * (after - before), "points", better="higher")
    emit("wall_s", time.perf_counter() - start, "s", better="lower")
    print(json.dumps({"output_dir": str(root)}))


if __name__ == "__main__":
    main()
