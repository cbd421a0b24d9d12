"""Reward: scores responses with a rule-based function (a timeout-safe process pool),
a remote HTTP service, or a reward model, and puts the score on the last token. With
``reward.sandbox_fusion.url`` the built-in scorers' code data sources run their answers
against their test cases on that SandboxFusion server (`rayrl.rewards.code_sandbox`).

A sample whose function raises, hangs or returns no finite number scores 0 and is
counted (`reward/errors`); an outage of the HTTP service scores its items 0 too, and a
reward model's non-finite score. The run goes on until more than
`reward.max_error_rate` of the samples scored so far have failed, whatever the reward
kind (`rayrl.rewards.budget`); then it stops naming the reward, the counts and the
first failures. That count is the trainer's (`rayrl.trainer.scoring`): a step's rows
are split over the reward workers (`reward.workers_per_node` on each node), each of
which sees only its part. The reward model runs on the GPU its bundle reserves (one
per worker: each worker is a data-parallel rank of it), in bf16, with its scores
optionally clipped or tanh-bounded (`reward_model.score_transform`).
The result carries `token_level_scores` [b, R] (the score at each response's last
token), `scores` [b], `reward_elapsed_s` [b], `reward_error` and `reward_extra` (the
function's extra values, such as `acc`) columns: one row per sample, from which the
trainer computes the step's reward metrics (`reward_metrics`).

A multi-turn episode is scored on the text the model wrote (its sampled tokens, turn
by turn); its `extra_info` (a copy) also holds `num_turns` and
`rollout_reward_scores` (the rewards its tools gave, verl's names), `turn_scores`
(the environment's per-turn rewards) and `trajectory` (the messages: the prompt, each
assistant message with its parsed tool calls, each tool response as the model saw it),
so a `compute_score(data_source, solution_str, ground_truth, extra_info)` may use them.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from rayrl.batch import Batch
from rayrl.config.errors import ConfigError
from rayrl.config.reward import RewardModelConfig
from rayrl.config.schema import RayRLConfig
from rayrl.controller import DP_SPLIT, ONE_TO_ALL, Worker, register
from rayrl.rewards import HTTPReward, RewardResult, make_scorer, spec_from_config
from rayrl.rewards.budget import RATE_KEY, BoundedScores, ErrorBudget
from rayrl.rewards.code_sandbox import with_code_sandbox
from rayrl.rewards.items import make_items, summarize
from rayrl.rewards.judge import judge_metrics
from rayrl.rollout.text_codec import TextCodec
from rayrl.sandbox_fusion import SandboxFusion
from rayrl.workers.judge import (
    JudgeServer,
    RemoteJudge,
    check_judge,
    judge_enabled,
    judge_on_own_pool,
    judge_source,
    server_figures,
)
from rayrl.workers.model_placement import reward_model_placement

EPISODE_EXTRAS = {  # extra_info key -> the multi-turn rollout's column
    "num_turns": "num_turns",
    "rollout_reward_scores": "tool_rewards",
    "turn_scores": "turn_scores",
    "trajectory": "trajectory",
}

# The columns of the step's batch `compute_score` reads: the responses' tokens and mask
# (decoded here), what each row is scored against, and a multi-turn episode's columns.
# The trainer sends no others (`rayrl.trainer.stages.only_reads`).
SCORE_READS = (
    "responses",
    "response_mask",
    "data_source",
    "ground_truth",
    "extra_info",
    "raw_prompt",
    *EPISODE_EXTRAS.values(),
)


class RewardWorker(Worker):
    """One reward source per worker, chosen by the config's reward group."""

    def init_worker(self, config: RayRLConfig, tokenizer_path: str) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(
            tokenizer_path, trust_remote_code=config.actor_rollout_ref.model.trust_remote_code
        )
        self.codec = TextCodec(self.tokenizer)
        # an LLM judge (`rayrl.workers.judge`): a replica on the judge's own pool, or one
        # served in this process, sleeping between scorings as the rollout does while
        # the actor trains
        self.judge: JudgeServer | RemoteJudge | None = None
        if judge_on_own_pool(config):
            self.judge = RemoteJudge(config, self.rank, self.kv)
        elif judge_enabled(config):
            device, _ = reward_model_placement()
            self.judge = JudgeServer(config, device, sleeps=True)
        # counted here for `stats`; the run's budget is the trainer's (it sees every row)
        self.config = config
        source = make_source(config, self.judge)
        self.source = ErrorBudget(source, *error_policy(config), enforce=False)

    @register(dispatch=DP_SPLIT)
    def compute_score(self, batch: Batch) -> Batch:
        return self.score(batch)

    def score(self, batch: Batch) -> Batch:
        """Scores of `batch`'s responses (the actor's generate calls it directly when
        the reward runs in its process: `rayrl.trainer.ride_along`). A worker may get
        no rows (fewer rows than workers on its node)."""
        mask = batch["response_mask"]
        if len(batch) == 0:
            return scores_to_batch([], mask)
        texts = self.codec.decode_batch(response_token_lists(batch), skip_special_tokens=True)
        items = make_items(
            list(batch["data_source"]),
            texts,
            [{"ground_truth": gt} for gt in batch["ground_truth"]],
            episode_extra_info(batch),
            list(batch["raw_prompt"]) if "raw_prompt" in batch else None,
        )
        if self.judge is None:
            return scores_to_batch(self.source.score(items), mask)
        if isinstance(self.judge, RemoteJudge) and self.judge.refresh():
            # its replica was replaced: the scorer posts to the new one's address
            self.source.source = make_source(self.config, self.judge)
        with self.judge.awake():
            before, started = self.judge.stats(), time.perf_counter()
            results: list[RewardResult] = self.source.score(items)
            figures = server_figures(before, self.judge.stats(), time.perf_counter() - started)
        for result in results:
            result.extra.update(figures)
        return scores_to_batch(results, mask)

    @register(dispatch=ONE_TO_ALL)
    def stats(self) -> dict[str, Any]:
        return self.source.stats()


