"""Validation: generate on the validation prompts, score them, report verl's metrics.

Sampling follows `actor_rollout_ref.rollout.val_kwargs` (verl's defaults: one greedy
sample per prompt; `n`, `do_sample`, `temperature`, `top_p`, `top_k` change it).
Samples are seeded by (seed, step, uid) like training ones, with uids of their own
(`val/...`). Metrics, per `data_source` (verl's naming):

- `val-core/<source>/reward/mean@n`: the mean score; `val-core/<source>/acc/mean@n`
  too when the reward function returns an "acc";
- with n > 1: `val-core/<source>/reward/pass@n` (a prompt passes when one of its n
  samples is correct: "acc" > 0 when given, else score > 0; unbiased estimator) and
  in `val-aux/<source>/reward/`: `std@n`, `best@n`, `worst@n` and `pass@k` for the
  powers of two k < n; other numeric reward keys as `val-aux/<source>/<key>/mean@n`.

Multi-turn rollouts add `val-aux/multi_turn/num_turns/mean` and
`val-aux/multi_turn/tool_calls/mean` (tool calls per episode).

The first `trainer.val_examples` generations of each validation are written to
`val_generations/step_<N>.jsonl` in the run directory (with their trajectories, for
multi-turn rollouts); with `trainer.validation_data_dir` set, all of them go to
`<validation_data_dir>/<N>.jsonl` too, in verl's fields (`rayrl.trainer.generations`).
"""

from __future__ import annotations

import json
import math
import numbers
import statistics
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from rayrl.batch import Batch
from rayrl.trainer.generations import GenerationsDir, generation_rows
from rayrl.trainer.stages import only_reads
from rayrl.workers.context import StageResult, StepContext
from rayrl.workers.reward import SCORE_READS


