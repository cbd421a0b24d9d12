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
  rank (the bias is added on rank 0 only, before the sum);
- a mixture of experts (`ModelSpec.moe`): every expert's MLP split as a dense MLP's,
  over its own width (rank r holds rows ``[r * I/size, (r+1) * I/size)`` of each
  expert's gate and up, the same columns of its down projection), the shared expert's
  over its width; the router and the shared expert's gate whole on every rank. In
  transformers' 3-D tensors the split is along dim 1 (``[experts, rows, hidden]``) or
  dim 2 (``[experts, hidden, columns]``), in checkpoints' per-expert ones along 0 or 1.

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
# A tensor-parallel plan's kinds (`Family.tp_kind`) that split one width evenly: kind ->
# (the dim it splits, the width: `TPShard._width`). "kv_rows" and "vocab" are their own.
_SPLITS = {
    "q_rows": (0, "q"),
    "q_cols": (1, "q"),
    "mlp_rows": (0, "mlp"),
    "mlp_cols": (1, "mlp"),
    "expert_rows": (0, "expert"),  # one expert's [width, hidden] (checkpoints)
    "expert_cols": (1, "expert"),
    "experts_rows": (1, "expert"),  # all experts' [experts, width, hidden] (transformers)
    "experts_cols": (2, "expert"),
    "shared_rows": (0, "shared"),
    "shared_cols": (1, "shared"),
}


class Part(NamedTuple):
    """``[start, stop)`` along ``dim`` (0: rows, 1: columns; 2: an expert's columns in a
    3-D tensor) of a tensor whose whole extent along ``dim`` is ``full``."""

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
        if spec.intermediate % size and not all(map(spec.is_moe, range(spec.layers))):
            problems.append(f"it does not divide the MLP width {spec.intermediate}")
        if spec.moe is not None and any(spec.moe.layers):
            for what, width in (
                ("expert", spec.moe.intermediate),
                ("shared expert", spec.moe.shared),
            ):
                if width % size:
                    problems.append(f"it does not divide the {what} width {width}")
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
        moe = self.spec.moe
        if moe is not None:
            moe = dataclasses.replace(
                moe, intermediate=moe.intermediate // self.size, shared=moe.shared // self.size
            )
        return dataclasses.replace(
            self.spec,
            heads=self.heads,
            kv_heads=self.kv_heads,
            intermediate=self.intermediate,
            vocab=hi - lo,
            moe=moe,
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
        dim, what = _SPLITS[kind]
        full = self._width(what)
        width = full // self.size
        return Part(dim, self.rank * width, (self.rank + 1) * width, full)

    def _width(self, what: str) -> int:
        """The whole width a kind of `_SPLITS` splits."""
        s = self.spec
        if what == "q":
            return s.q_size
        if what == "mlp":
            return s.intermediate
        if s.moe is None:
            raise ValueError(f"{s.model_type} has no mixture of experts to split ({what!r})")
        return s.moe.intermediate if what == "expert" else s.moe.shared

    def take(self, name: str, tensor: Tensor) -> Tensor:
        """This rank's part of the whole tensor ``name`` (a view)."""
        part = self.part(name)
        if part is None or self.size == 1:
            return tensor
        return tensor.narrow(part.dim, part.start, part.stop - part.start)
