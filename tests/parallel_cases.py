"""The body of the 4-rank gloo run of `test_engine_parallel` (imported by name in each
spawned process): the same training step and forward under every layout of ranks.

Each layout trains one step on its data-parallel share of `BATCH` (rows ``dp_rank::
dp_size``: the ranks of a sequence-parallel group take the same rows) under a token
budget that gives ragged micro-batches, dummies on some ranks and, under SP=4, a rank
whose share of a packed row holds no response token. The full gradients (before the
optimizer step), the step's metrics and a forward's outputs are saved for the parent to
compare with one unsharded process.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine_cases import OPTIM, pg_loss, ragged_batch, value_loss

LENGTHS = [(12, 1), (1, 10), (5, 5), (9, 10), (2, 2), (3, 1), (12, 10), (6, 3)]
BUDGET = 24
LAYOUTS = {
    "flat": {},
    "hsdp": {"fsdp_size": 2},
    "sp2": {"ulysses_sequence_parallel_size": 2, "gradient_checkpointing": True},
    "sp2_hsdp": {"ulysses_sequence_parallel_size": 2, "fsdp_size": 2},
    "sp4": {"ulysses_sequence_parallel_size": 4},  # 2 KV heads: each repeated to 4 ranks
}


def batch():
    return ragged_batch(len(LENGTHS), seed=1, lengths=LENGTHS)


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def record_gradients(engine) -> dict[str, torch.Tensor]:
    """Full gradients of the last optimizer step, taken just before it (every rank
    gathers them together: the step runs on all ranks at once)."""
    grads: dict[str, torch.Tensor] = {}
    step = engine.residency.step

    def recording() -> None:
        for name, p in engine.model.named_parameters():
            if p.grad is not None:
                grads[name] = full(p.grad)
        step()

    engine.residency.step = recording
    return grads


def run_layout(engine, loss_fn, with_entropy: bool) -> dict:
    rows = list(range(engine.dp_rank, len(LENGTHS), engine.dp_size))
    grads = record_gradients(engine)
    metrics = engine.train_step(batch().index(rows), loss_fn, max_tokens_per_micro_batch=BUDGET)
    forward = engine.forward(
        batch().index(rows), max_tokens_per_micro_batch=BUDGET, with_entropy=with_entropy
    )
    return {
        "rows": rows,
        "metrics": metrics,
        "forward": forward.tensors,
        "grads": grads,
        "mesh": tuple(engine.mesh.fsdp.shape),
        "dp": (engine.dp_rank, engine.dp_size, engine.sp_rank, engine.sp_size),
        "load": engine.load_report,
    }


def parallel_worker(rank: int, world: int, init_file: str, model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist

    from rayrl.engines.train import TrainEngine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    out: dict = {}
    try:
        for name, kwargs in LAYOUTS.items():
            engine = TrainEngine(model_dir, optim=OPTIM, **kwargs)
            if name == "flat":
                out["refs"] = reference_copies(engine, model_dir)
            out[name] = run_layout(engine, pg_loss, with_entropy=True)
            if name == "hsdp":
                out["hsdp_weights"] = engine.full_state_dict(cpu_offload=True)
                out["hsdp_streamed"] = [
                    (k, v.clone()) for k, v in engine.rollout_weights(torch.bfloat16, 1 << 12)
                ]
                engine.save(Path(out_dir) / "hsdp_ckpt")
            if name == "sp2":
                out["mixed_rows_error"] = mixed_rows_error(engine)
        critic = TrainEngine(
            model_dir, value_head=True, optim=OPTIM, ulysses_sequence_parallel_size=2
        )
        out["critic_sp2"] = run_layout(critic, value_loss, with_entropy=False)
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def reference_copies(actor, model_dir: str) -> dict:
    """Frozen engines filled from ``actor``'s load: alike (shard to shard) and laid out
    otherwise (HSDP, bf16: gathered per tensor); their weights and load reports."""
    from rayrl.engines.train import TrainEngine

    out = {}
    for name, kwargs in (("alike", {}), ("other", {"fsdp_size": 2, "dtype": "bfloat16"})):
        ref = TrainEngine(model_dir, trainable=False, weights_from=actor, **kwargs)
        out[name] = {"weights": ref.full_state_dict(cpu_offload=True), "load": ref.load_report}
    return out


def mixed_rows_error(engine) -> str:
    """What a forward says when the two ranks of an SP group get different rows."""
    import torch.distributed as dist

    try:
        engine.forward(batch().index([dist.get_rank()]), micro_batch_size=1)
    except ValueError as err:
        return str(err)
    return ""
