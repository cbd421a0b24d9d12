"""Engine snapshots: a step run again from a snapshot, in the same engine, in one rebuilt
(on the weights it held) or in a replacement built to wait for it (reading nothing),
ends bitwise where the first run ended."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_cases import OPTIM, pg_loss, ragged_batch, tiny_model_dir  # noqa: F401 (fixture)
from rayrl.controller.pending import Pending
from rayrl.train.engine import TrainEngine


def _weights(engine: TrainEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_step_replayed_from_a_snapshot_is_bitwise_the_same(tiny_model_dir):  # noqa: F811
    optim = {**OPTIM, "lr_scheduler": "cosine", "warmup_steps": 1}
    engine = TrainEngine(tiny_model_dir, optim=optim, total_steps=4)
    engine.train_step(ragged_batch(4, seed=1), pg_loss, micro_batch_size=2)
    snap = engine.snapshot()
    metrics = engine.train_step(ragged_batch(4, seed=2), pg_loss, micro_batch_size=2)
    after, lr = _weights(engine), engine.optimizer.param_groups[0]["lr"]

    engine.restore(snap)  # the same engine, mid-run state thrown away
    assert engine.train_steps == 1
    again = engine.train_step(ragged_batch(4, seed=2), pg_loss, micro_batch_size=2)
    assert _same(after, _weights(engine)) and again["loss"] == metrics["loss"]

    engine.rebuild()  # as on a re-formed process group: what it held, nothing read
    assert _same(after, _weights(engine)) and engine.train_steps == 2
    assert engine.load_report.source == "kept" and engine.bytes_read == 0
    assert engine.optimizer.param_groups[0]["lr"] == lr and engine.optimizer.state
    engine.restore(snap)
    again = engine.train_step(ragged_batch(4, seed=2), pg_loss, micro_batch_size=2)
    assert _same(after, _weights(engine)) and again == metrics

    # a replacement: built to wait for the restore (nothing read), then restored
    fresh = TrainEngine(tiny_model_dir, optim=optim, total_steps=4, join=True)
    assert fresh.load_report.source == "restore" and fresh.bytes_read == 0
    fresh.restore(snap)
    again = fresh.train_step(ragged_batch(4, seed=2), pg_loss, micro_batch_size=2)
    assert _same(after, _weights(fresh)) and again == metrics and fresh.bytes_read == 0
    assert fresh.optimizer.param_groups[0]["lr"] == lr and fresh.optimizer_steps == 2


def test_a_snapshot_leaves_frozen_weights_out_and_survives_pickling(tiny_model_dir):  # noqa: F811
    import pickle

    engine = TrainEngine(tiny_model_dir, optim=OPTIM)
    engine.model.model.embed_tokens.weight.requires_grad_(False)
    snap = pickle.loads(pickle.dumps(engine.snapshot()))
    assert "model.embed_tokens.weight" not in snap["params"]
    assert snap["params"] and snap["counters"]["train_steps"] == 0


def test_nbytes_counts_trainable_weights_and_adam_moments():
    from rayrl.train import snapshot

    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    model[1].requires_grad_(False)  # frozen: left out, as `capture` leaves it
    weights = (8 * 4 + 4) * 4
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    assert snapshot.nbytes(model, None) == weights
    assert snapshot.nbytes(model, optimizer) == 3 * weights  # moments not made yet
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    state = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values())
    assert snapshot.nbytes(model, optimizer) == weights + state  # the moments and step counts


def _arrays(state: dict) -> dict[str, np.ndarray]:
    out = {f"p:{k}": v[0] for k, v in state["params"].items()}
    for name, values in state["optim"].items():
        out.update({f"o:{name}:{k}": v[0] for k, v in values.items() if isinstance(v, tuple)})
    return out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_snapshot_copied_behind_the_next_step_holds_the_state_before_it(tiny_model_dir):  # noqa: F811
    """On a GPU a worker's snapshot (``wait=False``) returns before its copies are done;
    the next step runs at once, its optimizer step held behind the copies on the device:
    the settled snapshot is the state before that step, and replays it bitwise."""
    engine = TrainEngine(tiny_model_dir, optim=OPTIM, total_steps=4, device="cuda")
    engine.train_step(ragged_batch(4, seed=1), pg_loss, micro_batch_size=2)
    waited = engine.snapshot()
    with torch.cuda.stream(engine._snapshot_stream()):  # the copies start late (~0.5 s):
        torch.cuda._sleep(500_000_000)  # an optimizer step not held behind them would win
    pending = engine.snapshot(reuse=True, wait=False)
    assert isinstance(pending, Pending)
    metrics = engine.train_step(ragged_batch(4, seed=2), pg_loss, micro_batch_size=2)
    after = _weights(engine)
    state = pending.result()
    expected, got = _arrays(waited), _arrays(state)
    assert expected.keys() == got.keys() and any(k.startswith("o:") for k in got)
    assert all(np.array_equal(expected[k], got[k]) for k in expected)
    engine.restore(state)
    again = engine.train_step(ragged_batch(4, seed=2), pg_loss, micro_batch_size=2)
    assert _same(after, _weights(engine)) and again["loss"] == metrics["loss"]
