"""GRPO from Python with reward functions and a dataset in TRL's style.

    .venv/bin/python examples/python_api.py [--model HF_DIR] [--steps 20] [--output-dir DIR] [--device auto|cpu|cuda]

The task is `rayrl demo`'s ("Which is larger, 31 or 47? Answer with the number only."),
built here as a list of dicts with TRL's `prompt` column and an `answer` column that the
reward functions receive. Two reward functions are summed: `exact` (1 for the right
number) and `digits_only` (the share of digits in the answer, which a random tiny model
learns within a few steps; the exact answer needs a model that knows more, as the demo's
SFT stage gives it). Without `--model` rayrl builds its tiny demo model in the run
directory. It trains on the GPU when Ray sees one (`--device cpu` keeps it on the CPU).
"""

from __future__ import annotations

import argparse
import random

from rayrl import GRPOTrainer


def exact(completions: list[str], answer: list[str], **kwargs: object) -> list[float]:
    """1.0 when the completion is the right number, else 0.0."""
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]


def digits_only(completions: list[str], **kwargs: object) -> list[float]:
    """The share of the completion's characters (spaces aside) that are digits."""
    texts = [c.replace(" ", "") for c in completions]
    return [sum(ch.isdigit() for ch in t) / len(t) if t else 0.0 for t in texts]


def larger_rows(size: int, seed: int = 0) -> list[dict]:
    """Questions of the `larger` task in TRL's columns."""
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        a, b = rng.sample(range(50), 2)
        question = f"Which is larger, {a} or {b}? Answer with the number only."
        rows.append({"prompt": question, "answer": str(max(a, b))})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a Hugging Face model directory")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--output-dir", default="outputs/python_api")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    args = parser.parse_args()

    trainer = GRPOTrainer(
        model=args.model,
        reward_funcs=[exact, digits_only],
        reward_weights=[1.0, 0.5],
        train_dataset=larger_rows(512),
        eval_dataset=larger_rows(64, seed=1),
        output_dir=args.output_dir,
        max_steps=args.steps,
        learning_rate=1e-2,  # the tiny model's; ~1e-6 for a real one
        num_generations=4,
        max_completion_length=8,
        beta=0.0,
        seed=1,
        eval_steps=args.steps,
        # any other setting: rayrl's dotted config keys, as `rayrl train` takes them
        **{
            "data.train_batch_size": 8,
            "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 32,
            "trainer.device": args.device,
        },
    )
    result = trainer.train()
    scores = [m["critic/score/mean"] for m in result.history]
    if scores:
        print(f"reward: {scores[0]:.3f} at the first step, {scores[-1]:.3f} at the last")
    if result.stopped:
        print(f"stopped early; run again to resume from {result.run_dir}/checkpoints")
    else:
        print(f"trained model: {result.model_dir} (transformers loads it directly)")


if __name__ == "__main__":
    main()
