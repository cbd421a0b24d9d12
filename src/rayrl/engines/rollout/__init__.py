"""Rollout engines: turn prompts into sampled responses with replayable, seeded sampling.

- :mod:`~rayrl.engines.rollout.base`: the `RolloutEngine` interface and the
  ``ROLLOUT_ENGINES`` registry (``make_rollout_engine("hf", ...)``).
- :mod:`~rayrl.engines.rollout.contract`: the input and output Batch format.
- :mod:`~rayrl.engines.rollout.sampling`: `SamplingParams` and the counter-based
  Gumbel-max sampler seeded from (seed, step, sample uid).
- :mod:`~rayrl.engines.rollout.hf`: `HFRolloutEngine`, on transformers ``generate()``.
- :mod:`~rayrl.engines.rollout.native`: `NativeRolloutEngine`, rayrl's own engine
  (continuous batching, paged KV cache, Triton kernels and CUDA graphs on GPU).
"""

import importlib

from rayrl.engines.rollout.base import (
    AUTO,
    AUTO_ORDER,
    ROLLOUT_ENGINES,
    RolloutChoice,
    RolloutEngine,
    UnknownNameError,
    WeightSource,
    make_rollout_engine,
    resolve_rollout,
)
from rayrl.engines.rollout.contract import FINISH_LENGTH, FINISH_STOP, positions_from_mask
from rayrl.engines.rollout.sampling import (
    SamplingParams,
    process_logits,
    sample_keys,
    sample_tokens,
)

__all__ = [
    "AUTO",
    "AUTO_ORDER",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "ROLLOUT_ENGINES",
    "HFRolloutEngine",
    "NativeRolloutEngine",
    "RolloutChoice",
    "RolloutEngine",
    "SamplingParams",
    "UnknownNameError",
    "WeightSource",
    "make_rollout_engine",
    "resolve_rollout",
    "positions_from_mask",
    "process_logits",
    "sample_keys",
    "sample_tokens",
]

# The engines are imported on first use: the hf engine imports transformers, which a
# command that only checks a config should not pay for.
_ENGINE_MODULES = {
    "HFRolloutEngine": "rayrl.engines.rollout.hf",
    "NativeRolloutEngine": "rayrl.engines.rollout.native",
}


def __getattr__(name: str):
    if name in _ENGINE_MODULES:
        return getattr(importlib.import_module(_ENGINE_MODULES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
