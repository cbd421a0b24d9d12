"""The body of the two-rank gloo run of `test_engine_ulysses` (imported by name in each
spawned process): one training step and a forward under Ulysses SP=2, with shared
prompts asked for, on rows where several share a prompt (the forward with each token's
sum of squared probabilities too). Each rank saves its metrics,
the full gradients before the optimizer step and the forward's outputs for the parent
to compare with one unsharded process."""

from __future__ import annotations

from pathlib import Path

import torch

from engine_cases import OPTIM, pg_loss, ragged_batch
from parallel_cases import record_gradients

# (prompt, response) real lengths; rows 0-2 share one prompt, rows 3-4 another
LENGTHS = [(9, 4), (9, 7), (9, 2), (4, 6), (4, 9), (11, 3), (2, 10)]
SHARED = [[0, 1, 2], [3, 4]]
BUDGET = 20  # tokens a micro-batch and GPU: ragged micro-batches, rows split mid-row


def shared_batch():
    batch = ragged_batch(len(LENGTHS), prompt_len=11, response_len=10, seed=3, lengths=LENGTHS)
    ids = batch["input_ids"]
    for rows in SHARED:
        ids[rows[1:], :11] = ids[rows[0], :11]
    return batch


def train_and_forward(engine) -> dict:
    grads = record_gradients(engine)
    metrics = engine.train_step(
        shared_batch(), pg_loss, max_tokens_per_micro_batch=BUDGET, with_entropy=True
    )
    forward = engine.forward(
        shared_batch(),
        max_tokens_per_micro_batch=BUDGET,
        with_entropy=True,
        with_sum_pi_squared=True,
    )
    return {"metrics": metrics, "grads": grads, "forward": forward.tensors}


def sp2_worker(rank: int, world: int, init_file: str, model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist

    from rayrl.train.engine import TrainEngine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        engine = TrainEngine(
            model_dir, optim=OPTIM, ulysses_sequence_parallel_size=2, share_prompts=True
        )
        out = train_and_forward(engine)
        out["sp"] = (engine.sp_rank, engine.sp_size, engine.dp_size)
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
