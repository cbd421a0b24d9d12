"""Rollout: turn prompts into sampled responses (single turns or agent episodes) with
replayable, seeded sampling, served by engines that take requests.

- :mod:`~rayrl.rollout.service`: `RolloutService`, what both rollout workers hold: an
  engine, the one turn loop, the episodes and a weight receiver.
- :mod:`~rayrl.rollout.loop`: `TurnLoop`, the one turn loop: jobs of samples on any
  engine of the request contract, single turns or episodes.
- :mod:`~rayrl.rollout.requests`: the engines' request contract (add, step, abort,
  resume, weights between steps, per-token versions).
- :mod:`~rayrl.rollout.base`: the `RolloutEngine` interface and the
  ``ROLLOUT_ENGINES`` registry (``make_rollout_engine("hf", ...)``).
- :mod:`~rayrl.rollout.contract`: the input and output Batch format.
- :mod:`~rayrl.rollout.sampling`: `SamplingParams` and the counter-based Gumbel-max
  sampler seeded from (seed, step, sample uid).
- :mod:`~rayrl.rollout.hf`: `HFRolloutEngine`, on transformers models.
- :mod:`~rayrl.rollout.native`: `NativeRolloutEngine`, rayrl's own engine
  (continuous batching, paged KV cache with a prefix cache, Triton kernels and CUDA
  graphs on GPU, tensor parallelism).
- :mod:`~rayrl.rollout.agent`: multi-turn episodes with tools and environments.
"""

import importlib

from rayrl.rollout.base import (
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
from rayrl.rollout.contract import FINISH_LENGTH, FINISH_STOP, positions_from_mask
from rayrl.rollout.sampling import (
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
    "HFRolloutEngine": "rayrl.rollout.hf.engine",
    "NativeRolloutEngine": "rayrl.rollout.native",
}


def __getattr__(name: str):
    if name in _ENGINE_MODULES:
        return getattr(importlib.import_module(_ENGINE_MODULES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
