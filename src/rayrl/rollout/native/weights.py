"""The native engine's weights: HF tensors packed into fused matrices, loaded by HF name.

Each decoder layer keeps q, k and v as one ``qkv`` matrix and gate and up as one
``gate_up`` matrix (one matmul each instead of three and two), and the norms its family's
layout has (`rayrl.rollout.native.spec.NORM_LAYOUTS`). `NativeWeights.targets` maps every
HF parameter name (``model.layers.3.self_attn.k_proj.weight``) to the view of the fused
tensor it lives in, as the model's family names them (`Family.layer_names`), so loading a
checkpoint and `update_weights` from the training model are the same in-place
``view.copy_(tensor)``, with any dtype or device conversion done by the copy. An HF
tensor that itself concatenates several (Phi-3's ``qkv_proj``: `Family.fused`; a mixture
of experts' ``gate_up_proj``, along its rows: `Family.layer_fused`) is split into those
first.

A mixture-of-experts layer (`ModelSpec.moe`) keeps its router, every expert's gate and
up rows as one ``experts_gate_up`` ``[experts, 2 * width, hidden]`` and down projections
as ``experts_down`` ``[experts, hidden, width]`` (transformers 5's layout), and a shared
expert (Qwen2-MoE) in the dense MLP's ``gate_up`` / ``down`` slots. Checkpoints on disk
hold one tensor per expert: those names are aliases (`Family.layer_aliases`), views of
one expert in the fused tensors, loaded as the fused names are; `filled` counts a fused
name filled once all its aliases are.

Split over tensor-parallel ranks (`rayrl.rollout.native.shards`), the tensors
have the shapes of the rank's slice (``spec`` is the slice's), and a whole HF tensor is
narrowed to the rank's part before the copy; `read_safetensors` can read the parts only.
A fused HF tensor always arrives whole (its parts are not one range of rows).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from rayrl.models.safetensors_read import CheckpointIndex, CheckpointReader
from rayrl.rollout.native.families import family_for
from rayrl.rollout.native.fp8 import Fp8Weight
from rayrl.rollout.native.shards import Part, TPShard
from rayrl.rollout.native.spec import ModelSpec

__all__ = ["LayerWeights", "NativeWeights", "read_safetensors"]

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some older checkpoints carry


@dataclass
class LayerWeights:
    attn_norm: Tensor | None  # before attention (None: the "post" layout has none)
    # the four matrices: tensors, or `Fp8Weight`s in an FP8 rollout's dense layers
    qkv: Tensor | Fp8Weight  # [q_size + 2 * kv_size, hidden]
    qkv_bias: Tensor | None
    o: Tensor | Fp8Weight  # [hidden, q_size]
    o_bias: Tensor | None
    mlp_norm: Tensor | None  # before the MLP
    gate_up: Tensor | Fp8Weight | None  # [2 * width, hidden]: the MLP, or the shared expert
    down: Tensor | Fp8Weight | None  # [hidden, width]
    q_norm: Tensor | None  # [head_dim] (Qwen3, Gemma 3) or [q_size] (OLMo 2)
    k_norm: Tensor | None
    attn_out_norm: Tensor | None = None  # on the attention's output (Gemma 2, OLMo 2)
    mlp_out_norm: Tensor | None = None  # on the MLP's output
    router: Tensor | None = None  # [experts, hidden]: a mixture-of-experts layer's
    experts_gate_up: Tensor | None = None  # [experts, 2 * expert width, hidden]
    experts_down: Tensor | None = None  # [experts, hidden, expert width]
    shared_gate: Tensor | None = None  # [1, hidden]: scales the shared expert (Qwen2-MoE)


class NativeWeights:
    """All parameters of one model, allocated once (uninitialised) on `device` in `dtype`.

    With ``shard`` (tensor parallelism), the parameters of that rank's slice:
    ``shard.local_spec()`` sizes them. With ``quantization="fp8"`` the dense layers'
    four matrices are `Fp8Weight`s, which a load writes into as into a tensor
    (`rayrl.rollout.native.fp8`).
    """

    def __init__(
        self,
        spec: ModelSpec,
        dtype: torch.dtype,
        device: torch.device,
        shard: TPShard | None = None,
        quantization: str | None = None,
    ) -> None:
        self.shard = shard if shard is not None and shard.size > 1 else None
        spec = self.shard.local_spec() if self.shard else spec
        self.spec, self.dtype, self.device = spec, dtype, torch.device(device)

        def empty(*shape: int) -> Tensor:
            return torch.empty(*shape, dtype=dtype, device=self.device)

        s = spec
        self.family = family_for(spec)
        self.embed = empty(s.vocab, s.hidden)
        self.final_norm = empty(s.hidden)
        self.lm_head = self.embed if s.tie_embeddings else empty(s.vocab, s.hidden)
        self.quantization = quantization
        self.layers = [self._layer(empty, i) for i in range(s.layers)]
        self._targets = self._build_targets()
        self._fused = self._build_fused()
        self._aliases = self._build_aliases()

    def _layer(self, empty: Callable[..., Tensor], i: int) -> LayerWeights:
        s, width = self.spec, self.spec.mlp_width(i)
        qkv_rows = s.q_size + 2 * s.kv_size
        norms = {slot: empty(s.hidden) for slot in s.norm_slots}
        q_norm, k_norm = (s.head_dim, s.head_dim) if s.qk_norm_per_head else (s.q_size, s.kv_size)
        matrix = self._matrix_maker(empty, i)
        return LayerWeights(
            attn_norm=norms.pop("attn_norm", None),
            qkv=matrix(qkv_rows, s.hidden),
            qkv_bias=empty(qkv_rows) if s.qkv_bias else None,
            o=matrix(s.hidden, s.q_size),
            o_bias=empty(s.hidden) if s.o_bias else None,
            mlp_norm=norms.pop("mlp_norm", None),
            gate_up=matrix(2 * width, s.hidden) if width else None,
            down=matrix(s.hidden, width) if width else None,
            q_norm=empty(q_norm) if s.qk_norm else None,
            k_norm=empty(k_norm) if s.qk_norm else None,
            **norms,
            **self._experts(empty, i),
        )

    def _matrix_maker(
        self, empty: Callable[..., Tensor], i: int
    ) -> Callable[[int, int], Tensor | Fp8Weight]:
        """How layer ``i``'s four matrices are held: in FP8 (`rayrl.rollout.native.fp8`)
        for a dense layer of an FP8 rollout, else in the model dtype (a mixture of
        experts' layer keeps its shared expert there too)."""
        if self.quantization == "fp8" and self.spec.layer_moe(i) is None:
            return lambda rows, cols: Fp8Weight.empty(rows, cols, self.dtype, self.device)
        return empty

    def _experts(self, empty: Callable[..., Tensor], i: int) -> dict[str, Tensor]:
        """Layer ``i``'s router and experts (none unless it is a mixture of experts)."""
        s, moe = self.spec, self.spec.layer_moe(i)
        if moe is None:
            return {}
        out = {
            "router": empty(moe.experts, s.hidden),
            "experts_gate_up": empty(moe.experts, 2 * moe.intermediate, s.hidden),
            "experts_down": empty(moe.experts, s.hidden, moe.intermediate),
        }
        if moe.shared_gate:
            out["shared_gate"] = empty(1, s.hidden)
        return out

    def _build_targets(self) -> dict[str, Tensor]:
        out = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.final_norm}
        out["lm_head.weight"] = self.lm_head
        for i, layer in enumerate(self.layers):
            for name, (slot, index) in self.family.layer_names(self.spec, i).items():
                tensor = getattr(layer, slot)
                out[f"model.layers.{i}.{name}"] = tensor if index is None else tensor[index]
        return out

    def _build_fused(self) -> dict[str, tuple[int, tuple[str, ...]]]:
        """HF names of fused tensors -> (the dim they concatenate along, the target names
        they concatenate, in order)."""
        return {
            f"model.layers.{i}.{name}": (dim, tuple(f"model.layers.{i}.{p}" for p in parts))
            for i in range(len(self.layers))
            for name, (dim, parts) in self.family.layer_fused(self.spec, i).items()
        }

    def _build_aliases(self) -> dict[str, str]:
        """Checkpoint names (per-expert tensors) -> the HF name whose tensor they fill."""
        return {
            f"model.layers.{i}.{alias}": f"model.layers.{i}.{name}"
            for i in range(len(self.layers))
            for alias, name in self.family.layer_aliases(self.spec, i).items()
        }

    @property
    def names(self) -> list[str]:
        """Every HF parameter name the model has (``lm_head.weight`` included when tied),
        as transformers names them in memory (not the aliases)."""
        inside = {part for _, parts in self._fused.values() for part in parts}
        inside.update(self._aliases)
        return [n for n in self._targets if n not in inside] + list(self._fused)

    def filled(self, loaded: Iterable[str]) -> set[str]:
        """The `names` that the tensors named ``loaded`` fill: themselves, and each name
        all of whose aliases were loaded."""
        loaded = set(loaded)
        groups: dict[str, set[str]] = {}
        for alias, name in self._aliases.items():
            groups.setdefault(name, set()).add(alias)
        whole = {name for name, aliases in groups.items() if aliases <= loaded}
        return (loaded - set(self._aliases)) | whole

    def tensors(self) -> Iterator[Tensor]:
        """The distinct storage tensors (for memory accounting; an `Fp8Weight`'s are
        counted by `nbytes`)."""
        seen: set[int] = set()
        for layer in self.layers:
            for t in vars(layer).values():
                if isinstance(t, Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    yield t
        for t in (self.embed, self.final_norm, self.lm_head):
            if id(t) not in seen:
                seen.add(id(t))
                yield t

    def nbytes(self) -> int:
        fp8 = [w for layer in self.layers for w in vars(layer).values() if isinstance(w, Fp8Weight)]
        held = sum(t.numel() * t.element_size() for t in self.tensors())
        return held + sum(w.nbytes() for w in fp8)

    def full_shape(self, name: str) -> tuple[int, ...]:
        """The shape of the whole HF tensor ``name`` (this rank's part, widened)."""
        if name in self._fused:
            dim, parts = self._fused[name]
            shape = list(self.full_shape(parts[0]))
            shape[dim] = sum(self.full_shape(part)[dim] for part in parts)
            return tuple(shape)
        shape = list(self._targets[name].shape)
        part = self.shard.part(name) if self.shard else None
        if part is not None:
            shape[part.dim] = part.full
        return tuple(shape)

    @torch.no_grad()
    def load(
        self,
        items: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]],
        where: str,
        sharded: bool = False,
    ) -> int:
        """Copy HF-named tensors into place; return how many were copied.

        Args:
            sharded: the tensors are this rank's parts already (`TPShard.part`), not
                whole tensors to narrow.

        Raises:
            KeyError: a name the model does not have (with the closest names it has).
            ValueError: a tensor whose shape differs from the model's.
        """
        pairs = items.items() if isinstance(items, Mapping) else items
        copied = 0
        for name, tensor in pairs:
            if name in self._fused:  # whole even when sharded: split, then narrowed
                self._check_shape(name, tensor, where, sharded=False)
                dim, parts = self._fused[name]
                pieces = tensor.split([self.full_shape(part)[dim] for part in parts], dim)
                for part, piece in zip(parts, pieces, strict=True):
                    self._copy(part, piece, where, sharded=False)
            elif name in self._targets:
                self._copy(name, tensor, where, sharded)
            elif name.endswith(_IGNORED_SUFFIXES):
                continue
            else:
                close = difflib.get_close_matches(name, self.names, n=3)
                raise KeyError(
                    f"{where}: the model has no tensor {name!r}; closest names: {close}. "
                    "Pass unwrapped (HF) parameter names."
                )
            copied += 1
        return copied

    def _copy(self, name: str, tensor: Tensor, where: str, sharded: bool) -> None:
        self._check_shape(name, tensor, where, sharded)
        if self.shard is not None and not sharded:
            tensor = self.shard.take(name, tensor)
        self._targets[name].copy_(tensor.detach())

    def _check_shape(self, name: str, tensor: Tensor, where: str, sharded: bool) -> None:
        expected = tuple(self._targets[name].shape) if sharded else self.full_shape(name)
        if tuple(tensor.shape) != expected:
            what = "this rank's part of it" if sharded else "the whole tensor"
            raise ValueError(
                f"{where}: {name!r} has shape {tuple(tensor.shape)} but {what} is "
                f"{expected}; pass full (unsharded) tensors, or with sharded=True this "
                "rank's tensor-parallel parts."
            )


def read_safetensors(
    model_dir: str | Path, part: Callable[[str], Part | None] | None = None
) -> Iterator[tuple[str, Tensor]]:
    """Every tensor of an HF model directory's safetensors files, one at a time (CPU).

    With ``part`` (`TPShard.part`), only each tensor's part is read from the file.
    """
    try:
        index = CheckpointIndex.of(model_dir)
    except FileNotFoundError as err:
        raise FileNotFoundError(
            f"native rollout engine: {err}; or use the hf rollout engine."
        ) from None
    with CheckpointReader(index) as reader:
        for name in index:
            where = part(name) if part is not None else None
            if where is None:
                yield name, reader.read(name)
            else:
                yield name, reader.read_part(name, where.dim, where.start, where.stop)
