"""The LLM judge's configuration: the engine that serves it (verl 0.9.1's
`reward.reward_model.rollout.*`, which lands on `reward_model.rollout`) and rayrl's
built-in judge (`reward.judge.*`: a prompt template and a verdict parser, no user code).

A judge runs when `reward_model.enable` is true and either a reward function of one's
own is set (`custom_reward_function.path`: verl's generative reward model, the
function posts to the judge's OpenAI-compatible server) or `reward.judge.template` is
(the built-in judge). Without either, `reward_model.model.path` is a discriminative
reward model (a sequence classifier): `rayrl.config.judge_mode` says which.
`rayrl.rewards.judge` scores with it; `rayrl.workers.judge` serves it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class JudgeRolloutConfig:
    """The judge model's engine, verl's `reward.reward_model.rollout` keys. rayrl's
    departure: `tensor_model_parallel_size` is 1 (verl: 2), one judge replica per
    bundle; `name` auto picks rayrl's native engine on a GPU where the model's family
    allows it, else hf (verl's vllm / sglang mean auto)."""

    name: str = "auto"  # auto | hf | native (vllm, sglang: auto)
    dtype: str = "bfloat16"  # on a CPU the judge runs in float32
    gpu_memory_utilization: float = 0.5  # the native engine's share of its GPU
    tensor_model_parallel_size: int = 1
    # requests the engine holds at once (continuous batching); more wait their turn
    max_num_seqs: int = 1024
    # a judge prompt's token limit (longer ones are refused: HTTP 400, a reward error)
    prompt_length: int = 2048
    # the most tokens a verdict may take (a request's max_tokens is capped by it)
    response_length: int = 2048
    temperature: float = 1.0  # a request without temperature samples at this one
    top_k: int = -1
    top_p: float = 1.0
    do_sample: bool = True
    seed: int = 42  # with the request's tokens, fixes every verdict's draws
    # free the judge engine's memory between scorings (it sleeps while the actor trains)
    free_cache_engine: bool = True


@dataclass
class JudgeConfig:
    """rayrl's built-in judge (no user code): each sample's question, response and
    ground truth fill `template`, the judge model answers, and `parser` turns its verdict
    into the score; a verdict it cannot parse is a reward error (`reward.max_error_rate`)."""

    # The judge prompt, with {question} (the prompt's last user message), {response} and
    # {ground_truth}; None: no built-in judge
    template: str | None = None
    system: str | None = None  # a system message before the template's, if any
    # number: the last number in the verdict (within score_range, if set); label: the
    # last of `labels`' words in the verdict, scored by that map
    parser: str = "number"
    labels: dict[Any, Any] = field(default_factory=dict)  # label parser: verdict word -> score
    score_range: list[Any] | None = None  # number parser: [low, high]; a number outside fails
    max_tokens: int = 32  # tokens of each verdict
    temperature: float = 0.0  # 0: greedy verdicts
    concurrency: int = 64  # judge requests in flight from each reward worker
    timeout_s: float = 120.0  # one judge request's limit (a timeout is a reward error)
