"""The demo task learned from an LLM judge: a tiny judge SFT'd to grade it, then GRPO
with that judge as the only reward (`reward.judge.*`), on CPU.

Stages (the product's commands with the built-in `demo` configs, run in this process,
in `OUTPUT_DIR/<stage>`):

1. `base-model/`: the demo's tiny policy; `sft/`: `rayrl sft -c demo` on its
   demonstrations (right 30% of the time), as `rayrl demo` does;
2. `judge-sft/`: `rayrl sft -c demo` of a second tiny model (2 layers, hidden 128) on
   synthetic judge rows (`--judge-rows`, `--judge-steps` at `--judge-lr`, batches of
   `--judge-batch`): the judge prompt (`TEMPLATE`: the ground truth and a response) and
   the verdict `yes` / `no` the rule scorer gives that response. The responses are
   right, the demonstrator's mistake, another number, and the near misses a policy
   under RL finds (a digit changed, added or repeated, digit strings, two numbers, no
   number): a judge trained without them was fooled by "44" and RL learned to say it
   (docs/benchmarks.md, 2026-12-06). The template leaves the question out (the judge needs only the truth
   and the response; `{question}` is there for a template that needs it);
3. `rl/`: `rayrl train -c demo` from the SFT policy, rewarded only by the judge
   (`reward.reward_model.enable=true`, `reward.reward_model.model_path=judge-sft/hf`,
   `reward.judge.template=...`, `reward.judge.parser=label`, labels yes: 1, no: 0),
   served in the reward worker's process;
4. `val-sft/`, `val-rl/`: `rayrl train -c demo trainer.val_only=true` of the SFT and
   the RL policy with the rule scorer: greedy accuracy on the held-out questions.

Prints JSON lines: `judge_agreement` (the judge's greedy verdicts against the rule
scorer on held-out judge rows), `accuracy_before_rl`, `accuracy_after_rl`, `rl_gain`
(points, target >= 10), the judge's metrics over the RL run (`judge_tokens_per_s`,
`judge_parse_failures`, `judge_latency_s`, `judge_batch`, `judge_score_mean` first and
last steps), and `wall_s`. The stages' own output goes to stderr.

Usage: `python bench/judge_demo_cpu.py [--seed 1] [--output-dir DIR] [--judge-steps N]
[--judge-rows N] [--judge-only] [--reuse] [KEY=VALUE ...]` (overrides of the RL stage;
`--judge-only` stops after the judge's agreement; `--reuse` keeps the SFT policy and
judge an earlier run left in OUTPUT_DIR). About 8 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import tempfile
import time
from pathlib import Path

from _common import emit_line

BENCH = "judge_demo_cpu"
TEMPLATE = "Truth: {ground_truth}\nAnswer: {response}\nRight?"
LABELS = {"yes": 1, "no": 0}
JUDGE_MODEL = {"layers": 2, "hidden": 128}

emit = functools.partial(emit_line, BENCH)


def judge_response(rng: random.Random, answer: str, mistake: str) -> str:
    """A response to grade: right, the demonstrator's mistake, another number, or the
    near misses and junk a policy under RL tries (a digit changed, dropped or repeated,
    digit strings, two numbers, no number): a judge that never saw them is fooled by
    them, and RL finds them."""
    digits = "0123456789"
    other = str(rng.choice([n for n in range(50) if str(n) not in (answer, mistake)]))
    changed = list(answer)
    changed[rng.randrange(len(changed))] = rng.choice(digits)
    kinds = [
        (0.30, lambda: answer),
        (0.14, lambda: mistake),
        (0.08, lambda: other),
        (0.08, lambda: "".join(changed)),  # a digit changed (sometimes to itself)
        (0.06, lambda: answer + rng.choice(digits) * rng.randint(1, 3)),  # digits added
        (0.06, lambda: answer[0] * rng.randint(1, 6)),  # its first digit repeated
        (0.08, lambda: "".join(rng.choice(digits) for _ in range(rng.randint(1, 8)))),
        (0.05, lambda: f"{mistake} {answer}"),  # the last number counts: right
        (0.05, lambda: f"{answer} {mistake}"),
        (0.04, lambda: answer[0] if len(answer) > 1 else other),
        (0.03, lambda: rng.choice(["larger", "the", "", "or", "number"])),
        (0.03, lambda: f"{answer}{rng.choice(['.', '?', ' is'])}"),
    ]
    pick, total = rng.random(), 0.0
    for weight, make in kinds:
        total += weight
        if pick < total:
            return make()
    return answer


def judge_rows(size: int, seed: int) -> list[dict]:
    """SFT rows for the judge: the judge prompt and the rule scorer's verdict, over the
    questions of the demo task's demonstrations (their answers all the mistake)."""
    from rayrl.data.synthetic import demonstrations
    from rayrl.rewards.arithmetic import compute_score
    from rayrl.rewards.judge import render_template

    rng = random.Random(f"judge:{seed}")
    rows = []
    for demo in demonstrations("larger", size, seed, correct_rate=0.0):
        answer, mistake = demo["extra_info"]["ground_truth"], demo["answer"]
        response = judge_response(rng, answer, mistake)
        item = {
            "prompt": [{"role": "user", "content": demo["question"]}],
            "solution_str": response,
            "ground_truth": answer,
        }
        right = compute_score(response, answer)["acc"] == 1.0
        rows.append(
            {
                "question": render_template(TEMPLATE, item),
                "answer": "yes" if right else "no",
                "item": item,
            }
        )
    return rows


