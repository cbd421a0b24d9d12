"""Ulysses sequence parallelism on two real gloo processes, fast enough for `make test`
(the four-rank layouts are `test_engine_parallel`, marked slow): a training step and a
forward under SP=2 give one unsharded process's loss, gradients, log-probs, entropy
and sums of squared probabilities, so a wrong all-to-all (heads or tokens sent to the
wrong rank, a missing exchange) fails here; and each rank's FLOPs are its share of
the work it computes: half the rows' tokens, every row's prompt run (micro-batches do
not share prompts under Ulysses), so perf/mfu neither doubles nor drops the repeated
prompts."""

from __future__ import annotations

import math
import multiprocessing

import pytest
import torch
import torch.multiprocessing as mp

from engine_cases import OPTIM, tiny_model_dir  # noqa: F401 (fixture)
from rayrl.train.engine import TrainEngine
from rayrl.train.shared_prompts import repeated_prompt_tokens
from ulysses_cases import shared_batch, sp2_worker, train_and_forward

WORLD = 2


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir, tmp_path_factory):  # noqa: F811
    """Two ranks from a fork server that imported torch and the engine once (a fresh
    process: nothing of this one's state is inherited), not two spawned interpreters
    importing them side by side: about 7 s instead of 11 on a loaded 2-core machine."""
    out = tmp_path_factory.mktemp("ulysses")
    multiprocessing.set_forkserver_preload(["rayrl.train.engine", "ulysses_cases"])
    args = (WORLD, str(out / "init"), str(tiny_model_dir), str(out))
    mp.start_processes(sp2_worker, args=args, nprocs=WORLD, start_method="forkserver")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def one_process(tiny_model_dir, one_torch_thread):  # noqa: F811
    engine = TrainEngine(tiny_model_dir, optim=OPTIM, share_prompts=False)
    return engine, train_and_forward(engine)


def test_sequence_parallel_ranks_match_one_process(two_ranks, one_process):
    _, want = one_process
    for rank, got in enumerate(two_ranks):
        assert got["sp"] == (rank, 2, 1)
        for key in ("loss", "grad_norm", "pg_loss"):
            assert math.isclose(got["metrics"][key], want["metrics"][key], rel_tol=1e-5), key
        assert set(got["grads"]) == set(want["grads"])
        for name, grad in want["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, atol=2e-6, rtol=1e-4, msg=name)
        for key in ("log_probs", "entropy", "sum_pi_squared"):
            torch.testing.assert_close(got["forward"][key], want["forward"][key], atol=2e-5, rtol=0)


def test_each_sequence_parallel_rank_counts_the_flops_it_computes(two_ranks, one_process):
    engine, want = one_process
    batch = shared_batch()
    assert repeated_prompt_tokens(batch, 10) == 2 * 9 + 1 * 4  # prompts shared, in the batch
    whole = engine.flop_model.batch_train_flops(batch["attention_mask"], batch["response_mask"], 10)
    assert want["metrics"]["flops"] == pytest.approx(whole)
    for got in two_ranks:
        assert got["metrics"]["flops"] == pytest.approx(whole / 2)
