"""What ``rayrl plan`` says of a mixture of experts: the per-GPU budget at each
expert-parallel size the world and the experts allow (`rayrl.models.memory.plans_by_ep`),
and what to set: the configured ``actor_rollout_ref.actor.expert_parallel_size``, or
the smallest that fits where the configured one does not, or, where none fits, what
fills the GPU (with the key that lowers each) and how many nodes would fit.
"""

from __future__ import annotations

from dataclasses import replace

from rayrl.config.layout import EP_KEY
from rayrl.models.memory import GiB, MemoryPlan, ModelShape, TrainingSetup, plans_by_ep

__all__ = ["MAX_NODES", "expert_advice", "nodes_to_fit"]

MAX_NODES = 64  # the most nodes `nodes_to_fit` tries
ARR = "actor_rollout_ref"
# What lowers each item of a phase (`rayrl.models.memory.ROWS`); `_hint` drops a
# setting the run has already.
HINTS = {
    "actor weights": f"{ARR}.actor.fsdp_config.model_dtype=bf16, or more GPUs",
    "gradients": f"{ARR}.actor.fsdp_config.model_dtype=bf16, or more GPUs",
    "Adam moments": f"{ARR}.actor.fsdp_config.optimizer_offload=true, or more GPUs",
    "gathered layers": f"a larger {EP_KEY}",
    "activations": f"a smaller {ARR}.actor.ppo_max_token_len_per_gpu (or micro-batch)",
    "log-prob head": f"a smaller {ARR}.actor.ppo_max_token_len_per_gpu (or micro-batch)",
    "forward temporaries": f"a smaller {ARR}.actor.ppo_max_token_len_per_gpu (or micro-batch)",
    "reference weights": f"{ARR}.ref.fsdp_config.param_offload=true",
    "rollout weights": f"a larger {ARR}.rollout.tensor_model_parallel_size",
    "rollout KV cache": f"a smaller {ARR}.rollout.gpu_memory_utilization",
}


def expert_advice(shape: ModelShape, setup: TrainingSetup) -> str:
    """The table of expert-parallel sizes and the line that says what to set."""
    plans = plans_by_ep(shape, setup)
    lines = [_table(shape, setup, plans), "  " + _verdict(shape, setup, plans)]
    return "\n".join(lines)


def _table(shape: ModelShape, setup: TrainingSetup, plans: list[MemoryPlan]) -> str:
    assert shape.experts is not None
    e = shape.experts
    head = (
        f"  {EP_KEY} (divides the {setup.world} GPU(s) and the {e.experts} experts):\n"
        f"  {'EP':>4}{'experts/GPU':>13}{'gathered GiB':>14}{'peak GiB':>10}  phase      fits"
    )
    rows = []
    for plan in plans:
        ep = plan.setup.ep
        mark = "  <- configured" if ep == setup.ep else ""
        gathered = plan.phases[-1].items.get("gathered layers", 0.0)  # the update's
        rows.append(
            f"  {ep:>4}{e.experts // ep:>13}{gathered / GiB:>14.1f}"
            f"{plan.peak.total / GiB:>10.1f}  {plan.peak.name:<9}  "
            f"{'yes' if plan.fits else 'no'}{mark}"
        )
    return "\n".join([head, *rows])


def _verdict(shape: ModelShape, setup: TrainingSetup, plans: list[MemoryPlan]) -> str:
    configured = next(p for p in plans if p.setup.ep == setup.ep)
    fitting = [p for p in plans if p.fits]
    if configured.fits:
        smallest = fitting[0].setup.ep
        note = f" (the smallest that fits is {smallest})" if smallest < setup.ep else ""
        return f"FITS with {EP_KEY}={setup.ep}{note}"
    if fitting:
        best = fitting[0]
        return (
            f"set {EP_KEY}={best.setup.ep}: the smallest that fits, peak "
            f"{best.peak.total / GiB:.1f} GiB ({best.peak.name}); with {setup.ep} the peak "
            f"is {configured.peak.total / GiB:.1f} GiB"
        )
    return _why_not(shape, setup, plans[-1])


def _why_not(shape: ModelShape, setup: TrainingSetup, widest: MemoryPlan) -> str:
    """Why no expert-parallel size fits: the widest's peak items and what lowers each,
    and the nodes that would fit."""
    items = "; ".join(
        f"{name} {size / GiB:.1f} GiB ({_hint(name, widest.setup)})"
        for name, size in widest.largest()
    )
    text = (
        f"DOES NOT FIT on {setup.nnodes} node(s) x {setup.gpus_per_node} GPU(s) of "
        f"{setup.gpu_bytes / GiB:.1f} GiB at any {EP_KEY}: at {widest.setup.ep} the peak is "
        f"{widest.peak.total / GiB:.1f} GiB ({widest.peak.name}), mostly {items}"
    )
    nodes = nodes_to_fit(shape, setup)
    if nodes is None:
        return f"{text}; no count of nodes up to {MAX_NODES} fits as configured"
    n, ep = nodes
    return f"{text}; it fits on trainer.nnodes={n} with {EP_KEY}={ep}"


def _hint(name: str, setup: TrainingSetup) -> str:
    """What lowers item ``name`` of a phase, less what ``setup`` has already."""
    hint = HINTS.get(name, "fixed")
    done = (
        (
            setup.master_dtype in ("bf16", "bfloat16"),
            f"{ARR}.actor.fsdp_config.model_dtype=bf16, or ",
        ),
        (setup.optimizer_offload, f"{ARR}.actor.fsdp_config.optimizer_offload=true, or "),
    )
    for already, text in done:
        if already and hint.startswith(text):
            hint = hint[len(text) :]
    if name == "rollout weights":
        hint += f" (now {setup.rollout_tp})"
    return hint


def nodes_to_fit(shape: ModelShape, setup: TrainingSetup) -> tuple[int, int] | None:
    """The fewest nodes (beyond the configured ones, up to `MAX_NODES`) on which some
    expert-parallel size fits, and the smallest such size; None when none does."""
    for n in range(setup.nnodes + 1, MAX_NODES + 1):
        fitting = [p for p in plans_by_ep(shape, replace(setup, nnodes=n)) if p.fits]
        if fitting:
            return n, fitting[0].setup.ep
    return None
