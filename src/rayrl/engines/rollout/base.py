"""The rollout engine interface and the registry that picks an engine by name.

A rollout engine turns a batch of prompts into sampled responses (see
`rayrl.engines.rollout.contract` for the exact Batch format), takes new weights from
the trainer, and can release its generation memory (KV cache) between rollouts so that
training can use it: ``sleep()`` frees, ``wake()`` reacquires.

Engines register themselves in ``ROLLOUT_ENGINES`` under the name the config uses
(``actor_rollout_ref.rollout.name``): "hf" (transformers ``generate()``) and "native"
(rayrl's own continuous-batching engine). ``make_rollout_engine("hf", model=...,
tokenizer=...)`` builds one; an unknown name fails with a "did you mean" suggestion.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from typing import Any, TypeAlias

from torch import Tensor

from rayrl.batch import Batch
from rayrl.engines.rollout.sampling import SamplingParams
from rayrl.registry import Registry, UnknownNameError

__all__ = [
    "AUTO",
    "ROLLOUT_ENGINES",
    "RolloutEngine",
    "UnknownNameError",
    "WeightSource",
    "make_rollout_engine",
    "pick_rollout_engine",
]

WeightSource: TypeAlias = Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]
"""A state dict, or an iterable of ``(name, tensor)`` pairs (e.g. ``named_parameters()``)."""


class RolloutEngine(ABC):
    """Generates responses for prompts; takes weight updates; frees memory while idle.

    Subclasses implement `generate`, `update_weights`, `sleep` and `wake`, and register
    with ``@ROLLOUT_ENGINES.register(name)``.
    """

    @abstractmethod
    def generate(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        """Sample ``sampling.n`` responses per prompt.

        Args:
            prompts: left-padded ``input_ids`` / ``attention_mask`` / ``position_ids``
                [B, P], non-tensor ``uid``, meta ``step`` (see the contract module).
            sampling: the sampling parameters for every prompt of the batch.

        Returns:
            B*n rows, each prompt's samples adjacent: ``prompts``, ``responses``,
            ``response_mask``, ``input_ids``, ``attention_mask``, ``position_ids``,
            ``rollout_log_probs``, ``finish_reason``, ``sample_uid`` and the prompt's
            other columns repeated. Sample k of prompt ``uid`` is seeded from
            ``(sampling.seed, step, f"{uid}/{k}")`` only.
        """

    @abstractmethod
    def update_weights(self, weights: WeightSource) -> int:
        """Copy ``weights`` (full, unsharded tensors by parameter name) into the model.

        Returns the number of tensors copied; tensors that already are the model's own
        storage (a hybrid engine sharing the training model) are skipped.
        """

    @abstractmethod
    def sleep(self) -> None:
        """Release generation memory (KV cache, allocator caches); weights stay."""

    @abstractmethod
    def wake(self) -> None:
        """Make the engine ready to generate again after `sleep`."""

    @property
    @abstractmethod
    def is_asleep(self) -> bool:
        """True between `sleep` and `wake`; `generate` refuses to run then."""


ROLLOUT_ENGINES: Registry[type[RolloutEngine]] = Registry(
    "rollout engine", config_key="actor_rollout_ref.rollout.name"
)


AUTO = "auto"


def pick_rollout_engine(name: str, device_type: str, model_config: Any) -> str:
    """The engine a config's ``rollout.name`` means on this device for this model.

    ``auto`` (the default) is ``native`` on a CUDA device for a model the native engine
    runs (its own check, `ModelSpec.from_hf_config`: Qwen2 / Qwen3 / Llama without
    sliding windows or dynamic rope scaling): on one H200 it generated 16x (workload A)
    and 29x (B) faster than transformers' static-cache ``generate()``
    (docs/benchmarks.md); elsewhere ``hf``. Any other name is used as it is.
    """
    if name != AUTO:
        return name
    if device_type != "cuda":
        return "hf"
    from rayrl.engines.rollout.native.spec import ModelSpec, UnsupportedModelError

    try:
        ModelSpec.from_hf_config(model_config)
    except UnsupportedModelError:
        return "hf"
    return "native"


def make_rollout_engine(name: str, **kwargs: Any) -> RolloutEngine:
    """Build the rollout engine registered under ``name`` with ``kwargs``.

    Raises:
        UnknownNameError: no engine has that name (the message suggests the closest).
    """
    return ROLLOUT_ENGINES.get(name)(**kwargs)
