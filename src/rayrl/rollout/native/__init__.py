"""rayrl's native rollout engine (registered as ``native``): see `engine`.

Files, one concept each: `families/` (one registered file per model family: config
reader, weight names, TP plan, rotary), `spec` (what the engine reads of a model),
`weights` (fused HF tensors), `ops` / `attention` (torch paths), `triton_ops` /
`triton_attention` / `triton_sampler` (CUDA kernels), `model` (the forward),
`kv_cache`, `scheduler` (continuous batching), `runner` (device steps), `graphs` (CUDA
graphs), `sampler`, `stops`, `engine`; tensor parallelism: `shards` (who holds what),
`tp` (replicas, groups, lockstep), `tp_sampler` (sampling over a split vocabulary),
`tp_weights` (the sharded weight stream from FSDP2).
"""

from rayrl.rollout.native.engine import NativeRolloutEngine

__all__ = ["NativeRolloutEngine"]