def response_token_lists(batch: Batch) -> list[list[int]]:
    """Each row's response tokens under its `response_mask` (the model's own tokens),
    converted once as arrays (indexing tensors row by row costs several times more)."""
    tokens = batch["responses"].cpu().numpy()
    keep = batch["response_mask"].cpu().numpy().astype(bool)
    return [row[m].tolist() for row, m in zip(tokens, keep, strict=True)]


def make_source(config: RayRLConfig, judge: JudgeServer | RemoteJudge | None = None) -> Any:
    """The reward source the config's reward group names: an LLM judge (`judge`, served
    by the caller), a reward model, the HTTP service, or a function (a user's file or the
    built-in scorers) through its manager."""
    r, rm, fn = config.reward, config.reward_model, config.custom_reward_function
    if judge is not None:
        return judge_source(config, judge.address, judge.tokenizer)
    if rm.enable:
        return _reward_model(rm)
    if r.http.url:
        return HTTPReward(r.http.url, timeout_s=r.http.timeout_s, retries=r.http.retries)
    kwargs = {**r.reward_kwargs, **fn.reward_kwargs}
    spec = spec_from_config(fn.path, fn.name, kwargs, pickled=fn.pickled)
    scorer = make_scorer(r.reward_manager.name, spec, r.num_workers, r.timeout_s)
    sandbox = r.sandbox_fusion
    if sandbox.url is None or not sandbox_scores_code(config):
        return scorer
    client = SandboxFusion(
        sandbox.url, max_concurrent=sandbox.max_concurrent, memory_limit_mb=sandbox.memory_limit_mb
    )
    return with_code_sandbox(scorer, client)


def _reward_model(rm: RewardModelConfig) -> BoundedScores:
    """The reward model `reward_model` names, on the device its bundle reserves."""
    from rayrl.rewards import ModelReward

    path, micro_batch_size = rm.model.path, rm.micro_batch_size_per_gpu
    if path is None or micro_batch_size is None:  # load_config checks and sets them
        raise ConfigError(
            "reward_model.enable=true needs reward_model.model.path and "
            "reward_model.micro_batch_size_per_gpu (rayrl.config.load_config sets them)"
        )
    device, dtype = reward_model_placement()
    model = ModelReward(
        path,
        device=device,
        dtype=dtype,
        micro_batch_size=micro_batch_size,
        max_length=rm.max_length,
    )
    return BoundedScores(model, rm.score_transform, rm.score_scale)


def sandbox_scores_code(config: RayRLConfig) -> bool:
    """Whether the code data sources run on `reward.sandbox_fusion.url`: a URL is set and
    the built-in scorers score (verl's rule: not a function of one's own)."""
    fn = config.custom_reward_function
    return bool(config.reward.sandbox_fusion.url) and not (fn.path or fn.pickled)


def check_reward_source(config: RayRLConfig) -> None:
    """What `make_source` would load that a mistake in the config can break, checked on
    the driver before Ray starts (RewardFunctionError, as the workers would raise it):
    the user's reward file and its function, read, not run; Python callables (pickled),
    loaded."""
    r, rm, fn = config.reward, config.reward_model, config.custom_reward_function
    if judge_enabled(config) and not fn.path:
        check_judge(config)
        return
    if (rm.enable and not fn.path) or r.http.url:
        return
    if fn.pickled:
        from rayrl.rewards.loader import resolve_function

        kwargs = {**r.reward_kwargs, **fn.reward_kwargs}
        resolve_function(spec_from_config(None, fn.name, kwargs, pickled=fn.pickled))
        return
    if not fn.path:
        return
    from rayrl.rewards.loader import DEFAULT_NAME, check_file

    check_file(fn.path, fn.name or DEFAULT_NAME)


