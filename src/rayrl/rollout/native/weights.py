"""The native engine's weights: HF tensors packed into fused matrices, loaded by HF name.

Each decoder layer keeps q, k and v as one ``qkv`` matrix and gate and up as one
``gate_up`` matrix (one matmul each instead of three and two). `NativeWeights.targets`
maps every HF parameter name (``model.layers.3.self_attn.k_proj.weight``) to the view of
the fused tensor it lives in, so loading a checkpoint and `update_weights` from the
training model are the same in-place ``view.copy_(tensor)``, with any dtype or device
conversion done by the copy.

Split over tensor-parallel ranks (`rayrl.rollout.native.shards`), the tensors
have the shapes of the rank's slice (``spec`` is the slice's), and a whole HF tensor is
narrowed to the rank's part before the copy; `read_safetensors` can read the parts only.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from rayrl import reads
from rayrl.rollout.native.shards import Part, TPShard
from rayrl.rollout.native.spec import ModelSpec

__all__ = ["LayerWeights", "NativeWeights", "read_safetensors"]

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some older checkpoints carry


@dataclass
class LayerWeights:
    input_norm: Tensor
    qkv: Tensor  # [q_size + 2 * kv_size, hidden]
    qkv_bias: Tensor | None
    o: Tensor  # [hidden, q_size]
    o_bias: Tensor | None
    post_norm: Tensor
    gate_up: Tensor  # [2 * intermediate, hidden]
    down: Tensor  # [hidden, intermediate]
    q_norm: Tensor | None  # [head_dim] (Qwen3)
    k_norm: Tensor | None


class NativeWeights:
    """All parameters of one model, allocated once (uninitialised) on `device` in `dtype`.

    With ``shard`` (tensor parallelism), the parameters of that rank's slice:
    ``shard.local_spec()`` sizes them.
    """

    def __init__(
        self,
        spec: ModelSpec,
        dtype: torch.dtype,
        device: torch.device,
        shard: TPShard | None = None,
    ) -> None:
        self.shard = shard if shard is not None and shard.size > 1 else None
        spec = self.shard.local_spec() if self.shard else spec
        self.spec, self.dtype, self.device = spec, dtype, torch.device(device)

        def empty(*shape: int) -> Tensor:
            return torch.empty(*shape, dtype=dtype, device=self.device)

        s = spec
        self.embed = empty(s.vocab, s.hidden)
        self.final_norm = empty(s.hidden)
        self.lm_head = self.embed if s.tie_embeddings else empty(s.vocab, s.hidden)
        qkv_rows = s.q_size + 2 * s.kv_size
        self.layers = [
            LayerWeights(
                input_norm=empty(s.hidden),
                qkv=empty(qkv_rows, s.hidden),
                qkv_bias=empty(qkv_rows) if s.qkv_bias else None,
                o=empty(s.hidden, s.q_size),
                o_bias=empty(s.hidden) if s.o_bias else None,
                post_norm=empty(s.hidden),
                gate_up=empty(2 * s.intermediate, s.hidden),
                down=empty(s.hidden, s.intermediate),
                q_norm=empty(s.head_dim) if s.qk_norm else None,
                k_norm=empty(s.head_dim) if s.qk_norm else None,
            )
            for _ in range(s.layers)
        ]
        self._targets = self._build_targets()

    def _build_targets(self) -> dict[str, Tensor]:
        s = self.spec
        q, kv, inter = s.q_size, s.kv_size, s.intermediate
        out = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.final_norm}
        out["lm_head.weight"] = self.lm_head
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = layer.input_norm
            out[p + "post_attention_layernorm.weight"] = layer.post_norm
            for name, rows in (
                ("q", slice(0, q)),
                ("k", slice(q, q + kv)),
                ("v", slice(q + kv, None)),
            ):
                out[f"{p}self_attn.{name}_proj.weight"] = layer.qkv[rows]
                if layer.qkv_bias is not None:
                    out[f"{p}self_attn.{name}_proj.bias"] = layer.qkv_bias[rows]
            out[p + "self_attn.o_proj.weight"] = layer.o
            if layer.o_bias is not None:
                out[p + "self_attn.o_proj.bias"] = layer.o_bias
            if layer.q_norm is not None:
                out[p + "self_attn.q_norm.weight"] = layer.q_norm
                out[p + "self_attn.k_norm.weight"] = layer.k_norm
            out[p + "mlp.gate_proj.weight"] = layer.gate_up[:inter]
            out[p + "mlp.up_proj.weight"] = layer.gate_up[inter:]
            out[p + "mlp.down_proj.weight"] = layer.down
        return out

    @property
    def names(self) -> list[str]:
        """Every HF parameter name the model has (``lm_head.weight`` included when tied)."""
        return list(self._targets)

    def tensors(self) -> Iterator[Tensor]:
        """The distinct storage tensors (for memory accounting)."""
        seen: set[int] = set()
        for layer in self.layers:
            for t in vars(layer).values():
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    yield t
        for t in (self.embed, self.final_norm, self.lm_head):
            if id(t) not in seen:
                seen.add(id(t))
                yield t

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def full_shape(self, name: str) -> tuple[int, ...]:
        """The shape of the whole HF tensor ``name`` (this rank's part, widened)."""
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
            target = self._targets.get(name)
            if target is None:
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                close = difflib.get_close_matches(name, self.names, n=3)
                raise KeyError(
                    f"{where}: the model has no tensor {name!r}; closest names: {close}. "
                    "Pass unwrapped (HF) parameter names."
                )
            expected = tuple(target.shape) if sharded else self.full_shape(name)
            if tuple(tensor.shape) != expected:
                what = "this rank's part of it" if sharded else "the whole tensor"
                raise ValueError(
                    f"{where}: {name!r} has shape {tuple(tensor.shape)} but {what} is "
                    f"{expected}; pass full (unsharded) tensors, or with sharded=True this "
                    "rank's tensor-parallel parts."
                )
            if self.shard is not None and not sharded:
                tensor = self.shard.take(name, tensor)
            target.copy_(tensor.detach())
            copied += 1
        return copied


def read_safetensors(
    model_dir: str | Path, part: Callable[[str], Part | None] | None = None
) -> Iterator[tuple[str, Tensor]]:
    """Every tensor of an HF model directory's safetensors files, one at a time (CPU).

    With ``part`` (`TPShard.part`), only each tensor's part is read from the file.
    """
    from safetensors import safe_open

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        paths = [model_dir / f for f in files]
    else:
        paths = sorted(model_dir.glob("*.safetensors"))
    if not paths:
        raise FileNotFoundError(
            f"native rollout engine: no *.safetensors weights in {model_dir}; save the model "
            "with save_pretrained(safe_serialization=True) or use the hf rollout engine."
        )
    for path in paths:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                where = part(name) if part is not None else None
                if where is None:
                    tensor = f.get_tensor(name)
                else:
                    rows = slice(where.start, where.stop)
                    index = (rows,) if where.dim == 0 else (slice(None), rows)
                    tensor = f.get_slice(name)[index]
                reads.count(tensor.numel() * tensor.element_size())
                yield name, tensor
