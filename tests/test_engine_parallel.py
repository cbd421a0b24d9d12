"""Ulysses sequence parallelism and hybrid sharding on four real gloo processes, against
one unsharded process: the same loss, metrics, gradients and log-probs whatever the
layout (`parallel_cases`), and the reference policy filled from the actor's load."""

from __future__ import annotations

import math

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from engine_cases import OPTIM, pg_loss, tiny_model_dir, value_loss  # noqa: F401 (fixture)
from parallel_cases import BUDGET, LENGTHS, batch, record_gradients
from rayrl.train.engine import TrainEngine
from rayrl.train.packing import plan_token_budget

pytestmark = pytest.mark.slow

WORLD = 4


@pytest.fixture(scope="module")
def four_ranks(tiny_model_dir, tmp_path_factory):  # noqa: F811
    from parallel_cases import parallel_worker

    out = tmp_path_factory.mktemp("parallel")
    args = (WORLD, str(out / "init"), str(tiny_model_dir), str(out))
    mp.spawn(parallel_worker, args=args, nprocs=WORLD)
    return out, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _one_process(model_dir, value_head: bool = False):
    engine = TrainEngine(model_dir, optim=OPTIM, value_head=value_head)
    grads = record_gradients(engine)
    loss_fn = value_loss if value_head else pg_loss
    metrics = engine.train_step(batch(), loss_fn, max_tokens_per_micro_batch=BUDGET)
    forward = engine.forward(batch(), micro_batch_size=2, with_entropy=not value_head)
    return engine, metrics, grads, forward


@pytest.fixture(scope="module")
def one_process(tiny_model_dir):  # noqa: F811
    return _one_process(tiny_model_dir)


def _close(x: float, y: float) -> bool:
    return math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-7)


def _same_as_one_process(result: dict, reference: tuple, keys: tuple[str, ...]) -> None:
    _, metrics, grads, forward = reference
    for key in ("loss", "grad_norm", *keys):
        assert _close(result["metrics"][key], metrics[key]), (key, result["metrics"][key])
    assert set(result["grads"]) == set(grads)
    for name, grad in grads.items():
        torch.testing.assert_close(result["grads"][name], grad, atol=2e-6, rtol=1e-4, msg=name)
    for key, value in result["forward"].items():
        torch.testing.assert_close(value, forward[key][result["rows"]], atol=2e-5, rtol=0)


@pytest.mark.parametrize("layout", ["sp2", "sp2_hsdp", "sp4"])
def test_sequence_parallel_matches_one_process(four_ranks, one_process, layout):
    """SP=2 (with activation checkpointing; and under HSDP) and SP=4 (KV heads repeated,
    a rank whose share of a packed row has no response token): the loss, its metric,
    the gradient and the log-probs and entropy of every rank equal one process's."""
    _, results = four_ranks
    for rank, ranks in enumerate(results):
        r = ranks[layout]
        sp = 4 if layout == "sp4" else 2
        assert r["dp"] == (rank // sp, WORLD // sp, rank % sp, sp)
        _same_as_one_process(r, one_process, ("pg_loss",))
        # the per-GPU token budget holds sp times as many tokens a micro-batch (verl's
        # rule): the group splits them
        assert r["metrics"]["micro_batches"] == _micro_batches(WORLD // sp, BUDGET * sp)


def _micro_batches(dp_size: int, budget: int) -> int:
    """Micro-batches a train step makes: the most any data-parallel part's rows need."""
    lengths = [p + r for p, r in LENGTHS]
    parts = [[lengths[i] for i in range(part, len(lengths), dp_size)] for part in range(dp_size)]
    return max(len(plan_token_budget(rows, budget)) for rows in parts)


def test_hybrid_sharding_matches_flat_and_one_process(four_ranks, one_process):
    """HSDP (shard over 2 ranks, 2 replicas) against flat FSDP over 4, and one process."""
    _, results = four_ranks
    for ranks in results:
        assert ranks["hsdp"]["mesh"] == (2, 2) and ranks["flat"]["mesh"] == (4,)
        _same_as_one_process(ranks["hsdp"], one_process, ("pg_loss",))
        for name, grad in ranks["flat"]["grads"].items():
            torch.testing.assert_close(ranks["hsdp"]["grads"][name], grad, atol=1e-6, rtol=1e-5)


def test_hsdp_checkpoint_and_rollout_weights(four_ranks, one_process, tiny_model_dir):  # noqa: F811
    """An HSDP checkpoint loads into one process (resharded); streamed rollout weights
    (gathered within a sharding group) are the full weights in bf16."""
    out, results = four_ranks
    engine, *_ = one_process
    weights = results[0]["hsdp_weights"]
    for name, value in engine.model.state_dict().items():
        torch.testing.assert_close(weights[name], value, atol=2e-5, rtol=0, msg=name)
    loaded = TrainEngine(tiny_model_dir, optim=OPTIM)
    loaded.load(out / "hsdp_ckpt")
    for name, value in loaded.model.state_dict().items():
        assert torch.equal(value, weights[name]), name
    for ranks in results:
        streamed = dict(ranks["hsdp_streamed"])
        assert set(streamed) == {n for n, _ in engine.model.named_parameters()}
        for name, value in streamed.items():
            assert torch.equal(value, weights[name].to(torch.bfloat16)), name


def test_one_read_serves_every_rank_and_the_reference(four_ranks, tiny_model_dir):  # noqa: F811
    """The actor read the checkpoint once for all ranks; reference engines built from its
    load read nothing and hold the initial weights (cast to their dtype)."""
    _, results = four_ranks
    initial = load_file(tiny_model_dir / "model.safetensors")
    size = (tiny_model_dir / "model.safetensors").stat().st_size
    for ranks in results:
        load = ranks["flat"]["load"]
        assert load.source == "checkpoint"
        assert 0.95 * size < load.bytes_read <= size  # once, not once per rank
        assert load.host_peak_gb_per_node > 0
    for name, ref in results[0]["refs"].items():  # full weights come to rank 0
        assert ref["load"].source == "engine" and ref["load"].bytes_read == 0
        dtype = torch.bfloat16 if name == "other" else torch.float32
        for key, value in initial.items():
            assert torch.equal(ref["weights"][key], value.to(dtype)), (name, key)


def test_critic_sequence_parallel_matches_one_process(four_ranks, tiny_model_dir):  # noqa: F811
    """Values (a token-classification head) under SP=2: forward and a step as one process
    (the new value head drawn from the seed, the same for every layout)."""
    _, results = four_ranks
    reference = _one_process(tiny_model_dir, value_head=True)
    for ranks in results:
        _same_as_one_process(ranks["critic_sp2"], reference, ())


def test_sp_ranks_given_different_rows_say_so(four_ranks):
    _, results = four_ranks
    for ranks in results:
        assert "got different rows" in ranks["mixed_rows_error"]
        assert "dp_rank and dp_size" in ranks["mixed_rows_error"]