def write_parquet(rows: list[dict], path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist([{"question": r["question"], "answer": r["answer"]} for r in rows])
    pq.write_table(table, path)
    return path


def judge_keys(judge_dir: Path) -> list[str]:
    return [
        "reward.reward_model.enable=true",
        f"reward.reward_model.model_path={judge_dir}",
        f"reward.judge.template={json.dumps(TEMPLATE)}",
        "reward.judge.parser=label",
        f"reward.judge.labels={json.dumps(LABELS)}",
        "reward.judge.max_tokens=3",
        "reward.judge.temperature=0",
        "reward.reward_model.rollout.prompt_length=256",
    ]


def agreement(judge_dir: Path, rows: list[dict]) -> tuple[float, float]:
    """(the judge's agreement with the rule scorer, its parse failures), over `rows`."""
    from rayrl.config import load_config
    from rayrl.rewards.judge import LLMJudge
    from rayrl.rewards.verdicts import make_parser
    from rayrl.workers.judge import JudgeServer

    server = JudgeServer(load_config("demo", judge_keys(judge_dir)), "cpu")
    try:
        judge = LLMJudge(server.address, TEMPLATE, make_parser("label", LABELS), max_tokens=3)
        results = judge.score([r["item"] for r in rows])
    finally:
        server.close()
    agree = sum(
        r.ok and r.score == LABELS[row["answer"]] for r, row in zip(results, rows, strict=True)
    )
    return agree / len(rows), sum(not r.ok for r in results) / len(rows)


def val_accuracy(
    root: Path, stage: str, model: Path, seed: int, out, extra: tuple[str, ...] = ()
) -> float:
    """Greedy held-out accuracy of `model` with the rule scorer (`rayrl train -c demo
    trainer.val_only=true`, with the `extra` keys the stages shared)."""
    from rayrl.cli.demo_cmd import _val
    from rayrl.cli.train_cmd import train
    from rayrl.config import load_config

    cfg = load_config(
        "demo",
        [
            f"trainer.seed={seed}",
            "trainer.resume_mode=disable",
            "trainer.logger=[jsonl]",
            "trainer.val_only=true",
            f"trainer.output_dir={root / stage}",
            f"actor_rollout_ref.model.path={model}",
            *extra,
        ],
    )
    train(cfg, out)
    return _val(root / stage, last=False)[0]


def main() -> None:
    from rayrl.cli.common import console
    from rayrl.cli.demo_cmd import DemoPlan, stage_configs
    from rayrl.cli.sft_cmd import sft
    from rayrl.cli.train_cmd import train
    from rayrl.config.sft import load_sft_config
    from rayrl.models import build_tiny_model
    from rayrl.trainer.model_dir import DEMO_MODEL

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--output-dir", default=None, help="default: a temporary directory")
    parser.add_argument("--judge-rows", type=int, default=8192)
    parser.add_argument("--judge-steps", type=int, default=2500)
    parser.add_argument("--judge-only", action="store_true", help="stop after the judge")
    parser.add_argument("--judge-lr", type=float, default=1e-3)
    parser.add_argument("--judge-batch", type=int, default=64)
    parser.add_argument(
        "--reuse", action="store_true", help="keep the SFT policy and judge OUTPUT_DIR holds"
    )
    parser.add_argument("overrides", nargs="*", help="overrides of the RL stage")
    args = parser.parse_args()
    root = Path(args.output_dir or tempfile.mkdtemp(prefix="rayrl-judge-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    out = console(stderr=True)
    start = time.perf_counter()

    # 1. the policy: the demo's tiny model and its SFT on imperfect demonstrations
    rl_keys = ["trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.logger=[jsonl]"]
    judge_dir = root / "judge-sft" / "hf"
    plan = DemoPlan(root, seed=args.seed, rl=[*rl_keys, *judge_keys(judge_dir), *args.overrides])
    _, sft_cfg, rl_cfg = stage_configs(plan)
    if not (args.reuse and (root / "sft" / "hf").is_dir()):
        build_tiny_model(root / "base-model", **DEMO_MODEL, seed=args.seed, overwrite=True)
        sft(sft_cfg, out)

    # 2. the judge: a tiny model SFT'd on graded responses
    rows = judge_rows(args.judge_rows + 256, seed=1000 + args.seed)
    train_file = write_parquet(rows[: args.judge_rows], root / "judge-train.parquet")
    val_file = write_parquet(rows[args.judge_rows :], root / "judge-val.parquet")
    if not (args.reuse and judge_dir.is_dir()):
        build_tiny_model(root / "judge-base", **JUDGE_MODEL, seed=args.seed + 7, overwrite=True)
    judge_cfg = load_sft_config(
        "demo",
        [
            f"trainer.seed={args.seed}",
            "trainer.resume_mode=disable",
            "trainer.logger=[]",
            f"trainer.output_dir={root / 'judge-sft'}",
            f"model.partial_pretrain={root / 'judge-base'}",
            f"data.train_files={train_file}",
            f"data.val_files={val_file}",
            "data.max_length=96",
            f"trainer.total_training_steps={args.judge_steps}",
            f"optim.lr={args.judge_lr}",
            f"data.train_batch_size={args.judge_batch}",
            f"data.micro_batch_size_per_gpu={args.judge_batch}",
        ],
    )
    if not (args.reuse and judge_dir.is_dir()):
        sft(judge_cfg, out)
    agree, parse_fail = agreement(judge_dir, rows[args.judge_rows :])
    emit("judge_agreement", agree, "fraction", parse_failures=parse_fail, rows=256)
    if args.judge_only:
        return

    # 3. GRPO with the judge as the only reward; 4. held-out accuracy by the rule scorer
    history = train(rl_cfg, out)
    before = val_accuracy(root, "val-sft", root / "sft" / "hf", args.seed, out)
    after = val_accuracy(root, "val-rl", root / "rl" / "hf", args.seed, out)
    seed = {"seed": args.seed, "steps": len(history)}
    emit("accuracy_before_rl", before, "fraction", **seed)
    emit("accuracy_after_rl", after, "fraction", **seed)
    emit("rl_gain", 100 * (after - before), "points", target=10, better="higher", **seed)
    for key in ("tokens_per_s", "parse_failures", "latency_s", "batch"):
        values = [m[f"judge/{key}"] for m in history if f"judge/{key}" in m]
        if values:
            emit(f"judge_{key}", sum(values) / len(values), key, steps=len(values))
    scores = [m["judge/score/mean"] for m in history if "judge/score/mean" in m]
    if scores:
        emit("judge_score_mean", scores[-1], "score", first=scores[0], steps=len(scores))
    emit("wall_s", time.perf_counter() - start, "s", output_dir=str(root))


if __name__ == "__main__":
    main()
