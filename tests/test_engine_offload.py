"""Parameter offload on a GPU: plain parameters parked in page-locked host buffers kept
from call to call (a frozen reference copied there once), and the same numbers as an
engine that keeps its weights on the device."""

from __future__ import annotations

import pytest
import torch

from engine_cases import pg_loss, ragged_batch, tiny_model_dir  # noqa: F401 (fixture)
from rayrl.train.engine import TrainEngine

CUDA = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytestmark = CUDA


def test_an_offloaded_reference_matches_a_resident_one_from_pinned_buffers(tiny_model_dir):  # noqa: F811
    batch = ragged_batch(6, seed=3)
    resident = TrainEngine(tiny_model_dir, trainable=False, device="cuda")
    parked = TrainEngine(tiny_model_dir, trainable=False, device="cuda", param_offload=True)
    assert all(p.device.type == "cpu" for p in parked.model.parameters())
    torch.testing.assert_close(  # the first call onloads, then parks the weights
        parked.forward(batch)["log_probs"], resident.forward(batch)["log_probs"]
    )
    params = list(parked.model.parameters())
    # page-locked where CUDA can register the buffer (small ones sharing a page cannot)
    assert max(params, key=lambda p: p.numel()).is_pinned()
    pointers = [p.data_ptr() for p in params]
    for _ in range(2):  # later offloads reuse the same buffers, copying nothing
        torch.testing.assert_close(
            parked.forward(batch)["log_probs"], resident.forward(batch)["log_probs"]
        )
        assert [p.data_ptr() for p in parked.model.parameters()] == pointers
        assert all(p.device.type == "cpu" for p in parked.model.parameters())


def test_an_offloaded_actor_trains_like_a_resident_one(tiny_model_dir):  # noqa: F811
    batch = ragged_batch(6, seed=4)
    optim = {"lr": 1e-3}
    engines = [
        TrainEngine(tiny_model_dir, optim=optim, device="cuda", param_offload=offload)
        for offload in (False, True)
    ]
    for _ in range(2):  # an update between offloads: the parked copy must be the new one
        for engine in engines:
            engine.train_step(batch, pg_loss)
    resident, parked = (engine.forward(batch)["log_probs"] for engine in engines)
    torch.testing.assert_close(parked, resident)
    assert all(p.device.type == "cpu" for p in engines[1].model.parameters())
