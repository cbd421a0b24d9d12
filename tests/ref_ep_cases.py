"""The body of `test_ref_expert_parallel`'s gloo run (imported by name in each spawned
process): the reference policy built as the workers build it (`ref_engine_kwargs`, its
weights taken from the actor's engine), under each pair of actor and reference
expert-parallel sizes, and its log-probs of this rank's rows."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from engine_cases import OPTIM
from parallel_cases import LENGTHS, batch

# (actor expert_parallel_size, reference expert_parallel_size or None: unset)
CASES = {"actor2_ref_unset": (2, None), "actor2_ref1": (2, 1), "actor1_ref2": (1, 2)}


def config(model_dir: str, actor_ep: int, ref_ep: int | None):
    """The run's config at 2 ranks, as `rayrl train` loads it."""
    from rayrl.config import load_config

    overrides = [
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=2",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        f"actor_rollout_ref.model.path={model_dir}",
        f"actor_rollout_ref.actor.expert_parallel_size={actor_ep}",
    ]
    if ref_ep is not None:
        overrides.append(f"actor_rollout_ref.ref.expert_parallel_size={ref_ep}")
    return load_config("grpo", overrides)


def _experts_split(engine) -> tuple[int, tuple[str, ...]]:
    """Over how many ranks the engine split its experts, and the mesh its expert weights
    live on (``[edp, ep]`` under expert parallelism, FSDP's flat mesh without)."""
    weight = engine.model.model.layers[0].mlp.experts.gate_up_proj
    split = getattr(engine.model, "_rayrl_expert_parallel", 1)
    return split, tuple(weight.device_mesh.mesh_dim_names or ())


def ref_worker(rank: int, world: int, init_file: str, model_dir: str, out_dir: str) -> None:
    """Per case: the actor's engine, the reference from it, the reference's log-probs."""
    from rayrl.train.engine import TrainEngine
    from rayrl.workers.common import engine_kwargs, ref_engine_kwargs

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    out: dict = {}
    try:
        for name, (actor_ep, ref_ep) in CASES.items():
            arr = config(model_dir, actor_ep, ref_ep).actor_rollout_ref
            actor = TrainEngine(
                model_dir,
                optim=OPTIM,
                expert_parallel_size=arr.actor.expert_parallel_size,
                **engine_kwargs(arr.model, arr.actor.fsdp_config, 0),
            )
            ref = TrainEngine(
                model_dir, trainable=False, weights_from=actor, **ref_engine_kwargs(arr, 0)
            )
            rows = list(range(ref.dp_rank, len(LENGTHS), ref.dp_size))
            forward = ref.forward(batch().index(rows), micro_batch_size=3)
            out[name] = {
                "rows": rows,
                "log_probs": forward["log_probs"],
                "ref_ep_key": arr.ref.expert_parallel_size,
                "ref_experts": _experts_split(ref),
                "actor_experts": _experts_split(actor),
            }
            del actor, ref
        torch.save(out, Path(out_dir) / f"ref{rank}.pt")
    finally:
        dist.destroy_process_group()
