"""On-policy distillation on the demo task: a tiny student learns from a larger SFT'd
teacher's log-probs alone (no task reward), on CPU.

Stages (the product's commands with the built-in `demo` configs, run in this process,
in `OUTPUT_DIR/<stage>`):

1. `teacher-sft/`: `rayrl sft -c demo` of a larger tiny model (`--teacher-size`, 4
   layers of hidden 192) on right demonstrations (`data.synthetic_correct_rate=1.0`);
2. `sft/`: the student, a smaller tiny model (`--student-size`, 2 layers of hidden 128),
   SFT'd on the demo's imperfect demonstrations (right 30% of the time), as `rayrl demo`
   does. Every stage asks `--train-size` training questions (2048: with the demo's 512 a
   student this small learns the training questions, not the comparison) and validates
   on the held-out ones of `--val-size` drawn (214 of 512 are not training questions);
3. `distill/`: `rayrl train -c demo` from the student's SFT with
   `distillation.enabled=true`, the teacher's `hf/` as
   `distillation.teacher_models.teacher_model.model_path`, and
   `distillation.distillation_loss.use_task_rewards=false`: the student's only signal is
   the per-token divergence to the teacher (`--loss-mode`, supervised or, with
   `--policy-gradient`, as each token's advantage);
4. `val-*`: greedy held-out accuracy of the teacher, the student before and after, by
   the rule scorer (`rayrl train -c demo trainer.val_only=true`).

Prints JSON lines (with `val_rows`, the held-out questions): `accuracy_teacher`, `accuracy_student_before`,
`accuracy_student_after`, `gap_closed` (the fraction of the teacher-student gap the
distillation closed; target >= 0.5), the divergence over the run (`reverse_kl` first and
last steps), and `wall_s`. The stages' own output goes to stderr.

Usage: `python bench/distill_demo_cpu.py [--seed 1] [--output-dir DIR] [--steps 60]
[--loss-mode k3] [--policy-gradient] [--teacher-size 4x192] [--student-size 2x128]
[--train-size 2048] [--val-size 512] [--reuse] [KEY=VALUE ...]` (overrides of the
distillation stage; `--reuse` keeps the SFT'd teacher and student an earlier run left).
About 4 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
from pathlib import Path

from _common import emit_line
from judge_demo_cpu import val_accuracy

BENCH = "distill_demo_cpu"

emit = functools.partial(emit_line, BENCH)


def teacher_sft(root: Path, seed: int, steps: int, size: dict, shared: list[str], out) -> Path:
    """The teacher: a larger tiny model SFT'd on right demonstrations; its `hf/`."""
    from rayrl.cli.sft_cmd import sft
    from rayrl.config.sft import load_sft_config
    from rayrl.models import build_tiny_model

    build_tiny_model(root / "teacher-base", **size, seed=seed + 7, overwrite=True)
    cfg = load_sft_config(
        "demo",
        [
            f"trainer.seed={seed}",
            "trainer.resume_mode=disable",
            "trainer.logger=[]",
            f"trainer.output_dir={root / 'teacher-sft'}",
            f"model.partial_pretrain={root / 'teacher-base'}",
            "data.synthetic_correct_rate=1.0",
            f"trainer.total_training_steps={steps}",
            *shared,
        ],
    )
    sft(cfg, out)
    return root / "teacher-sft" / "hf"


def held_out_rows(cfg) -> int:
    """How many held-out questions the validation asks (those the training set also
    asks are dropped from the `val_size` drawn)."""
    from rayrl.trainer.data import synthetic_val_rows

    return len(synthetic_val_rows(cfg))


def size(text: str) -> dict:
    """`LAYERSxHIDDEN` as `build_tiny_model`'s sizes."""
    layers, hidden = (int(part) for part in text.lower().split("x"))
    return {"layers": layers, "hidden": hidden}