def error_policy(config: RayRLConfig) -> tuple[float, str, str, str]:
    """The error budget of the config's reward: (rate, its key, the reward in words,
    what to check first), for `ErrorTally` / `ErrorBudget`."""
    r, rm, fn = config.reward, config.reward_model, config.custom_reward_function
    rate, key = r.max_error_rate, RATE_KEY
    if judge_enabled(config) and not fn.path:
        judge = r.judge
        return (
            rate,
            key,
            f"the LLM judge {rm.model.path} (reward.judge, parser {judge.parser})",
            "check the judge's verdicts against reward.judge.template and reward.judge.parser "
            "(the failures above quote them)",
        )
    if rm.enable and not fn.path:
        return rate, key, f"reward model {rm.model.path}", "check the reward model's scores"
    if r.http.url:
        if r.http.max_error_rate is not None:
            rate, key = r.http.max_error_rate, "reward.http.max_error_rate"
        return rate, key, f"HTTP reward {r.http.url}", "check the reward service"
    manager = r.reward_manager.name
    if fn.pickled:
        reward = f"reward functions {pickled_names(fn.pickled)} (reward manager {manager})"
        advice = (
            "fix the function (call it on one of the samples above: it must return a list "
            "of one finite score, or a number for rayrl's signature, within reward.timeout_s)"
        )
    elif fn.path:
        reward = (
            f"reward function {fn.name or 'compute_score'} in {fn.path} "
            f"(custom_reward_function.path/name, reward manager {manager})"
        )
        advice = (
            "fix the function (call it on one of the samples above: it must return a "
            "finite number, or a dict with a numeric 'score', within reward.timeout_s)"
        )
    elif sandbox_scores_code(config):
        url = r.sandbox_fusion.url
        reward = (
            f"the built-in reward scorers (reward manager {manager}), code data sources on "
            f"the SandboxFusion server {url} (reward.sandbox_fusion.url)"
        )
        advice = (
            f"check that the SandboxFusion server {url} is up and reachable from the reward "
            "workers, and each row's data_source and ground_truth (test cases for code)"
        )
    else:
        reward = f"the built-in reward scorers (reward manager {manager})"
        advice = "check each row's data_source and ground_truth against the built-in scorers"
    return rate, key, reward, advice


def pickled_names(pickled: str) -> str:
    """What reward functions given as Python callables are, in words."""
    from rayrl.rewards.loader import PickledFunction

    fn = PickledFunction(pickled).load()
    describe = getattr(fn, "describe", None)
    return describe() if describe is not None else repr(fn)


def episode_extra_info(batch: Batch) -> list[Any] | None:
    """Each row's `extra_info`, with its episode's columns added for a multi-turn rollout
    (`EPISODE_EXTRAS`; a copy: the batch's own column is left as it is)."""
    extras = list(batch["extra_info"]) if "extra_info" in batch else None
    if "num_turns" not in batch.non_tensors:
        return extras
    out = []
    for i in range(len(batch)):
        info = dict(extras[i] or {}) if extras is not None else {}
        for key, column in EPISODE_EXTRAS.items():
            if column in batch.non_tensors:
                info[key] = batch[column][i]
        out.append(info)
    return out


def _column(values: list[Any]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def scores_to_batch(results: list[RewardResult], response_mask: torch.Tensor) -> Batch:
    """Scores on each response's last real token, with errors, extras and scoring times
    kept per row."""
    scores = torch.tensor([r.score for r in results], dtype=torch.float32)
    token_scores = torch.zeros(response_mask.shape, dtype=torch.float32)
    lengths = response_mask.sum(-1).long()
    rows = torch.nonzero(lengths > 0).squeeze(-1)
    token_scores[rows, lengths[rows] - 1] = scores[rows]
    return Batch(
        {
            "token_level_scores": token_scores,
            "scores": scores,
            "reward_elapsed_s": torch.tensor([r.elapsed_s for r in results], dtype=torch.float64),
        },
        {
            "reward_error": _column([r.error for r in results]),
            "reward_extra": _column([dict(r.extra) for r in results]),
        },
    )


def reward_metrics(batch: Batch) -> dict[str, float]:
    """The scoring's metrics over ``batch``'s rows (`reward/score/mean`, `reward/errors`,
    `reward/elapsed_s/mean`, `reward/<extra>/mean`), from `scores_to_batch`'s columns."""
    results = rewards_from_batch(batch)
    out = {f"reward/{k}": v for k, v in summarize(results).items() if not k.startswith("judge/")}
    return out | judge_metrics(results)


def rewards_from_batch(batch: Batch) -> list[RewardResult]:
    """The per-sample results `scores_to_batch` stored in ``batch``'s columns."""
    elapsed = batch["reward_elapsed_s"].tolist() if "reward_elapsed_s" in batch else None
    return [
        RewardResult(
            score=float(batch["scores"][i]),
            extra=dict(batch["reward_extra"][i] or {}),
            error=batch["reward_error"][i],
            elapsed_s=elapsed[i] if elapsed is not None else 0.0,
        )
        for i in range(len(batch))
    ]
