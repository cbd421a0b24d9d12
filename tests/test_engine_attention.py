"""Varlen attention for packed rows: same results as padded eager attention, no dense
mask, and generation on a model loaded with it unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_cases import ragged_batch, tiny_model_dir  # noqa: F401 (fixture)
from rayrl.batch import Batch
from rayrl.train.attention import VARLEN, attention_for
from rayrl.train.engine import TrainEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _engine(model_dir, attn: str, packed: bool) -> TrainEngine:
    return TrainEngine(model_dir, attn_implementation=attn, use_remove_padding=packed)


def test_packed_varlen_matches_padded_eager(tiny_model_dir):  # noqa: F811
    # Rows of very different lengths, one with a single real prompt token.
    lengths = [(12, 10), (1, 1), (3, 9), (12, 1), (7, 4)]
    batch = ragged_batch(5, lengths=lengths, seed=3)
    reference = _engine(tiny_model_dir, "eager", packed=False)
    assert reference.model.config._attn_implementation == "eager"
    expected = reference.forward(batch, micro_batch_size=5, with_entropy=True)
    packed = _engine(tiny_model_dir, "sdpa", packed=True)
    assert packed.model.config._attn_implementation == VARLEN
    got = packed.forward(batch, micro_batch_size=5, with_entropy=True)
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(got[key], expected[key], atol=2e-5, rtol=1e-5)


def test_packed_row_builds_no_dense_mask(tiny_model_dir):  # noqa: F811
    from transformers.masking_utils import create_causal_mask

    engine = _engine(tiny_model_dir, "sdpa", packed=True)
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    embeds = torch.zeros(1, positions.shape[1], engine.config.hidden_size)
    mask = create_causal_mask(engine.model.config, embeds, None, None, position_ids=positions)
    assert mask is None  # sdpa would build a [1, 1, 9, 9] block-diagonal mask here


def test_packed_positions_without_boundaries_still_attend_per_sequence(tiny_model_dir):  # noqa: F811
    """A caller that packs rows itself (restarting position_ids, no cu_seq_lens)."""
    engine = _engine(tiny_model_dir, "sdpa", packed=True)
    ids = torch.randint(3, 500, (1, 9), generator=torch.Generator().manual_seed(0))
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    with torch.no_grad():
        packed = engine.model(input_ids=ids, position_ids=positions).logits[0]
        parts = [engine.model(input_ids=ids[:, a:b]).logits[0] for a, b in ((0, 3), (3, 5), (5, 9))]
    torch.testing.assert_close(packed, torch.cat(parts), atol=2e-5, rtol=1e-5)


def test_generation_unchanged_on_a_varlen_model(tiny_model_dir):  # noqa: F811
    from transformers import AutoTokenizer

    from rayrl.rollout import HFRolloutEngine, SamplingParams

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = torch.randint(3, 400, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    prompts = Batch(
        {"input_ids": ids, "attention_mask": mask},
        {"uid": np.array(["a", "b"], dtype=object)},
        {"step": 0},
    )
    params = SamplingParams(n=2, max_new_tokens=6, seed=3)
    outs = []
    for attn, packed in (("eager", False), ("sdpa", True)):
        engine = _engine(tiny_model_dir, attn, packed)
        outs.append(HFRolloutEngine(model=engine.model, tokenizer=tok).generate(prompts, params))
    assert torch.equal(outs[0]["responses"], outs[1]["responses"])
    torch.testing.assert_close(outs[0]["rollout_log_probs"], outs[1]["rollout_log_probs"])


def test_attention_for_keeps_other_implementations():
    assert attention_for("sdpa", packed=False) == VARLEN
    assert attention_for("eager", packed=True) == VARLEN
    assert attention_for("eager", packed=False) == "eager"
    assert attention_for("flash_attention_2", packed=True) == "flash_attention_2"
