"""What one GPU holds in each phase of a GRPO step with the hybrid actor: an estimate
from the model's shape and the run's settings, for ``rayrl plan``.

The actor, the reference and the rollout engine share every GPU (one process each
bundle). Per GPU, by phase:

* **generate**: the actor's resident state (weights, and Adam moments unless offloaded),
  the reference's weights unless offloaded, and the rollout engine's share of the GPU
  (``gpu_memory_utilization``: its weights, split over ``tensor_model_parallel_size``
  GPUs, and its KV cache);
* **reference**: the same with the rollout's KV cache released
  (``free_cache_engine``), the reference's weights on the GPU, and one layer's gathered
  weights and forward temporaries;
* **update**: the actor's weights, gradients (both in the master dtype, sharded),
  Adam moments (or the 4 GiB slice an offloaded step brings), FSDP's gathered layers in
  the compute dtype, the activations of one micro-batch (with activation
  checkpointing: each layer's input, plus one layer recomputed), the log-prob head's
  chunk temporaries and its float32 weight gradient, beside the rollout's weights.

Activations per token and layer count the tensors a Qwen2/Llama decoder layer keeps
for its backward in bf16 (norms in float32): ``24 h + 4 kv + 8 i`` bytes for hidden
size ``h``, key/value width ``kv`` and MLP width ``i``. Ulysses splits a micro-batch's
tokens over ``sp`` GPUs. A fixed 1.5 GiB stands for the CUDA context and communicator
buffers. The caching allocator's fragmentation is not modelled: a measured reserved
peak can exceed these sums (docs/benchmarks.md compares them).

Host memory per node counts what offloading puts there (Adam moments, parameters,
the reference) for the node's GPUs.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from rayrl.config.layout import MeshSpec

__all__ = ["GiB", "MemoryPlan", "ModelShape", "Phase", "TrainingSetup", "plan_memory"]

GiB = 2**30
CONTEXT_BYTES = 1.5 * GiB  # CUDA context, NCCL buffers
STEP_SLICE_BYTES = 4 * GiB  # rayrl.train.residency: offloaded moments on the GPU at once
ROWS = (
    "actor weights",
    "gradients",
    "Adam moments",
    "gathered layers",
    "activations",
    "log-prob head",
    "forward temporaries",
    "reference weights",
    "rollout weights",
    "rollout KV cache",
    "context, buffers",
)
DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's sizes (a Hugging Face ``config.json``'s fields)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool = False
    name: str = ""

    @classmethod
    def from_config(cls, config: dict[str, Any], name: str = "") -> ModelShape:
        heads = int(config["num_attention_heads"])
        return cls(
            hidden=int(config["hidden_size"]),
            layers=int(config["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            intermediate=int(config["intermediate_size"]),
            vocab=int(config["vocab_size"]),
            tied=bool(config.get("tie_word_embeddings", False)),
            name=name or (config.get("architectures") or [""])[0],
        )

    @classmethod
    def from_dir(cls, path: str) -> ModelShape | None:
        """From a local model directory's config.json; None when there is none."""
        file = os.path.join(path, "config.json")
        if not os.path.isfile(file):
            return None
        with open(file) as f:
            return cls.from_config(json.load(f))

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        h, kv = self.hidden, self.kv_width
        attention = h * (h + 2 * kv) + (h + 2 * kv) + h * h  # q, k, v (with biases), o
        return attention + 3 * h * self.intermediate + 2 * h  # MLP, two norms

    @property
    def root_params(self) -> int:
        """Embedding, output head (unless tied) and final norm: FSDP's root unit."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params

    def activation_bytes(self) -> int:
        """Bytes one token's layer keeps for its backward (bf16 compute)."""
        return 24 * self.hidden + 4 * self.kv_width + 8 * self.intermediate

    def kv_bytes_per_token(self, tp: int) -> int:
        """KV cache bytes of one token on one GPU of a ``tp``-way replica (bf16)."""
        heads = max(1, self.kv_heads // tp)
        return 2 * self.layers * heads * self.head_dim * 2


@dataclass(frozen=True)
class TrainingSetup:
    """The settings that decide the budget (config keys in brackets).

    ``tokens_per_micro_batch``: tokens of one micro-batch of an SP group
    (``ppo_max_token_len_per_gpu``, or micro-batch size x prompt + response length).
    """

    nnodes: int
    gpus_per_node: int
    gpu_bytes: float
    master_dtype: str = "fp32"  # actor.fsdp_config.model_dtype
    mixed_precision: bool = True  # actor.fsdp_config.dtype bfloat16
    param_offload: bool = False
    optimizer_offload: bool = False
    fsdp_size: int = -1
    sp: int = 1
    wrap_one_gpu: bool = False
    gradient_checkpointing: bool = True
    tokens_per_micro_batch: int = 16384
    response_share: float = 0.5  # response tokens / all tokens (the head runs on those)
    logit_chunk: int = 4096
    ref: bool = True
    ref_dtype: str = "bf16"
    ref_offload: bool = False
    ref_fsdp_size: int = -1
    rollout_tp: int = 1
    gpu_memory_utilization: float = 0.5
    free_cache_engine: bool = True

    @property
    def world(self) -> int:
        return self.nnodes * self.gpus_per_node

    def mesh(self) -> MeshSpec:
        return MeshSpec(self.world, self.sp, self.fsdp_size)


@dataclass
class Phase:
    """One phase's items (name -> bytes on one GPU)."""

    name: str
    items: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.items.values())


