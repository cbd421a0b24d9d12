"""Regional ``torch.compile`` of a training model: each decoder layer's forward, and
the log-prob head's per-chunk math.

What the compiler buys is fusion of the elementwise work between the matmuls, which
in eager mode takes most of an update's device time at the reference shape
(docs/benchmarks.md): RMSNorm's float32 round trip, rotary embeddings,
SiLU-and-multiply, residual adds, and in the head the float32 cast, log-sum-exp and
gradient tail over ``[tokens x vocab]`` logits.

* Decoder layers: each layer's ``forward`` (not its ``__call__``) is replaced by one
  compiled function shared by every layer (modules are inlined as inputs, so one
  graph serves them all). Micro-batches differ in rows and length, so those two
  dimensions of the layer's token inputs are dynamic from the first compile; every
  other size (hidden, heads, head size, MLP width) stays a constant of the kernels.
  Compiling every size as dynamic (``dynamic=True``) made the elementwise kernels
  compute their indices from runtime sizes, and the update slower (docs/benchmarks.md,
  2026-12-03). A call with a KV cache (generation through the training model) runs the
  eager forward. Module hooks (FSDP2's unshard/reshard, activation checkpointing) stay
  outside the compiled region. The attention call is part of the graph: the flash
  varlen kernel is a registered custom op (``torch_attn::_varlen_attn``) that the
  compiler calls as it is, while rotary embeddings and the layout changes around it
  fuse with their neighbours. Excluding it (``attention_in_graph=False``, a graph
  break per layer) makes the update slower, the rotary backward most of all
  (docs/benchmarks.md, session 5).
* The head: `rayrl.train.logprob_head.ChunkMath` swapped for compiled versions of
  the same two functions; the matmuls stay cuBLAS calls, the reductions and the
  gradient tail become one or two fused kernels that read the bf16 logits once.

Only on CUDA: on a CPU the compile time would dwarf the tiny models run there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from rayrl.train.attention import (
    VARLEN,
    register_varlen_attention,
    varlen_attention_forward,
    varlen_mask,
)
from rayrl.train.fsdp import decoder_layers
from rayrl.train.logprob_head import ChunkMath, backward_chunk, forward_chunk, logprob_head_of

__all__ = ["compile_regions", "compiled_chunk_math"]


def compile_regions(
    model: nn.Module, device: torch.device, *, on_cpu: bool = False, attention_in_graph: bool = True
) -> bool:
    """Compile ``model``'s decoder layers and log-prob head in place, on CUDA only
    (``on_cpu``: on a CPU too, for tests of the compiled arithmetic;
    ``attention_in_graph=False``: the attention call stays eager, for comparisons).

    Returns whether anything was compiled. Safe to call before or after FSDP2
    wrapping (hooks are outside the compiled forwards).
    """
    if device.type != "cuda" and not on_cpu:
        return False
    if not attention_in_graph and model.config._attn_implementation == VARLEN:
        model.set_attn_implementation(_eager_varlen())
    for layer in decoder_layers(model):
        layer.forward = _dispatching_forward(type(layer).forward).__get__(layer)
    head = logprob_head_of(model)
    if head is not None:
        head.chunk_math = compiled_chunk_math()
    return True


@functools.cache
def _eager_varlen() -> str:
    """`VARLEN` registered again under another name, run outside any compiled graph."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name = f"{VARLEN}_eager"
    register_varlen_attention()
    AttentionInterface.register(name, torch.compiler.disable(varlen_attention_forward))
    AttentionMaskInterface.register(name, varlen_mask)
    return name


@functools.cache
def _dispatching_forward(forward: Callable[..., Any]) -> Callable[..., Any]:
    """A layer class's forward: compiled (one function shared by its instances) for
    whole-sequence passes, the eager original for calls with a KV cache (generation
    through the training model, e.g. the HF rollout engine in hybrid mode)."""
    compiled = torch.compile(forward, dynamic=None)

    @functools.wraps(forward)
    def dispatch(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        cache = kwargs.get("past_key_values", kwargs.get("past_key_value"))
        if cache is not None:
            return forward(self, *args, **kwargs)
        _rows_and_tokens_dynamic(args, kwargs)
        return compiled(self, *args, **kwargs)

    return dispatch


# a decoder layer's inputs whose sizes change from one micro-batch to the next, and
# those dimensions: [rows, tokens, ...] and a packed row's sequence boundaries
_DYNAMIC_DIMS = {
    "hidden_states": (0, 1),
    "position_ids": (0, 1),
    "position_embeddings": (0, 1),  # the rotary (cos, sin) pair
    "cu_seq_lens_q": (0,),
    "cu_seq_lens_k": (0,),
    "rayrl_kv_index": (0,),  # attention.SHARED_KV_INDEX: keys of segments with a shared prompt
}


def _rows_and_tokens_dynamic(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Mark the dimensions of a layer call's inputs that change between micro-batches
    dynamic, so the first compile already serves every micro-batch shape (a size that
    the graph needs as a constant stays one: ``maybe_mark_dynamic`` never fails a
    compile). What is not marked (the longest sequence's length, an integer) becomes
    dynamic on its first change, at the cost of one more compile."""
    given = dict(kwargs)
    if args:
        given["hidden_states"] = args[0]
    for name, dims in _DYNAMIC_DIMS.items():
        value = given.get(name)
        for t in value if isinstance(value, tuple) else (value,):
            if isinstance(t, torch.Tensor) and t.dim() > max(dims):
                for dim in dims:
                    torch._dynamo.maybe_mark_dynamic(t, dim)


@functools.cache
def compiled_chunk_math() -> ChunkMath:
    """The log-prob head's chunk functions, compiled (chunk shapes are fixed except
    the last chunk's, so shapes start static and go dynamic on a second size)."""
    return ChunkMath(forward=torch.compile(forward_chunk), backward=torch.compile(backward_chunk))
