"""The rollout engine interface and the registry that picks an engine by name.

A rollout engine turns a batch of prompts into sampled responses (see
`rayrl.rollout.contract` for the exact Batch format), takes new weights from
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
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from torch import Tensor

from rayrl.batch import Batch
from rayrl.registry import Registry, UnknownNameError
from rayrl.rollout.sampling import SamplingParams

__all__ = [
    "AUTO",
    "AUTO_ORDER",
    "ROLLOUT_ENGINES",
    "RolloutChoice",
    "RolloutEngine",
    "UnknownNameError",
    "WeightSource",
    "make_rollout_engine",
    "resolve_rollout",
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

    def prompt_images(
        self, prompts: Batch, token_lists: list[list[int]], sampling: SamplingParams
    ) -> list[Any] | None:
        """The images of ``prompts`` (their ``multi_modal_inputs``) as this engine's
        request API takes them with each prompt of ``token_lists`` (``add(...,
        images=)``), one per prompt (None: a text prompt); None where the engine takes
        none through its requests (a text model, or images in `generate` only)."""
        return None

    @classmethod
    def unsupported_reason(cls, device_type: str, model_config: Any) -> str | None:
        """Why ``rollout.name=auto`` should not pick this engine for the model of
        ``model_config`` on ``device_type``, or None when it should."""
        return None

    @classmethod
    def config_options(cls, rollout: Any, data: Any) -> dict[str, Any]:
        """This engine's constructor options from a config's ``rollout`` and ``data``
        groups (beyond model, tokenizer, device and dtype)."""
        return {}


ROLLOUT_ENGINES: Registry[type[RolloutEngine]] = Registry(
    "rollout engine", config_key="actor_rollout_ref.rollout.name"
)
# Known by path, so that checking a config's engine name imports neither engine (the
# hf engine imports transformers); each module registers its class when imported.
ROLLOUT_ENGINES.declare("native", "rayrl.rollout.native.engine:NativeRolloutEngine")
ROLLOUT_ENGINES.declare("hf", "rayrl.rollout.hf.engine:HFRolloutEngine")


AUTO = "auto"
# `auto` takes the first of these engines that runs the model on the device.
AUTO_ORDER = ("native", "hf")


@dataclass(frozen=True)
class RolloutChoice:
    """The engine a config's ``rollout`` group resolves to, with that engine's options.

    ``name`` is concrete (never ``auto``); ``options`` are the engine constructor's
    keyword arguments beyond model, tokenizer, device and dtype, read from the config
    by the chosen engine (`RolloutEngine.config_options`); ``reason`` says why ``auto``
    chose it (empty when the config named the engine).
    """

    name: str
    options: dict[str, Any] = field(default_factory=dict)
    reason: str = ""


def resolve_rollout(rollout: Any, data: Any, device_type: str, model_config: Any) -> RolloutChoice:
    """The engine and its options for a config's ``rollout`` group (verl's keys) and
    ``data`` group, on ``device_type`` for the model of ``model_config``: resolved once,
    here, so that ``auto`` and the explicit name take the same path.

    ``auto`` (the default) is the first engine of `AUTO_ORDER` that runs the model on
    the device (`RolloutEngine.unsupported_reason`): ``native`` on CUDA for the models
    it implements, else ``hf``. Any other name is used as it is (an unknown one fails
    with a "did you mean").
    """
    reason = ""
    name = rollout.name
    if name == AUTO:
        skipped = []
        for candidate in AUTO_ORDER:
            why_not = ROLLOUT_ENGINES.get(candidate).unsupported_reason(device_type, model_config)
            if why_not is None:
                name = candidate
                break
            skipped.append(f"not {candidate}: {why_not}")
        reason = f"auto on {device_type}: {name}" + (f" ({'; '.join(skipped)})" if skipped else "")
    quantization = getattr(rollout, "quantization", None)
    if quantization and name != "native":
        why = f" ({reason})" if reason else ""
        raise ValueError(
            f"actor_rollout_ref.rollout.quantization={quantization} runs on the native engine "
            f"only, and the rollout is the {name} engine{why}; set "
            "actor_rollout_ref.rollout.name=native, or quantization=null"
        )
    engine = ROLLOUT_ENGINES.get(name)
    return RolloutChoice(name, engine.config_options(rollout, data), reason)


def make_rollout_engine(name: str, **kwargs: Any) -> RolloutEngine:
    """Build the rollout engine registered under ``name`` with ``kwargs``.

    Raises:
        UnknownNameError: no engine has that name (the message suggests the closest).
    """
    return ROLLOUT_ENGINES.get(name)(**kwargs)