def _correct(sample: dict[str, Any]) -> bool:
    acc = sample["extra"].get("acc")
    if isinstance(acc, numbers.Real):
        return float(acc) > 0
    return cast(bool, sample["score"] > 0)


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Probability that k of n samples (`correct` of them right) include a right one."""
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def validation_metrics(samples: list[dict[str, Any]], n: int) -> dict[str, float]:
    """verl-named metrics from per-sample dicts {data_source, uid, score, extra}."""
    by_source: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for sample in samples:
        by_source[sample["data_source"]][sample["uid"]].append(sample)
    out: dict[str, float] = {}
    for source, prompts in sorted(by_source.items()):
        groups = list(prompts.values())
        scores = [[s["score"] for s in g] for g in groups]
        core, aux = f"val-core/{source}", f"val-aux/{source}"
        out[f"{core}/reward/mean@{n}"] = _mean([_mean(g) for g in scores])
        for key in _extra_keys(groups):
            values = [_mean([float(s["extra"][key]) for s in g]) for g in groups]
            prefix = core if key == "acc" else aux
            out[f"{prefix}/{key}/mean@{n}"] = _mean(values)
        if n > 1:
            right = [sum(_correct(s) for s in g) for g in groups]
            out[f"{core}/reward/pass@{n}"] = _mean(
                [pass_at_k(len(g), c, n) for g, c in zip(groups, right, strict=True)]
            )
            k = 1
            while k < n:
                out[f"{aux}/reward/pass@{k}"] = _mean(
                    [pass_at_k(len(g), c, k) for g, c in zip(groups, right, strict=True)]
                )
                k *= 2
            out[f"{aux}/reward/std@{n}"] = _mean([statistics.pstdev(g) for g in scores])
            out[f"{aux}/reward/best@{n}"] = _mean([max(g) for g in scores])
            out[f"{aux}/reward/worst@{n}"] = _mean([min(g) for g in scores])
    return out


def _extra_keys(groups: list[list[dict[str, Any]]]) -> list[str]:
    """Extra reward keys that every sample has as a finite number."""
    samples = [s for g in groups for s in g]
    keys = set(samples[0]["extra"]) if samples else set()
    for s in samples:
        keys &= {
            k
            for k, v in s["extra"].items()
            if isinstance(v, numbers.Real) and math.isfinite(float(v))
        }
    return sorted(keys)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


class Validator:
    """Validation of a policy on a prompt dataset.

    Args:
        dataset: the validation prompts (`collate(indices) -> Batch`, `len()`).
        generate: a group method `(prompts, StepContext) -> StageResult` (the actor's).
        score: a group method `(samples) -> Batch` with `scores` and `reward_extra`
            (the reward's).
        decode: token ids -> text (the tokenizer's `batch_decode`).
        n: samples per prompt (`rollout.val_kwargs.n`).
        batch_size: prompts per generate call (`data.val_batch_size`; None: all).
        examples: generations written per validation (`trainer.val_examples`).
        out_dir: where they go (`val_generations/` of the run directory).
        data_dir: where every generation goes (`trainer.validation_data_dir`; None:
            nowhere).
    """

    def __init__(
        self,
        dataset: Any,
        generate: Callable[[Batch, StepContext], StageResult],
        score: Callable[[Batch], Batch],
        decode: Callable[..., list[str]],
        *,
        n: int,
        batch_size: int | None,
        examples: int,
        out_dir: Path,
        data_dir: GenerationsDir | None = None,
    ) -> None:
        self.dataset, self.generate, self.score, self.decode = dataset, generate, score, decode
        self.n = n
        self.batch_size = batch_size or max(len(dataset), 1)
        self.examples = examples
        self.out_dir = Path(out_dir)
        self.data_dir = data_dir

    def run(self, step: int) -> dict[str, float]:
        """Validate the current policy; `step` is the global step it has trained."""
        samples: list[dict[str, Any]] = []
        rows: list[dict[str, Any]] = []  # for `data_dir`
        order = list(range(len(self.dataset)))
        ctx = StepContext(step=step, sampling="validate")
        for start in range(0, len(order), self.batch_size):
            prompts = self.dataset.collate(order[start : start + self.batch_size])
            prompts.non_tensors["uid"][:] = [f"val/{u}" for u in prompts["uid"]]
            prompts.meta["step"] = step
            out, scores = self._generated(prompts, ctx)
            samples.extend(self._samples(out, scores))
            if self.data_dir is not None:
                rows.extend(self._rows(out, scores, step))
        self._write_examples(samples, step)
        if self.data_dir is not None:
            self.data_dir.write(step, rows)
        metrics = validation_metrics(samples, self.n)
        if samples and "tool_calls" in samples[0]:
            for key in ("num_turns", "tool_calls"):
                values = [float(s[key]) for s in samples]
                metrics[f"val-aux/multi_turn/{key}/mean"] = _mean(values)
        return metrics

    def _generated(self, prompts: Batch, ctx: StepContext) -> tuple[Batch, Batch]:
        """The samples of `prompts` and their scores."""
        out = self.generate(prompts, ctx).batch
        return out, self.score(only_reads(out, SCORE_READS))

    def _rows(self, out: Batch, scores: Batch, step: int) -> list[dict[str, Any]]:
        """The samples as `data_dir` keeps them: the policy of `step` sampled them."""
        scored = out.union(scores.select(*[k for k in ("scores", "reward_extra") if k in scores]))
        return generation_rows(scored, self.decode, step=step, version=step)

    def _samples(self, out: Batch, scores: Batch) -> list[dict[str, Any]]:
        texts = self.decode(
            [
                row[m.bool()].tolist()
                for row, m in zip(out["responses"], out["response_mask"], strict=True)
            ],
            skip_special_tokens=True,
        )
        extras = list(scores["reward_extra"]) if "reward_extra" in scores else [{}] * len(out)
        samples = [
            {
                "data_source": out["data_source"][i],
                "uid": out["uid"][i],
                "score": float(scores["scores"][i]),
                "extra": extras[i] or {},
                "prompt": out["raw_prompt"][i],
                "response": texts[i],
                "ground_truth": out["ground_truth"][i],
            }
            for i in range(len(out))
        ]
        if "num_turns" in out.non_tensors:
            for i, sample in enumerate(samples):
                sample["num_turns"] = int(out["num_turns"][i])
                sample["tool_calls"] = sum(e["calls"] for e in out["tool_stats"][i].values())
                sample["trajectory"] = out["trajectory"][i]
        return samples

    def _write_examples(self, samples: list[dict[str, Any]], step: int) -> None:
        if self.examples <= 0:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with open(self.out_dir / f"step_{step}.jsonl", "w") as f:
            for s in samples[: self.examples]:
                f.write(json.dumps({"step": step, **s}, default=_plain) + "\n")


def _plain(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)
