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
  the compute dtype (two layers and the root unit, and in the backward one layer's
  unsharded gradients with their float32 copy for the reduce-scatter), the activations of one micro-batch (with activation
  checkpointing: each layer's input, plus one layer recomputed), the log-prob head's
  chunk temporaries and its float32 weight gradient, beside the rollout's weights.

Activations per token and layer count the tensors a Qwen2/Llama decoder layer keeps
for its backward in bf16 (norms in float32): ``24 h + 4 kv + 8 i`` bytes for hidden
size ``h``, key/value width ``kv`` and MLP width ``i`` (a mixture of experts' layer:
`rayrl.models.model_shape.ModelShape.layer_activation_bytes`). Ulysses splits a
micro-batch's tokens over ``sp`` GPUs.

A mixture of experts (`ExpertShape`) with expert parallelism (``ep``,
``actor.expert_parallel_size``): a rank holds ``1/ep`` of the experts, FSDP-sharded
over the ``world/ep`` ranks holding the same ones, so its shard of weights, gradients
and moments stays ``1/world`` of the model, as without it; what ``ep`` shrinks is the
working set FSDP gathers, a layer's dense weights and ``1/ep`` of its experts. The
reference splits its experts as the actor does unless ``ref_ep`` (``ref.expert_parallel_size``)
says otherwise. Tokens travel to their
experts' ranks and back (all-to-all); with balanced routing a rank runs as many expert
copies as its own tokens chose, so the activations do not depend on ``ep`` (an
unbalanced router's hot ranks hold more: not modelled). The rollout engine holds the
whole model (every expert) on each tensor-parallel replica, its dense layers' matrices
in one byte each with ``rollout.quantization=fp8``. A fixed 1.5 GiB stands for the CUDA context and communicator
buffers. The caching allocator's fragmentation is not modelled: a measured reserved
peak can exceed these sums (docs/benchmarks.md compares them).

Host memory per node counts what offloading puts there (Adam moments, parameters,
the reference) for the node's GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from rayrl.config.layout import MeshError, MeshSpec
from rayrl.models.model_shape import ExpertShape, ModelShape

__all__ = [
    "ExpertShape",
    "GiB",
    "MemoryPlan",
    "ModelShape",
    "Phase",
    "TrainingSetup",
    "expert_parallel_sizes",
    "plan_memory",
    "plans_by_ep",
]

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
    "teacher weights",
    "rollout weights",
    "rollout KV cache",
    "context, buffers",
)
DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}


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
    rollout_fp8: bool = False  # rollout.quantization=fp8: the dense matrices in one byte
    gpu_memory_utilization: float = 0.5
    free_cache_engine: bool = True
    ep: int = 1  # actor.expert_parallel_size
    ref_ep: int | None = None  # ref.expert_parallel_size; None: the actor's
    # on-policy distillation's teachers in the actor's processes (`distillation.nnodes=0`),
    # sharded and offloaded as the reference is
    teachers: tuple[ModelShape, ...] = ()

    @property
    def world(self) -> int:
        return self.nnodes * self.gpus_per_node

    def mesh(self) -> MeshSpec:
        return MeshSpec(self.world, self.sp, self.fsdp_size, self.ep)

    @property
    def reference_ep(self) -> int:
        """The reference's expert-parallel size (the actor's unless ``ref_ep`` is set)."""
        return self.ep if self.ref_ep is None else self.ref_ep


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
    def rollout_starved(self) -> bool:
        """The rollout's share of the GPU (``gpu_memory_utilization``) holds its weights
        and no KV cache beside them: it cannot generate."""
        return self.kv_cache_tokens == 0

    @property
    def fits(self) -> bool:
        return self.peak.total <= self.setup.gpu_bytes and not self.rollout_starved

    def render(self) -> str:
        s, shape = self.setup, self.shape
        lines = [
            f"memory per GPU: {shape.describe()}; GPU {s.gpu_bytes / GiB:.1f} GiB",
            f"  actor mesh: {s.mesh().describe()}",
            *self._experts_line(),
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
        if self.rollout_starved:
            lines.append(
                f"  the rollout's share, gpu_memory_utilization {s.gpu_memory_utilization} x "
                f"{s.gpu_bytes / GiB:.1f} GiB, leaves no room for a KV cache beside its "
                "weights: raise actor_rollout_ref.rollout.gpu_memory_utilization or "
                "tensor_model_parallel_size"
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

    def _experts_line(self) -> list[str]:
        """How the actor's ranks hold a mixture's experts (nothing for a dense model)."""
        e, mesh = self.shape.experts, self.setup.mesh()
        if e is None:
            return []
        if mesh.world == 1:
            return [f"  experts: all {e.experts} per layer on the one rank"]
        if mesh.ep == 1:
            return [
                f"  experts: no expert parallelism: FSDP shards every expert over the "
                f"{mesh.shard} rank(s) and gathers all {e.experts} of a layer at a time "
                f"({self.shape.gathered_layer() / 1e9:.2f} B parameters in the largest layer)"
            ]
        return [
            f"  experts: expert parallel {mesh.ep}: each rank holds {e.experts // mesh.ep} of "
            f"{e.experts} per layer, sharded over the {mesh.edp} rank(s) holding the same "
            f"ones; FSDP gathers {self.shape.gathered_layer(mesh.ep) / 1e9:.2f} B parameters "
            f"of the largest layer at a time (the reference, at expert parallel "
            f"{self.setup.reference_ep}: "
            f"{self.shape.gathered_layer(self.setup.reference_ep) / 1e9:.2f} B)"
        ]

    def largest(self, count: int = 3) -> list[tuple[str, float]]:
        """The peak phase's ``count`` largest items (name, bytes), largest first."""
        items = sorted(self.peak.items.items(), key=lambda kv: -kv[1])
        return items[:count]


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
    in_fp8 = shape.dense_matrix_params if setup.rollout_fp8 else 0
    rollout_weights = (params * 2 - in_fp8) / setup.rollout_tp
    rollout_share = max(setup.gpu_memory_utilization * setup.gpu_bytes, rollout_weights)
    kv_bytes = rollout_share - rollout_weights
    actor_resident = 0.0 if setup.param_offload else weights
    optimizer_resident = 0.0 if setup.optimizer_offload else moments
    ref_resident = 0.0 if setup.ref_offload or not setup.ref else ref_weights
    sharded = setup.world > 1 or setup.wrap_one_gpu
    gathered = float((2 * shape.gathered_layer(setup.ep) + shape.root_params) * compute)
    ref_layer = shape.gathered_layer(setup.reference_ep)
    ref_gathered = float((2 * ref_layer + shape.root_params) * compute)
    if not setup.ref:
        ref_gathered = 0.0
    # backward: a layer's unsharded gradients, in the compute dtype and, mixed, the
    # float32 copy FSDP reduce-scatters (`rayrl.train.fsdp`'s reduce_dtype)
    reduce = compute + (4 if setup.mixed_precision else 0)
    layer_grads = float(shape.gathered_layer(setup.ep) * reduce)
    if not sharded:
        gathered = ref_gathered = layer_grads = 0.0
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
    reference.items["gathered layers"] = max(gathered, ref_gathered)
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
    update.items["gathered layers"] = gathered + layer_grads
    if setup.gradient_checkpointing:
        kept = tokens * (shape.layers * 2 * shape.hidden + shape.activation_bytes())
    else:
        kept = tokens * shape.all_activation_bytes()
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
    phases = [generate, reference, update]
    if setup.teachers:
        phases.append(_with_teachers(phases, setup, ref_shard, compute, reference, host))
    return MemoryPlan(shape, setup, phases, host, kv_tokens)


def _with_teachers(
    phases: list[Phase],
    setup: TrainingSetup,
    ref_shard: int,
    compute: int,
    reference: Phase,
    host: dict[str, float],
) -> Phase:
    """Distillation's teachers in the actor's processes: their weights in every phase
    (host memory instead with the reference's `param_offload`), and the phase in which
    they score: the reference phase's items, with the largest teacher's weights (on the
    GPU for its pass even when offloaded), gathered layers and forward temporaries."""
    dtype = DTYPE_BYTES[setup.ref_dtype]
    each = [t.params * dtype / ref_shard for t in setup.teachers]
    resident = 0.0 if setup.ref_offload else sum(each)
    for phase in phases:
        phase.items["teacher weights"] = resident
    if setup.ref_offload:
        host["teacher weights"] = sum(each) * setup.gpus_per_node
    largest = max(setup.teachers, key=lambda t: t.params)
    scoring = Phase("teacher", dict(reference.items))
    scoring.items["reference weights"] = (
        0.0 if setup.ref_offload or not setup.ref else (reference.items["reference weights"])
    )
    scoring.items["teacher weights"] = max(resident, max(each))
    sharded = setup.world > 1 or setup.wrap_one_gpu
    gathered = (2 * largest.gathered_layer() + largest.root_params) * compute if sharded else 0.0
    scoring.items["gathered layers"] = float(gathered)
    tokens = setup.tokens_per_micro_batch / setup.sp
    chunk = min(setup.logit_chunk, tokens * setup.response_share)
    scoring.items["forward temporaries"] = (
        tokens * largest.activation_bytes() + 3 * chunk * largest.vocab * 4
    )
    return scoring


def expert_parallel_sizes(shape: ModelShape, setup: TrainingSetup) -> list[int]:
    """The expert-parallel sizes the actor's mesh can take for this model: the divisors
    of the world that divide the experts, ascending (only 1 for a dense model, or with
    Ulysses SP or hybrid sharding, which expert parallelism does not run with yet)."""
    e = shape.experts
    if e is None:
        return [1]
    sizes = []
    for ep in range(1, setup.world + 1):
        if setup.world % ep or e.experts % ep:
            continue
        try:
            MeshSpec(setup.world, setup.sp, setup.fsdp_size, ep)
        except MeshError:
            continue
        sizes.append(ep)
    return sizes


def plans_by_ep(shape: ModelShape, setup: TrainingSetup) -> list[MemoryPlan]:
    """The budget at each of `expert_parallel_sizes`, ascending."""
    return [plan_memory(shape, replace(setup, ep=ep)) for ep in expert_parallel_sizes(shape, setup)]