def distill_keys(teacher: Path, args: argparse.Namespace) -> list[str]:
    """The distillation stage's keys: the teacher, the loss, no task reward."""
    loss = "distillation.distillation_loss"
    return [
        "distillation.enabled=true",
        f"distillation.teacher_models.teacher_model.model_path={teacher}",
        f"{loss}.use_task_rewards=false",
        f"{loss}.loss_mode={args.loss_mode}",
        f"{loss}.use_policy_gradient={str(args.policy_gradient).lower()}",
        f"trainer.total_training_steps={args.steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.logger=[jsonl]",
    ]


def main() -> None:
    from rayrl.cli.common import console
    from rayrl.cli.demo_cmd import DemoPlan, stage_configs
    from rayrl.cli.sft_cmd import sft
    from rayrl.cli.train_cmd import train
    from rayrl.models import build_tiny_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--output-dir", default=None, help="default: a temporary directory")
    parser.add_argument("--steps", type=int, default=60, help="distillation steps")
    parser.add_argument("--teacher-steps", type=int, default=800)
    parser.add_argument("--teacher-size", default="4x192", help="LAYERSxHIDDEN")
    parser.add_argument("--student-size", default="2x128", help="LAYERSxHIDDEN")
    parser.add_argument("--loss-mode", default="k3")
    parser.add_argument("--train-size", type=int, default=2048, help="training questions")
    parser.add_argument("--val-size", type=int, default=512, help="held-out questions asked")
    parser.add_argument("--policy-gradient", action="store_true")
    parser.add_argument("--reuse", action="store_true", help="keep the SFT'd teacher, student")
    parser.add_argument("overrides", nargs="*", help="overrides of the distillation stage")
    args = parser.parse_args()
    root = Path(args.output_dir or tempfile.mkdtemp(prefix="rayrl-distill-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    out = console(stderr=True)
    start = time.perf_counter()

    teacher = root / "teacher-sft" / "hf"
    shared = [f"data.synthetic_size={args.train_size}", f"data.synthetic_val_size={args.val_size}"]
    if not (args.reuse and teacher.is_dir()):
        teacher = teacher_sft(
            root, args.seed, args.teacher_steps, size(args.teacher_size), shared, out
        )
    plan = DemoPlan(
        root, seed=args.seed, shared=shared, rl=[*distill_keys(teacher, args), *args.overrides]
    )
    _, sft_cfg, rl_cfg = stage_configs(plan)
    rl_cfg.trainer.output_dir = str(root / "distill")
    if not (args.reuse and (root / "sft" / "hf").is_dir()):
        build_tiny_model(
            root / "base-model", **size(args.student_size), seed=args.seed, overwrite=True
        )
        sft(sft_cfg, out)
    history = train(rl_cfg, out)

    seed = {"seed": args.seed, "steps": len(history), "loss_mode": args.loss_mode}
    seed["train_size"] = args.train_size
    seed["val_rows"] = held_out_rows(rl_cfg)
    seed["policy_gradient"] = args.policy_gradient
    acc_teacher = val_accuracy(root, "val-teacher", teacher, args.seed, out, tuple(shared))
    before = val_accuracy(root, "val-sft", root / "sft" / "hf", args.seed, out, tuple(shared))
    after = val_accuracy(
        root, "val-distill", root / "distill" / "hf", args.seed, out, tuple(shared)
    )
    emit("accuracy_teacher", acc_teacher, "fraction", **seed)
    emit("accuracy_student_before", before, "fraction", **seed)
    emit("accuracy_student_after", after, "fraction", **seed)
    gap = acc_teacher - before
    closed = (after - before) / gap if gap > 0 else float("nan")
    emit("gap_closed", closed, "fraction", target=0.5, better="higher", **seed)
    kl = [m["distillation/reverse_kl"] for m in history if "distillation/reverse_kl" in m]
    if kl:
        emit("reverse_kl", kl[-1], "nats/token", first=kl[0], **seed)
    emit("wall_s", time.perf_counter() - start, "s", output_dir=str(root))


if __name__ == "__main__":
    main()
