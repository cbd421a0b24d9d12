"""Expert parallelism (`rayrl.train.expert_parallel`) on real gloo processes: the
all-to-all's autograd, one MoE block against transformers' own, and the engine's
training step at 2 ranks (ep=2) and 4 ranks (ep=2 x dp=2, ep=4) against one process:
the same loss, gradients, log-probs and weights after the optimizer step."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from engine_cases import OPTIM, pg_loss
from parallel_cases import BUDGET, batch, record_gradients
from rayrl.config.layout import MeshError, MeshSpec
from rayrl.train.engine import TrainEngine


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from rayrl.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("ep") / "m", family="qwen3_moe", seed=4)


def _spawn(fn, world, tmp_path, *args):
    mp.spawn(fn, args=(world, str(tmp_path / "init"), *map(str, args), str(tmp_path)), nprocs=world)


def test_all_to_all_backward_returns_each_gradient_where_its_row_came_from(tmp_path):
    from ep_cases import all_to_all_worker

    _spawn(all_to_all_worker, 2, tmp_path)
    for rank in range(2):
        # the same check catches a backward that sends the gradients back misordered
        assert torch.load(tmp_path / f"a2a{rank}.pt")["broken"] == "AssertionError"


def test_block_matches_transformers_experts(tmp_path, moe_dir):
    from ep_cases import block_worker

    _spawn(block_worker, 2, tmp_path, moe_dir)
    for rank in range(2):
        r = torch.load(tmp_path / f"block{rank}.pt", weights_only=False)
        for key in ("out", "input_grad", "router_grad"):
            torch.testing.assert_close(*r[key], atol=1e-6, rtol=1e-5, msg=key)
        for name, (got, want) in r["experts_grad"].items():
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=name)
        # a combine that skipped the routing weights would not pass the first check
        assert not torch.allclose(*r["unweighted"], atol=1e-3)


@pytest.fixture(scope="module")
def one_process(moe_dir):
    engine = TrainEngine(moe_dir, optim=OPTIM)
    grads = record_gradients(engine)
    metrics = engine.train_step(batch(), pg_loss, max_tokens_per_micro_batch=BUDGET)
    forward = engine.forward(batch(), micro_batch_size=3)
    return metrics, grads, forward, engine.full_state_dict()


def _same_as_one_process(result, reference):
    metrics, grads, forward, weights = reference
    for key in ("loss", "pg_loss", "grad_norm"):
        assert result["metrics"][key] == pytest.approx(metrics[key], rel=1e-5), key
    assert set(result["grads"]) == set(grads)
    for name, grad in grads.items():
        torch.testing.assert_close(result["grads"][name], grad, atol=1e-6, rtol=1e-5, msg=name)
    for key, value in result["forward"].items():
        torch.testing.assert_close(value, forward[key][result["rows"]], atol=1e-5, rtol=0)
    for name, value in weights.items():
        torch.testing.assert_close(result["weights"][name], value, atol=1e-5, rtol=0, msg=name)


@pytest.mark.slow  # two spawns of 2 and 4 ranks: ~100 s on two cores
@pytest.mark.parametrize("world", [2, 4])
def test_engine_step_matches_one_process(tmp_path, moe_dir, one_process, world):
    from ep_cases import LAYOUTS, engine_worker

    _spawn(engine_worker, world, tmp_path, moe_dir)
    for rank in range(world):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for name, ep in LAYOUTS[world].items():
            r = results[name]
            # the ep ranks split the 4 experts, the edp ranks holding the same ones shard
            # them: each rank stores 1/world of the experts' weights
            assert r["ep"] == ep and r["local_experts"][0] == 4 // world
            _same_as_one_process(r, one_process)


def test_layout_errors_name_the_key():
    with pytest.raises(MeshError, match="expert_parallel_size=3 must be at least 1 and divide"):
        MeshSpec(4, ep=3)
    with pytest.raises(MeshError, match="Ulysses"):
        MeshSpec(4, sp=2, ep=2)
    from rayrl.config.layout import check_experts

    with pytest.raises(MeshError, match="not a mixture of experts"):
        check_experts(None, 2)
    with pytest.raises(MeshError, match="must divide the model's 6 experts"):
        check_experts(6, 4)
