"""Whether a config's reward model is an LLM judge, and where the judge runs (the
judge's own keys: `rayrl.config.judge`)."""

from __future__ import annotations

from rayrl.config.schema import RayRLConfig

__all__ = ["judge_enabled", "judge_on_own_pool"]


def judge_enabled(config: RayRLConfig) -> bool:
    """Whether the reward model is an LLM judge: `reward_model.enable` with a reward
    function of one's own (verl's generative reward model) or `reward.judge.template`
    (the built-in judge); otherwise it is a discriminative reward model."""
    fn = config.custom_reward_function
    return config.reward_model.enable and bool(fn.path or config.reward.judge.template)


def judge_on_own_pool(config: RayRLConfig) -> bool:
    """Whether the judge runs on a pool of its own (`reward_model.enable_resource_pool`),
    its replicas reached by the reward workers over HTTP."""
    return judge_enabled(config) and config.reward_model.enable_resource_pool
