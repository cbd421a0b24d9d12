"""rayrl's native rollout engine (registered as ``native``): see `engine`.

Files, one concept each: `spec` (the model family), `weights` (fused HF tensors),
`ops` / `attention` (torch paths), `triton_ops` / `triton_attention` /
`triton_sampler` (CUDA kernels), `model` (the forward), `kv_cache`, `scheduler`
(continuous batching), `runner` (device steps), `graphs` (CUDA graphs), `sampler`,
`stops`, `engine`.
"""

from rayrl.engines.rollout.native.engine import NativeRolloutEngine

__all__ = ["NativeRolloutEngine"]