@dataclass
class MemoryPlan:
    """Per-phase GPU budgets, host memory per node, and the verdict."""

    shape: ModelShape
    setup: TrainingSetup
    phases: list[Phase]
    host_per_node: dict[str, float]
    kv_cache_tokens: int

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)

    @property
    def fits(self) -> bool:
        return self.peak.total <= self.setup.gpu_bytes

    def render(self) -> str:
        s, shape = self.setup, self.shape
        lines = [
            f"memory per GPU: {shape.name or 'model'} {shape.params / 1e9:.2f} B parameters "
            f"(hidden {shape.hidden}, {shape.layers} layers, {shape.heads} heads / "
            f"{shape.kv_heads} KV, vocab {shape.vocab}); GPU {s.gpu_bytes / GiB:.1f} GiB",
            f"  actor mesh: {s.mesh().describe()}",
            f"  rollout: tensor parallel {s.rollout_tp} ({s.world // s.rollout_tp} replica(s)), "
            f"gpu_memory_utilization {s.gpu_memory_utilization}: KV cache for "
            f"{self.kv_cache_tokens:,} tokens per replica",
        ]
        names = [n for n in ROWS if any(n in p.items for p in self.phases)]
        width = max(len(n) for n in names)
        lines.append("  " + " " * width + "".join(f"{p.name:>12}" for p in self.phases))
        for name in names:
            cells = "".join(f"{p.items.get(name, 0.0) / GiB:>12.1f}" for p in self.phases)
            lines.append(f"  {name:<{width}}{cells}")
        lines.append(
            "  " + "total".ljust(width) + "".join(f"{p.total / GiB:>12.1f}" for p in self.phases)
        )
        peak = self.peak
        verdict = "FITS" if self.fits else "DOES NOT FIT"
        lines.append(
            f"  {verdict}: peak {peak.total / GiB:.1f} GiB ({peak.name}) of "
            f"{s.gpu_bytes / GiB:.1f} GiB per GPU"
        )
        host = ", ".join(f"{k} {v / GiB:.0f}" for k, v in self.host_per_node.items() if v)
        total = sum(self.host_per_node.values())
        lines.append(
            f"  host memory per node (offloaded state): {total / GiB:.0f} GiB ({host or 'none'})"
        )
        return "\n".join(lines)


