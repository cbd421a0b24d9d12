"""The training engine's attention keeps each family's layer variants: sliding windows
and attention-logit soft-capping, in packed rows (per sequence, or one flash call) and
in unpacked ones, as transformers' eager attention computes them.

Every row here is longer than the families' windows (5 tokens), and Gemma 2's soft-cap
(3.0) binds, so a path that attends over the whole causal prefix, or skips the cap,
gives other log-probs."""

from __future__ import annotations

import pytest
import torch

from engine_cases import ragged_batch
from family_cases import family_model
from rayrl.train.engine import TrainEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Families whose layers attend in windows, or soft-cap their attention logits.
VARIANTS = ("mistral", "gemma2", "gemma3_text", "qwen2", "olmo3", "phi3")
TOL = dict(atol=2e-5, rtol=1e-5)
LENGTHS = [(12, 10), (2, 9), (7, 4), (12, 1), (4, 10)]


@pytest.fixture(scope="module", params=VARIANTS)
def variant_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    family_model(request.param, vocab_size=512).save_pretrained(path)  # ragged_batch's ids
    return path


def _log_probs(model_dir, attn: str, packed: bool) -> torch.Tensor:
    engine = TrainEngine(
        model_dir, attn_implementation=attn, use_remove_padding=packed, tokenizer_path=None
    )
    batch = ragged_batch(len(LENGTHS), lengths=LENGTHS, seed=5)
    return engine.forward(batch, micro_batch_size=len(LENGTHS))["log_probs"]


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_windows_and_softcaps_as_eager_attention(variant_dir, packed):
    want = _log_probs(variant_dir, "eager", packed=False)
    got = _log_probs(variant_dir, "sdpa", packed=packed)
    torch.testing.assert_close(got, want, **TOL)


def test_a_row_without_padding_or_boundaries_keeps_its_window(variant_dir):
    """A caller's own forward over one unpadded row, and over a row it packed itself
    (restarting positions): no mask comes from transformers, the window still holds."""
    eager = TrainEngine(variant_dir, attn_implementation="eager", use_remove_padding=False)
    varlen = TrainEngine(variant_dir, attn_implementation="sdpa", use_remove_padding=True)
    ids = torch.randint(3, 500, (1, 14), generator=torch.Generator().manual_seed(2))
    positions = torch.tensor([list(range(9)) + list(range(5))])
    with torch.no_grad():
        torch.testing.assert_close(
            varlen.model(input_ids=ids).logits, eager.model(input_ids=ids).logits, **TOL
        )
        parts = [eager.model(input_ids=ids[:, a:b]).logits for a, b in ((0, 9), (9, 14))]
        packed = varlen.model(input_ids=ids, position_ids=positions).logits
    torch.testing.assert_close(packed, torch.cat(parts, dim=1), **TOL)


def test_decoding_on_the_cache_keeps_the_variants(variant_dir):
    """transformers' own generation (one query over the cached keys a step) on a model
    loaded with the packed attention: the logits eager attention gives."""
    eager = TrainEngine(variant_dir, attn_implementation="eager", use_remove_padding=False)
    varlen = TrainEngine(variant_dir, attn_implementation="sdpa", use_remove_padding=True)
    ids = torch.randint(3, 500, (2, 8), generator=torch.Generator().manual_seed(4))
    steps = []
    for engine in (eager, varlen):
        engine.model.eval()
        with torch.no_grad():
            out = engine.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=6,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        steps.append(torch.stack(out.logits))
    torch.testing.assert_close(steps[1], steps[0], **TOL)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the flash kernel runs on CUDA")
@pytest.mark.parametrize("window", [None, 5])
def test_the_flash_call_slides_as_the_per_sequence_path(window):
    """bf16 on CUDA: one flash call over a packed row (segments of 11, 3 and 20 tokens;
    grouped KV heads) in a window of 5, against each sequence attended on its own."""
    from rayrl.train.attention import _per_sequence, _varlen, register_varlen_attention
    from rayrl.train.attention_variant import Variant

    register_varlen_attention()
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(1, h, 34, 32, device="cuda", generator=g, dtype=torch.bfloat16)
        for h in (8, 2, 2)
    )
    cu = torch.tensor([0, 11, 14, 34], dtype=torch.int32, device="cuda")
    variant = Variant(window=window)
    got = _varlen(q, k, v, cu, 20, None, variant=variant)
    want = _per_sequence(q.float(), k.float(), v.float(), cu, None, cu, variant)
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


def test_a_window_that_hides_a_single_key_still_binds(variant_dir):
    """Sequences one token longer than the window (6 tokens, a window of 5): the last
    query does not see the first key, unpacked and in a packed row, as in eager."""
    eager = TrainEngine(variant_dir, attn_implementation="eager", use_remove_padding=False)
    varlen = TrainEngine(variant_dir, attn_implementation="sdpa", use_remove_padding=True)
    ids = torch.randint(3, 500, (1, 12), generator=torch.Generator().manual_seed(6))
    positions = torch.tensor([list(range(6)) * 2])
    with torch.no_grad():
        parts = [eager.model(input_ids=ids[:, a:b]).logits for a, b in ((0, 6), (6, 12))]
        one = varlen.model(input_ids=ids[:, :6]).logits
        packed = varlen.model(input_ids=ids, position_ids=positions).logits
    torch.testing.assert_close(one, parts[0], **TOL)
    torch.testing.assert_close(packed, torch.cat(parts, dim=1), **TOL)
