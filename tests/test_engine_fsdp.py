"""FSDP2 on two real processes (gloo) against one process without sharding.

One spawn runs everything sharded (processes are slow to start on a loaded machine):
two training steps (plain micro-batches over two mini-batches, then a token budget
where the ranks hold different loads and rank 1 runs dummy micro-batches), a forward,
a sharded save and an HF export. The parent repeats the steps in one process and
compares, then loads the two-rank checkpoint into a one-process engine (resharding).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from engine_cases import (
    OPTIM,
    STEP_A_ROWS,
    STEP_B_BUDGET,
    fsdp_worker,
    one_rank_fsdp_worker,
    pg_loss,
    step_a_batch,
    step_b_batch,
    tiny_model_dir,  # noqa: F401 (fixture)
)
from rayrl.train.engine import TrainEngine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_rank_run(tiny_model_dir, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("fsdp")
    init = out / "init"
    mp.spawn(fsdp_worker, args=(2, str(init), str(tiny_model_dir), str(out)), nprocs=2)
    return out, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def one_rank(tiny_model_dir):  # noqa: F811
    engine = TrainEngine(tiny_model_dir, optim=OPTIM)
    a = engine.train_step(step_a_batch(), pg_loss, mini_batch_size=4, micro_batch_size=3)
    b = engine.train_step(step_b_batch(), pg_loss, max_tokens_per_micro_batch=STEP_B_BUDGET)
    return engine, a, b


def _close(x: float, y: float, rel: float = 1e-5) -> bool:
    return math.isclose(x, y, rel_tol=rel, abs_tol=1e-7)


def test_two_ranks_match_one_rank(two_rank_run, one_rank, tiny_model_dir):  # noqa: F811
    _, results = two_rank_run
    engine, a, b = one_rank
    for r in results:
        assert _close(r["a"]["loss"], a["loss"]) and _close(r["a"]["grad_norm"], a["grad_norm"])
        assert _close(r["b"]["loss"], b["loss"]) and _close(r["b"]["grad_norm"], b["grad_norm"])
        # loss_fn metrics are the mini-batch's values whatever the micro-batch and rank split
        assert _close(r["a"]["pg_loss"], a["pg_loss"]) and _close(r["b"]["pg_loss"], b["pg_loss"])
    assert _close(a["pg_loss"], a["loss"]) and _close(b["pg_loss"], b["loss"])
    assert results[1]["b"]["micro_batches"] == results[0]["b"]["micro_batches"] == 4
    weights = results[0]["weights"]
    state = engine.model.state_dict()
    assert set(weights) == set(state)
    initial = load_file(tiny_model_dir / "model.safetensors")["model.embed_tokens.weight"]
    assert (state["model.embed_tokens.weight"] - initial).abs().max() > 1e-3  # steps moved it
    for name, value in state.items():
        torch.testing.assert_close(weights[name], value, atol=2e-5, rtol=0, msg=name)


def test_gradients_reduce_scattered_once_per_mini_batch(two_rank_run):
    _, results = two_rank_run
    for r in results:  # step A: 2 mini-batches of 2 micro-batches each
        assert r["scatters_a"] == 2 * r["fsdp_units"], (r["scatters_a"], r["fsdp_units"])


def test_rollout_weights_stream_full_bf16_tensors(two_rank_run):
    _, results = two_rank_run
    weights = results[0]["weights"]
    for r in results:  # every rank receives every full tensor, cast before the gather
        streamed = dict(r["streamed"])
        assert len(streamed) == len(r["streamed"])  # each name once (tied weights too)
        assert "model.embed_tokens.weight" in streamed and "lm_head.weight" not in streamed
        for name, value in streamed.items():
            assert value.dtype == torch.bfloat16
            assert torch.equal(value, weights[name].to(torch.bfloat16)), name


def test_sharded_forward_matches(two_rank_run, one_rank):
    _, results = two_rank_run
    engine, _, _ = one_rank
    for rank, r in enumerate(results):
        local = step_a_batch().index(STEP_A_ROWS[rank])
        ref = engine.forward(local, micro_batch_size=2, with_entropy=True)
        torch.testing.assert_close(r["forward"]["log_probs"], ref["log_probs"], atol=2e-4, rtol=0)
        torch.testing.assert_close(r["forward"]["entropy"], ref["entropy"], atol=2e-4, rtol=0)


def test_two_rank_checkpoint_loads_on_one_rank(two_rank_run, tiny_model_dir):  # noqa: F811
    from transformers import AutoModelForCausalLM

    out, results = two_rank_run
    engine = TrainEngine(tiny_model_dir, optim=OPTIM)
    engine.load(out / "ckpt")
    assert (engine.train_steps, engine.optimizer_steps, engine.skipped_steps) == (2, 3, 0)
    for name, value in engine.model.state_dict().items():
        assert torch.equal(value, results[0]["weights"][name]), name
    exported = AutoModelForCausalLM.from_pretrained(out / "hf")
    ids = step_a_batch()["input_ids"][:3]
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, engine.model(ids).logits)


@pytest.fixture(scope="module")
def one_rank_fsdp(tiny_model_dir, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("fsdp1")
    mp.spawn(one_rank_fsdp_worker, args=(str(tiny_model_dir), str(out)), nprocs=1)
    return torch.load(out / "one_rank_fsdp.pt", weights_only=False)


def test_fsdp_over_one_rank_matches_the_plain_engine(one_rank_fsdp, one_rank):
    """How one GPU trains (FSDP2 on a one-rank mesh, `TrainEngine.fsdp`), here in fp32 on
    CPU: the same steps, weights, streamed weights, forward, snapshot and checkpoint as
    the unwrapped engine."""
    r = one_rank_fsdp
    engine, a, b = one_rank
    assert r["dtensor"]
    for mine, ref in ((r["a"], a), (r["b"], b), (r["b_after_restore"], b), (r["b_after_load"], b)):
        assert _close(mine["loss"], ref["loss"]) and _close(mine["grad_norm"], ref["grad_norm"])
    state = engine.model.state_dict()
    assert set(r["weights"]) == set(state)
    for name, value in state.items():
        torch.testing.assert_close(r["weights"][name], value, atol=2e-5, rtol=0, msg=name)
    streamed = dict(r["streamed"])
    assert "model.embed_tokens.weight" in streamed and "lm_head.weight" not in streamed
    for name, value in streamed.items():
        assert value.dtype == torch.bfloat16
        assert torch.equal(value, r["weights"][name].to(torch.bfloat16)), name
    ref = engine.forward(step_a_batch(), micro_batch_size=2, with_entropy=True)
    torch.testing.assert_close(r["forward"]["log_probs"], ref["log_probs"], atol=2e-4, rtol=0)
    torch.testing.assert_close(r["forward"]["entropy"], ref["entropy"], atol=2e-4, rtol=0)


def test_wrap_one_gpu_key_reaches_the_engine():
    """`fsdp_config.wrap_one_gpu` (default off: autocast) is what the actor's and the
    critic's engines get as ``fsdp``."""
    from rayrl.config.load import load_config
    from rayrl.workers.common import engine_kwargs

    for overrides, wanted in (
        ([], False),
        (["actor_rollout_ref.actor.fsdp_config.wrap_one_gpu=true"], True),
    ):
        cfg = load_config(None, overrides, validate=False)
        arr = cfg.actor_rollout_ref
        assert engine_kwargs(arr.model, arr.actor.fsdp_config, 0)["fsdp"] is wanted
    cfg = load_config(None, ["critic.model.fsdp_config.wrap_one_gpu=true"], validate=False)
    assert engine_kwargs(cfg.critic.model, cfg.critic.model.fsdp_config, 0)["fsdp"] is True
