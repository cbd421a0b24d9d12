"""What the training engine keeps and gives out: where its weights live (offload,
onload, residency), its checkpoints, its Hugging Face export, and its full weights for
a rollout engine or an export.

`EngineIO` is `rayrl.train.engine.TrainEngine`'s base for these: the engine builds the
model, optimizer, schedule and residency policy (``self.model``, ``self.optimizer``,
``self.scheduler``, ``self.residency``) and trains; this moves its state in and out,
on step recovery's bookkeeping (`rayrl.train.recovery`: the counters a checkpoint
holds, a snapshot's copies waited for, a new rank's weights read when first needed).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from rayrl.train.checkpoint_io import (
    export_hf,
    full_model_state_dict,
    load_sharded,
    save_sharded,
)
from rayrl.train.loading import DTYPES, has_tokenizer
from rayrl.train.lora import adapters_disabled, lora_scaling, merged_state_dict
from rayrl.train.recovery import StepRecovery
from rayrl.train.residency import Residency
from rayrl.train.weight_sync import DEFAULT_BUCKET_BYTES, rollout_weights

if TYPE_CHECKING:
    from transformers import GenerationConfig, PretrainedConfig

__all__ = ["EngineIO"]


class EngineIO(StepRecovery):
    """Residency, checkpoints, export and weights of `rayrl.train.engine.TrainEngine`
    (module docstring)."""

    model: Any
    optimizer: Any
    scheduler: Any
    residency: Residency
    trainable: bool
    lora: bool
    mixed_precision: bool
    config: PretrainedConfig
    architecture: str
    tokenizer_path: str
    model_path: str
    generation_config: GenerationConfig | None

    def offload(self, params: bool = True, optimizer: bool = True) -> None:
        """Move parameters (and gradients) and/or optimizer state to host memory;
        `onload` brings back whatever it moved."""
        self.residency.offload(params=params, optimizer=optimizer and self.trainable)

    def onload(self) -> None:
        self.residency.onload()

    def resident(self) -> AbstractContextManager[None]:
        """Context with the parameters on the device; engine calls inside move nothing."""
        self.residency.require(optimizer=False)
        self._weights_needed()
        return self.residency.resident()

    def _require_trainable(self) -> None:
        if not self.trainable:
            raise RuntimeError(
                "this engine was built with trainable=False (a frozen reference "
                "model): it cannot train or checkpoint; build it trainable."
            )

    def _extra_state(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(), **self._counters()}

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write a sharded checkpoint (model, optimizer, LR schedule, counters) to
        the directory ``path``; every rank must call it."""
        self._require_trainable()
        self.residency.require(optimizer=True)
        self._weights_needed()
        with self.residency.resident(), self.residency.stepping():
            save_sharded(path, self.model, self.optimizer, self._extra_state())

    def load(self, path: str | os.PathLike[str]) -> None:
        """Restore a checkpoint written by `save` (with any number of ranks)."""
        self._require_trainable()
        self.residency.require(optimizer=True)
        self._snapshot_copies_done()
        with self.residency.resident(), self.residency.stepping():
            extra = load_sharded(path, self.model, self.optimizer, self._extra_state())
        self.scheduler.load_state_dict(extra["scheduler"])
        self._set_counters(extra)
        self._pending = None  # the checkpoint held every weight

    def export_hf(self, path: str | os.PathLike[str], dtype: str | None = None) -> None:
        """Write a directory that ``transformers`` loads (weights gathered to rank 0,
        plus config, generation config, tokenizer and a vision-language model's
        processor files); every rank must call it."""
        with self.resident():
            export_hf(
                self.model,
                path,
                state=self.full_state_dict(cpu_offload=True) if self.lora else None,
                config=self.config,
                architecture=self.architecture,
                tokenizer_dir=self.tokenizer_path if has_tokenizer(self.tokenizer_path) else None,
                generation_config=self.generation_config,
                dtype=DTYPES[dtype] if dtype else None,
                processor_dir=self.model_path,
            )

    def rollout_weights(
        self, dtype: torch.dtype, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> Iterator[tuple[str, Tensor]]:
        """Full weights by HF name in ``dtype``, for a rollout engine's ``update_weights``:
        gathered a bucket at a time (`rayrl.train.weight_sync`), LoRA merged in.

        Consume it inside `resident()` when the engine offloads parameters; every rank
        of a sharded engine must consume all of it.
        """
        self.residency.require(optimizer=False)
        self._weights_needed()
        if self.lora:
            return ((k, v.to(dtype)) for k, v in self.full_state_dict().items())
        return rollout_weights(self.model, dtype, bucket_bytes)

    @property
    def training_dtype(self) -> str:
        """The dtype the model computes in: bfloat16 under mixed precision, else its weights'."""
        if self.mixed_precision:
            return "bfloat16"
        return next(n for n, d in DTYPES.items() if d == next(self.model.parameters()).dtype)

    def full_state_dict(self, cpu_offload: bool = False) -> dict[str, Tensor]:
        """Unsharded weights by name (fp32 master weights); a collective when sharded.
        With ``cpu_offload`` only rank 0 receives them, on CPU."""
        with self.resident():
            state = full_model_state_dict(self.model, cpu_offload=cpu_offload)
        if self.lora and state:
            state = merged_state_dict(state, lora_scaling(self.model))
            # a gathered shard's padding (a dimension smaller than the ranks, such as a
            # one-label head's) leaves a view of a larger buffer, which safetensors refuses
            state = {k: v if _owns_storage(v) else v.clone() for k, v in state.items()}
        return state

    def adapters_disabled(self) -> AbstractContextManager[None]:
        """Context in which forward passes run the base model (LoRA only)."""
        return adapters_disabled(self.model)


def _owns_storage(tensor: Tensor) -> bool:
    """Whether `tensor` covers the whole of its storage."""
    owns: bool = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    return owns
