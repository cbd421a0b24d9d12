"""Shared pieces of the training-engine tests: a tiny model, ragged batches, a loss.

Also the body of the two-rank FSDP run (`fsdp_worker`), which
`torch.multiprocessing.spawn` imports by module name in each child process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rayrl.algos.aggregation import LossAggregation
from rayrl.batch import Batch

VOCAB = 512
# eps damps Adam's reaction to gradients that are pure rounding noise (k_proj biases
# get exactly-zero gradients in exact arithmetic), so runs compare to 1e-5.
OPTIM = {"lr": 1e-3, "eps": 1e-6, "grad_clip": 1.0}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer Qwen2 (hidden 64, vocab 512, tied embeddings) with its tokenizer."""
    from rayrl.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("engine") / "tiny", layers=2, seed=0)


def ragged_batch(
    n: int,
    prompt_len: int = 12,
    response_len: int = 10,
    seed: int = 0,
    lengths: list[tuple[int, int]] | None = None,
) -> Batch:
    """verl-layout rows: left-padded prompts, right-padded responses, random lengths.

    ``lengths`` fixes (prompt, response) real lengths per row. Pad id is 0.
    """
    g = torch.Generator().manual_seed(seed)
    width = prompt_len + response_len
    ids = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.long)
    for i in range(n):
        if lengths is None:
            p = int(torch.randint(1, prompt_len + 1, (1,), generator=g))
            r = int(torch.randint(1, response_len + 1, (1,), generator=g))
        else:
            p, r = lengths[i]
        ids[i, prompt_len - p : prompt_len + r] = torch.randint(3, VOCAB, (p + r,), generator=g)
        mask[i, prompt_len - p : prompt_len + r] = 1
    return Batch.from_dict(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, prompt_len:],
            "response_mask": mask[:, prompt_len:],
            "advantages": torch.randn(n, response_len, generator=g),
        }
    )


def pg_loss(outputs: dict, micro: Batch) -> tuple[torch.Tensor, dict]:
    """Token-mean policy-gradient loss, scaled by the engine's global token count."""
    agg = LossAggregation("token-mean", global_token_count=micro.meta["global_token_count"])
    loss = agg(-micro["advantages"] * outputs["log_probs"], micro["response_mask"])
    return loss, {"pg_loss": loss.detach()}


def value_loss(outputs: dict, micro: Batch) -> tuple[torch.Tensor, dict]:
    """Squared error of the values against the advantages (a stand-in for returns)."""
    agg = LossAggregation("token-mean", global_token_count=micro.meta["global_token_count"])
    loss = agg((outputs["values"] - micro["advantages"]) ** 2, micro["response_mask"])
    return loss, {}


# ---------------------------------------------------------------- two-rank FSDP
STEP_A_ROWS = [[0, 1, 4, 5], [2, 3, 6, 7]]  # global mini-batches {0..3}, {4..7}
# Step B: rank 0 holds four long rows, rank 1 two short ones, so under a token budget
# rank 0 needs four micro-batches and rank 1 gets two real ones plus two dummies.
STEP_B_LENGTHS = [(10, 9), (9, 10), (11, 8), (8, 10), (2, 2), (3, 1)]
STEP_B_ROWS = [[0, 1, 2, 3], [4, 5]]
STEP_B_BUDGET = 24


def step_a_batch() -> Batch:
    return ragged_batch(8, seed=1)


def step_b_batch() -> Batch:
    return ragged_batch(6, seed=2, lengths=STEP_B_LENGTHS)


def fsdp_worker(rank: int, world: int, init_file: str, model_dir: str, out_dir: str) -> None:
    """Two training steps, a forward, a sharded save and an HF export on FSDP2/gloo."""
    import torch.distributed as dist

    from rayrl.train.engine import TrainEngine
    from rayrl.train.fsdp import decoder_layers

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    scatters = count_calls(dist, ("reduce_scatter_single", "reduce_scatter_tensor"))
    try:
        engine = TrainEngine(model_dir, optim=OPTIM)
        metrics_a = engine.train_step(
            step_a_batch().index(STEP_A_ROWS[rank]), pg_loss, mini_batch_size=2, micro_batch_size=1
        )
        scatters_a = scatters[0]
        metrics_b = engine.train_step(
            step_b_batch().index(STEP_B_ROWS[rank]),
            pg_loss,
            max_tokens_per_micro_batch=STEP_B_BUDGET,
        )
        local = step_a_batch().index(STEP_A_ROWS[rank])
        forward = engine.forward(local, max_tokens_per_micro_batch=STEP_B_BUDGET, with_entropy=True)
        weights = engine.full_state_dict(cpu_offload=True)
        streamed = [(k, v.clone()) for k, v in engine.rollout_weights(torch.bfloat16, 1 << 12)]
        engine.save(Path(out_dir) / "ckpt")
        engine.export_hf(Path(out_dir) / "hf")
        result = {
            "a": metrics_a,
            "b": metrics_b,
            "forward": forward.tensors,
            "streamed": streamed,
            "scatters_a": scatters_a,
            "fsdp_units": len(decoder_layers(engine.model)) + 1,
        }
        if rank == 0:
            result["weights"] = weights
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def count_calls(module, names: tuple[str, ...]) -> list[int]:
    """Count calls of the functions ``module.<name>`` that exist (the real functions
    still run; FSDP2 calls one or the other by torch version); returns [count]."""
    count = [0]

    def counting(real):
        def counted(*args, **kwargs):
            count[0] += 1
            return real(*args, **kwargs)

        return counted

    for name in names:
        if hasattr(module, name):
            setattr(module, name, counting(getattr(module, name)))
    return count


def one_rank_fsdp_worker(rank: int, model_dir: str, out_dir: str) -> None:
    """The one-process steps of `test_engine_fsdp` with the model in FSDP2 over a
    one-rank mesh (the engine forms the process group itself), then what reads its
    state: full weights, streamed weights, a snapshot put back, a checkpoint loaded."""
    import torch.distributed as dist

    from rayrl.train.engine import TrainEngine

    engine = TrainEngine(model_dir, optim=OPTIM, fsdp=True)
    try:
        assert dist.is_initialized() and dist.get_world_size() == 1 and not engine.sharded
        a = engine.train_step(step_a_batch(), pg_loss, mini_batch_size=4, micro_batch_size=3)
        snap = engine.snapshot()
        engine.save(Path(out_dir) / "ckpt")
        b = engine.train_step(step_b_batch(), pg_loss, max_tokens_per_micro_batch=STEP_B_BUDGET)
        result = {
            "a": a,
            "b": b,
            "weights": engine.full_state_dict(cpu_offload=True),
            "streamed": [
                (k, v.clone()) for k, v in engine.rollout_weights(torch.bfloat16, 1 << 12)
            ],
            "forward": engine.forward(
                step_a_batch(), micro_batch_size=2, with_entropy=True
            ).tensors,
            "dtensor": hasattr(next(engine.model.parameters()), "full_tensor"),
        }
        engine.offload()
        engine.onload()
        engine.restore(snap)  # back to after step A: step B again gives the same
        result["b_after_restore"] = engine.train_step(
            step_b_batch(), pg_loss, max_tokens_per_micro_batch=STEP_B_BUDGET
        )
        engine.load(Path(out_dir) / "ckpt")
        result["b_after_load"] = engine.train_step(
            step_b_batch(), pg_loss, max_tokens_per_micro_batch=STEP_B_BUDGET
        )
        torch.save(result, Path(out_dir) / "one_rank_fsdp.pt")
    finally:
        dist.destroy_process_group()
