"""The body of the two-rank gloo run of `test_engine_rebuild` (imported by name in each
spawned process): a replacement played out on real process groups.

Generation 0: both ranks build a policy (trainable), a reference from it and a critic,
train one step, snapshot, train a second step. Generation 1 (a new process group, as a
worker group forms after a loss): rank 0 survives and rebuilds its engines, rank 1
stands for the new worker and builds them afresh with ``join=True``. Each rank records
what it read from storage, what it holds, and the second step replayed from the
snapshot. Generation 2: both ranks rebuild with another sharding of the policy (a
layout that changed): every rank reloads from the model directory.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine_cases import OPTIM, pg_loss, step_a_batch, value_loss

ROWS = [[0, 1, 4, 5], [2, 3, 6, 7]]


def _local(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().to_local().clone() for n, p in engine.model.named_parameters()}


def _moments(engine) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in engine.model.named_parameters()}
    return {
        f"{names[id(p)]}:{k}": v.to_local().clone()
        for p, s in engine.optimizer.state.items()
        for k, v in s.items()
        if hasattr(v, "to_local")
    }


def _join(init_dir: str, generation: int, rank: int, world: int) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(
        "gloo", init_method=f"file://{init_dir}/gen{generation}", rank=rank, world_size=world
    )


def _step(engine, rank: int) -> dict:
    return engine.train_step(
        step_a_batch().index(ROWS[rank]), pg_loss, mini_batch_size=2, micro_batch_size=1
    )


def rebuild_worker(rank: int, world: int, init_dir: str, model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist

    from rayrl import reads
    from rayrl.train.engine import TrainEngine

    torch.set_num_threads(1)
    out: dict = {}
    try:
        _join(init_dir, 0, rank, world)
        actor = TrainEngine(model_dir, optim=OPTIM)
        ref = TrainEngine(model_dir, trainable=False, weights_from=actor)
        critic = TrainEngine(model_dir, value_head=True, optim=OPTIM)
        out["first_read"] = actor.bytes_read
        initial = {"actor": _local(actor), "ref": _local(ref), "critic": _local(critic)}
        local = step_a_batch().index(ROWS[rank])
        _step(actor, rank)
        critic.train_step(local, value_loss, micro_batch_size=2)
        snap = actor.snapshot()
        critic_snap = critic.snapshot()
        out["step_b"] = _step(actor, rank)
        out["after_b"] = actor.full_state_dict(cpu_offload=True)
        out["ref_forward"] = ref.forward(local, micro_batch_size=2)["log_probs"]
        held = {"local": _local(actor), "moments": _moments(actor), "steps": actor.train_steps}

        _join(init_dir, 1, rank, world)
        before = reads.total()
        if rank == 0:  # the survivor
            actor.rebuild()
            ref.rebuild()
            critic.rebuild()
            out["kept"] = {
                "local": _local(actor),
                "moments": _moments(actor),
                "steps": actor.train_steps,
            }
            out["held"] = held
        else:  # the new worker: its engines as a replacement builds them
            actor = ref = critic = None
            actor = TrainEngine(model_dir, optim=OPTIM, join=True)
            ref = TrainEngine(model_dir, trainable=False, weights_from=actor, join=True)
            critic = TrainEngine(model_dir, value_head=True, optim=OPTIM, join=True)
        out["sources"] = [e.load_report.source for e in (actor, ref, critic)]
        out["build_reads"] = reads.total() - before
        out["ref_read"] = ref.bytes_read
        out["ref_initial"] = all(torch.equal(v, initial["ref"][n]) for n, v in _local(ref).items())
        if rank == 1:  # weights needed before any restore: this rank's shards, read alone
            with critic.resident():
                out["critic_lazy"] = all(
                    torch.equal(v, initial["critic"][n]) for n, v in _local(critic).items()
                )
            out["critic_lazy_read"] = critic.bytes_read
        before = reads.total()
        actor.restore(snap)
        critic.restore(critic_snap)
        out["restore_reads"] = reads.total() - before
        out["actor_read"] = actor.bytes_read
        out["step_b_again"] = _step(actor, rank)
        out["after_b_again"] = actor.full_state_dict(cpu_offload=True)
        out["ref_forward_again"] = ref.forward(local, micro_batch_size=2)["log_probs"]

        _join(init_dir, 2, rank, world)
        actor._args["fsdp_size"] = 1  # each rank a whole replica: no shard fits any more
        before = reads.total()
        actor.rebuild()
        out["relayout_reads"] = reads.total() - before
        out["relayout_source"] = actor.load_report.source
        out["relayout_weights"] = actor.full_state_dict(cpu_offload=True)
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
