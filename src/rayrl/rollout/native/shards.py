"""Which part of every weight, KV head and vocabulary row one tensor-parallel rank holds.

A model split over ``size`` ranks (Megatron-style, as vLLM and SGLang split it):

- attention: rank r holds query heads ``[r * H/size, (r+1) * H/size)`` (column-parallel
  q rows) and the KV heads those queries read: ``KV/size`` of them when ``size``
  divides the KV heads, else (``size`` a multiple of the KV heads) one KV head, the
  same one on ``size / KV`` neighbouring ranks (GQA replication); the output
  projection is row-parallel (its input columns of those heads), summed over ranks;
- MLP: gate and up rows ``[r * I/size, (r+1) * I/size)`` (column-parallel), down
  projection columns of the same range (row-parallel), summed over ranks;
- embedding and LM head: vocabulary rows ``[r * w, min(V, (r+1) * w))`` with
  ``w = ceil(V / size)`` (vocab-parallel: a masked lookup summed over ranks; a slice
  of the logits per rank);
- norms, Qwen3's per-head q/k norms and the output-projection bias: whole on every
  rank (the bias is added on rank 0 only, before the sum).

Which HF tensor is which is the model family's tensor-parallel plan (`Family.tp_kind`; a
family may also refuse sizes: `Family.tp_problems`). `TPShard.part` says this for any
HF parameter name; `TPShard.local_spec` is the
`ModelSpec` of the rank's own slice (its heads, KV heads, MLP width and vocabulary
rows), with which the rest of the engine (weights, forward, KV cache) runs unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

from torch import Tensor

from rayrl.rollout.native.families import family_for
from rayrl.rollout.native.spec import ModelSpec

__all__ = ["Part", "TPShard", "check_tp_size"]

KEY = "actor_rollout_ref.rollout.tensor_model_parallel_size"


class Part(NamedTuple):
    """Rows (``dim`` 0) or columns (``dim`` 1) ``[start, stop)`` of a tensor whose whole
    extent along ``dim`` is ``full``."""

    dim: int
    start: int
    stop: int
    full: int


def check_tp_size(spec: ModelSpec, size: int) -> None:
    """Raise ValueError when the model cannot be split over ``size`` ranks."""
    problems = []
    if size < 1:
        problems.append("it must be at least 1")
    else:
        if spec.heads % size:
            problems.append(f"it does not divide the {spec.heads} attention heads")
        if spec.kv_heads % size and size % spec.kv_heads:
            problems.append(
                f"it neither divides the {spec.kv_heads} KV heads nor is a multiple of them"
            )
        if spec.intermediate % size:
            problems.append(f"it does not divide the MLP width {spec.intermediate}")
        if (size - 1) * -(-spec.vocab // size) >= spec.vocab:
            problems.append(f"the {spec.vocab}-token vocabulary leaves a rank no rows")
        problems += family_for(spec).tp_problems(spec, size)
    if problems:
        raise ValueError(
            f"native rollout engine: {KEY}={size} cannot split this {spec.model_type} model: "
            f"{'; '.join(problems)}. Use a size that divides the attention heads "
            f"({spec.heads}) and the MLP width, and divides or is a multiple of the KV heads "
            f"({spec.kv_heads})."
        )


@dataclass(frozen=True)
class TPShard:
    """Rank ``rank`` of a tensor-parallel group of ``size`` over the model ``spec``."""

    spec: ModelSpec
    size: int
    rank: int

    def __post_init__(self) -> None:
        check_tp_size(self.spec, self.size)
        if not 0 <= self.rank < self.size:
            raise ValueError(f"TPShard: rank={self.rank} is not in [0, {self.size}).")

    @property
    def heads(self) -> int:
        """Query heads on this rank."""
        return self.spec.heads // self.size

    @property
    def kv_heads(self) -> int:
        """KV heads on this rank (1 when they are replicated)."""
        return max(1, self.spec.kv_heads // self.size)

    @property
    def kv_first(self) -> int:
        """Index of this rank's first KV head in the model."""
        if self.size <= self.spec.kv_heads:
            return self.rank * self.kv_heads
        return self.rank // (self.size // self.spec.kv_heads)

    @property
    def intermediate(self) -> int:
        return self.spec.intermediate // self.size

    @property
    def vocab_width(self) -> int:
        """Vocabulary rows per rank, ``ceil(V / size)`` (the last rank may hold fewer)."""
        return -(-self.spec.vocab // self.size)

    @property
    def vocab_rows(self) -> tuple[int, int]:
        """``[lo, hi)``: the token ids whose embedding rows and logits this rank holds."""
        lo = self.rank * self.vocab_width
        return lo, min(self.spec.vocab, lo + self.vocab_width)

    def local_spec(self) -> ModelSpec:
        """The spec of this rank's slice (the model's own spec when ``size`` is 1)."""
        if self.size == 1:
            return self.spec
        lo, hi = self.vocab_rows
        return dataclasses.replace(
            self.spec,
            heads=self.heads,
            kv_heads=self.kv_heads,
            intermediate=self.intermediate,
            vocab=hi - lo,
        )

    def part(self, name: str) -> Part | None:
        """The part of HF parameter ``name`` this rank holds (None: all of it)."""
        kind = family_for(self.spec).tp_kind(name)
        if kind is None:
            return None
        if kind == "vocab":
            return Part(0, *self.vocab_rows, self.spec.vocab)
        if kind == "kv_rows":
            first, dim = self.kv_first * self.spec.head_dim, self.spec.head_dim
            return Part(0, first, first + self.kv_heads * dim, self.spec.kv_size)
        width, full = (
            (self.heads * self.spec.head_dim, self.spec.q_size)
            if kind.startswith("q_")
            else (self.intermediate, self.spec.intermediate)
        )
        dim = 1 if kind.endswith("_cols") else 0
        return Part(dim, self.rank * width, (self.rank + 1) * width, full)

    def take(self, name: str, tensor: Tensor) -> Tensor:
        """This rank's part of the whole tensor ``name`` (a view)."""
        part = self.part(name)
        if part is None or self.size == 1:
            return tensor
        return tensor.narrow(part.dim, part.start, part.stop - part.start)