def plan_memory(shape: ModelShape, setup: TrainingSetup) -> MemoryPlan:
    """The per-GPU budget of each phase (see the module docstring)."""
    mesh = setup.mesh()
    master = DTYPE_BYTES[setup.master_dtype]
    compute = 2 if setup.mixed_precision else master
    params = shape.params
    shard = mesh.shard if setup.world > 1 else 1
    weights = params * master / shard
    moments = 2 * weights
    ref_shard = MeshSpec(setup.world, 1, setup.ref_fsdp_size).shard if setup.world > 1 else 1
    ref_weights = params * DTYPE_BYTES[setup.ref_dtype] / ref_shard
    rollout_weights = params * 2 / setup.rollout_tp
    rollout_share = max(setup.gpu_memory_utilization * setup.gpu_bytes, rollout_weights)
    kv_bytes = rollout_share - rollout_weights
    actor_resident = 0.0 if setup.param_offload else weights
    optimizer_resident = 0.0 if setup.optimizer_offload else moments
    ref_resident = 0.0 if setup.ref_offload or not setup.ref else ref_weights
    sharded = setup.world > 1 or setup.wrap_one_gpu
    gathered = (2 * shape.layer_params + shape.root_params) * compute if sharded else 0.0
    if not sharded and setup.mixed_precision and master > 2:
        gathered = params * 2  # autocast keeps a bf16 copy of every weight it cast

    generate = Phase("generate")
    generate.items["actor weights"] = actor_resident
    generate.items["Adam moments"] = optimizer_resident
    generate.items["reference weights"] = ref_resident
    generate.items["rollout weights"] = rollout_weights
    generate.items["rollout KV cache"] = kv_bytes
    generate.items["context, buffers"] = CONTEXT_BYTES

    tokens = setup.tokens_per_micro_batch / setup.sp
    response = tokens * setup.response_share
    chunk = min(setup.logit_chunk, response)
    reference = Phase("reference")
    reference.items["actor weights"] = actor_resident
    reference.items["Adam moments"] = optimizer_resident
    reference.items["reference weights"] = ref_weights if setup.ref else 0.0
    reference.items["rollout weights"] = rollout_weights
    reference.items["rollout KV cache"] = 0.0 if setup.free_cache_engine else kv_bytes
    reference.items["gathered layers"] = gathered
    reference.items["forward temporaries"] = (
        tokens * shape.activation_bytes() + 3 * chunk * shape.vocab * 4
    )
    reference.items["context, buffers"] = CONTEXT_BYTES

    update = Phase("update")
    update.items["actor weights"] = weights
    update.items["gradients"] = weights
    update.items["Adam moments"] = (
        min(moments, STEP_SLICE_BYTES) if setup.optimizer_offload else moments
    )
    update.items["reference weights"] = ref_resident
    update.items["rollout weights"] = rollout_weights
    update.items["rollout KV cache"] = 0.0 if setup.free_cache_engine else kv_bytes
    update.items["gathered layers"] = gathered
    if setup.gradient_checkpointing:
        kept = tokens * (shape.layers * 2 * shape.hidden + shape.activation_bytes())
    else:
        kept = tokens * shape.layers * shape.activation_bytes()
    update.items["activations"] = kept
    update.items["log-prob head"] = (
        response * shape.vocab * 2  # logits kept for the backward (bf16)
        + 3 * chunk * shape.vocab * 4  # a chunk's float32 temporaries
        + shape.vocab * shape.hidden * 4  # the head's float32 weight gradient
    )
    update.items["context, buffers"] = CONTEXT_BYTES

    per_node = setup.gpus_per_node
    host = {
        "Adam moments": moments * per_node if setup.optimizer_offload else 0.0,
        "actor weights": weights * per_node if setup.param_offload else 0.0,
        "reference weights": ref_weights * per_node if setup.ref_offload and setup.ref else 0.0,
    }
    kv_tokens = int(kv_bytes / shape.kv_bytes_per_token(setup.rollout_tp)) if kv_bytes > 0 else 0
    return MemoryPlan(shape, setup, [generate, reference, update], host, kv_tokens)
