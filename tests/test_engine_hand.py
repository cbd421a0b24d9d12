"""The training engine's per-token outputs against a hand computation on each unpadded
sequence: log-probs at a sampling temperature of 0.7 and critic values V(s_t), the
value of the state in which response token t is chosen (read one position before it).
Packed and padded layouts are both checked against the hand result, not each other."""

from __future__ import annotations

import pytest
import torch

from engine_cases import ragged_batch, tiny_model_dir  # noqa: F401 (fixture)
from rayrl.batch import Batch
from rayrl.train.engine import TrainEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _per_sequence(batch: Batch):
    """(row, unpadded ids, index of the first response token) for every row."""
    for i in range(len(batch)):
        ids = batch["input_ids"][i][batch["attention_mask"][i].bool()]
        yield i, ids, len(ids) - int(batch["response_mask"][i].sum())


@pytest.mark.parametrize("packed", [True, False])
def test_log_probs_at_temperature_07_match_a_hand_computation(tiny_model_dir, packed, pack_on_cpu):  # noqa: F811
    engine = TrainEngine(tiny_model_dir, use_remove_padding=packed, trainable=False)
    batch = ragged_batch(5, seed=11)
    got = engine.forward(batch, micro_batch_size=2, with_entropy=True, temperature=0.7)
    hand_lp = torch.zeros_like(got["log_probs"])
    hand_ent = torch.zeros_like(got["entropy"])
    for i, ids, start in _per_sequence(batch):
        with torch.no_grad():
            logits = engine.model(ids[None]).logits[0].double() / 0.7
        logp = torch.log_softmax(logits, dim=-1)
        for t in range(len(ids) - start):
            hand_lp[i, t] = logp[start + t - 1, ids[start + t]]
            hand_ent[i, t] = -(logp[start + t - 1].exp() * logp[start + t - 1]).sum()
    torch.testing.assert_close(got["log_probs"], hand_lp, atol=2e-5, rtol=0)
    torch.testing.assert_close(got["entropy"], hand_ent, atol=2e-5, rtol=0)


@pytest.mark.parametrize("packed", [True, False])
def test_critic_values_are_read_at_the_state_before_each_token(tiny_model_dir, packed):  # noqa: F811
    engine = TrainEngine(tiny_model_dir, value_head=True, use_remove_padding=packed)
    batch = ragged_batch(5, seed=12)
    got = engine.forward(batch, micro_batch_size=2)["values"]
    hand = torch.zeros_like(got)
    for i, ids, start in _per_sequence(batch):
        with torch.no_grad():
            scores = engine.model(ids[None]).logits[0, :, 0]
        for t in range(len(ids) - start):
            hand[i, t] = scores[start + t - 1]
    torch.testing.assert_close(got, hand, atol=2e-5, rtol=0)
