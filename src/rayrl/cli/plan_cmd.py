"""`rayrl plan`: the pools a config needs, where they would go, whether they fit, and what
each GPU would hold.

Connects to `--address`, else `resources.address`, else RAY_ADDRESS, or starts a
private local Ray (on a CPU-only run with the logical CPUs `rayrl train` would give
it, and refusing, as train does, a run that needs more than a few a core:
`rayrl.trainer.resources.local_ray_cpus`), and prints pools, bundles, per-node placement, the CPU budget, the
verdict and where the reward scores (its workers per node) without reserving anything. Exit code 0 when it fits now, 1 when resources
are held or it waits for an autoscaler to add nodes, 2 when it can never fit.

On GPUs it also prints the training mesh (FSDP sharding, HSDP, Ulysses SP) and the
per-GPU memory budget of each phase of a step (`rayrl.models.memory`), from the
model directory's config.json (`rayrl.cli.plan_model`); for a mixture of experts, the
budget at each expert-parallel size and which to set (`rayrl.cli.plan_experts`). ``--no-cluster`` plans for a cluster that is not here
(``trainer.nnodes`` x ``trainer.n_gpus_per_node`` GPUs of ``--gpu-gib`` each): no Ray,
only the mesh and the budget; exit code 0 when the budget fits, 2 when it does not.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from rayrl.cli.common import add_config_args, console, load_from_args

EXIT = {"fits": 0, "busy": 1, "scale": 1, "never": 2}
H200_GIB = 139.8  # what torch reports for one H200


def plan(args: argparse.Namespace) -> int:
    import ray
    from rich.markup import escape

    cfg = load_from_args(args)
    out = console()
    if args.no_cluster:
        return _offline(cfg, args, out)
    from rayrl.cluster.guard import ResourcesUnsatisfiable, assess, render_plan
    from rayrl.cluster.inspect import connect, resolve_address, snapshot
    from rayrl.trainer.resources import (
        local_ray_cpus,
        node_cpus,
        pools_from_config,
        resolve_device,
        reward_layout,
    )

    address = resolve_address(args.address, cfg.resources.address)
    local = address is None and not ray.is_initialized()
    try:  # a local Ray as `rayrl train` would start it
        cpus = local_ray_cpus(cfg, pools_from_config(cfg, "cpu")) if local else None
    except ResourcesUnsatisfiable as never:
        out.print(f"[bold red]NEVER:[/] {escape(str(never))}", highlight=False)
        return EXIT["never"]
    with connect(address, num_cpus=cpus) as gcs:
        state = snapshot()
        gpus = sum(node.get("GPU", 0.0) for node in state.totals.values())
        device = resolve_device(cfg, gpus)
        pools = pools_from_config(cfg, device, node_cpus(state.totals, device))
        out.print(f"cluster {gcs}: {len(state.nodes)} node(s); device {device}")
        out.print(render_plan(pools, state))
        out.print(reward_layout(cfg, device), highlight=False)
        if device == "cuda":
            _print_budget(cfg, args.gpu_gib, out)
        return EXIT[assess(pools, state).status]


def _offline(cfg, args: argparse.Namespace, out) -> int:
    t = cfg.trainer
    out.print(
        f"plan without a cluster: {t.nnodes} node(s) x {t.n_gpus_per_node} GPU(s) of "
        f"{args.gpu_gib:g} GiB"
    )
    budget = _print_budget(cfg, args.gpu_gib, out)
    return 0 if budget is None or budget.fits else 2


def _print_budget(cfg, gpu_gib: float, out):
    """Print the memory budget (and, for a mixture of experts, the expert-parallel sizes
    and which to set); None (with a line saying why) without a model config."""
    from rayrl.cli.plan_experts import expert_advice
    from rayrl.cli.plan_model import model_shape
    from rayrl.models.memory import plan_memory

    shape = model_shape(cfg.actor_rollout_ref.model.path)
    if isinstance(shape, str):
        out.print(f"memory per GPU: not estimated ({shape})", markup=False, highlight=False)
        return None
    setup = training_setup(cfg, gpu_gib)
    teachers = teacher_shapes(cfg)
    if isinstance(teachers, str):
        out.print(f"memory per GPU: not estimated ({teachers})", markup=False, highlight=False)
        return None
    setup = replace(setup, teachers=teachers)
    budget = plan_memory(shape, setup)
    out.print(budget.render(), markup=False, highlight=False)
    if shape.experts is not None:
        out.print(expert_advice(shape, setup), markup=False, highlight=False)
    return budget


def teacher_shapes(cfg) -> tuple | str:
    """The shapes of distillation's teachers in the actor's processes (none on a pool of
    their own, or without distillation); a string saying why one cannot be read."""
    from rayrl.cli.plan_model import model_shape
    from rayrl.config.distill import teacher_pool_size, teachers

    dist = cfg.distillation
    if not dist.enabled or teacher_pool_size(dist):
        return ()
    shapes = []
    for teacher in teachers(dist).values():
        shape = model_shape(teacher.model_path)
        if isinstance(shape, str):
            return f"teacher {teacher.key}: {shape}"
        shapes.append(shape)
    return tuple(shapes)


def training_setup(cfg, gpu_gib: float):
    """The `rayrl.models.memory.TrainingSetup` of a config (the actor's settings)."""
    from rayrl.config.validate import ref_enabled
    from rayrl.models.memory import GiB, TrainingSetup

    arr, data = cfg.actor_rollout_ref, cfg.data
    actor, fsdp, rollout = arr.actor, arr.actor.fsdp_config, arr.rollout
    length = data.max_prompt_length + data.max_response_length
    if actor.use_dynamic_bsz:
        tokens = actor.ppo_max_token_len_per_gpu
    else:
        tokens = (actor.ppo_micro_batch_size_per_gpu or 1) * length
    mixed = fsdp.dtype in ("bfloat16", "bf16")
    return TrainingSetup(
        nnodes=cfg.trainer.nnodes,
        gpus_per_node=cfg.trainer.n_gpus_per_node,
        gpu_bytes=gpu_gib * GiB,
        master_dtype=fsdp.model_dtype,
        mixed_precision=mixed,
        param_offload=fsdp.param_offload,
        optimizer_offload=fsdp.optimizer_offload,
        fsdp_size=fsdp.fsdp_size,
        sp=actor.ulysses_sequence_parallel_size,
        wrap_one_gpu=fsdp.wrap_one_gpu,
        gradient_checkpointing=arr.model.enable_gradient_checkpointing,
        tokens_per_micro_batch=tokens,
        response_share=data.max_response_length / length,
        ref=ref_enabled(cfg),
        ref_dtype=arr.ref.fsdp_config.model_dtype or ("bf16" if mixed else "fp32"),
        ref_offload=arr.ref.fsdp_config.param_offload,
        ref_fsdp_size=arr.ref.fsdp_config.fsdp_size,
        rollout_tp=int(getattr(rollout, "tensor_model_parallel_size", 1)),
        rollout_fp8=rollout.quantization == "fp8",
        gpu_memory_utilization=rollout.gpu_memory_utilization,
        free_cache_engine=rollout.free_cache_engine,
        ep=actor.expert_parallel_size,
        # None: the reference follows the actor's size (also as `plans_by_ep` varies it)
        ref_ep=None
        if arr.ref.expert_parallel_size == actor.expert_parallel_size
        else arr.ref.expert_parallel_size,
    )


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "plan", help="show the pools a config needs, whether they fit, and each GPU's memory"
    )
    add_config_args(parser)
    parser.add_argument(
        "--address",
        default=None,
        help="Ray address; default: resources.address, then RAY_ADDRESS, then a local Ray",
    )
    parser.add_argument(
        "--no-cluster",
        action="store_true",
        help="no Ray: the mesh and memory budget of trainer.nnodes x trainer.n_gpus_per_node GPUs",
    )
    parser.add_argument(
        "--gpu-gib",
        type=float,
        default=H200_GIB,
        help=f"memory of one GPU for the budget (default {H200_GIB}: an H200)",
    )
    parser.set_defaults(func=plan)
