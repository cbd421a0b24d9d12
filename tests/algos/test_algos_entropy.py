"""Chunked log-probs and entropy: values, gradients, dtypes and bounded saved memory."""

from __future__ import annotations

import pytest
import torch

from rayrl.algos import entropy_from_logits, log_probs_and_entropy, log_probs_from_logits


def reference(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0):
    logp_all = torch.log_softmax(logits.double() / temperature, dim=-1)
    logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(dim=-1)
    return logp, entropy


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_match_log_softmax_at_any_chunk_size(chunk_size, temperature):
    gen = torch.Generator().manual_seed(chunk_size)
    logits = torch.randn(2, 5, 11, generator=gen, dtype=torch.float64) * 4
    labels = torch.randint(0, 11, (2, 5), generator=gen)
    logp, ent = log_probs_and_entropy(logits, labels, temperature, chunk_size=chunk_size)
    ref_logp, ref_ent = reference(logits, labels, temperature)
    torch.testing.assert_close(logp, ref_logp)
    torch.testing.assert_close(ent, ref_ent)
    torch.testing.assert_close(log_probs_from_logits(logits, labels, temperature, chunk_size), logp)
    torch.testing.assert_close(entropy_from_logits(logits, temperature, chunk_size), ent)


@pytest.mark.parametrize("temperature", [1.0, 1.3])
def test_gradcheck_float64(temperature):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 4, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 6, (3, 4), generator=gen)

    def both(x):
        return log_probs_and_entropy(x, labels, temperature, chunk_size=5)

    assert torch.autograd.gradcheck(both, (logits,))
    assert torch.autograd.gradcheck(lambda x: entropy_from_logits(x, temperature, 2), (logits,))
    assert torch.autograd.gradcheck(
        lambda x: log_probs_from_logits(x, labels, temperature, 2), (logits,)
    )


def test_gradient_of_a_weighted_sum_matches_autograd_reference():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(7, 50, generator=gen, dtype=torch.float32) * 3
    labels = torch.randint(0, 50, (7,), generator=gen)
    w_lp, w_h = torch.randn(7, generator=gen), torch.randn(7, generator=gen)
    x = logits.clone().requires_grad_()
    logp, ent = log_probs_and_entropy(x, labels, chunk_size=3)
    (w_lp * logp + w_h * ent).sum().backward()
    y = logits.double().requires_grad_()
    ref_logp, ref_ent = reference(y, labels)
    (w_lp.double() * ref_logp + w_h.double() * ref_ent).sum().backward()
    torch.testing.assert_close(x.grad, y.grad.float(), atol=1e-5, rtol=1e-4)


def test_bfloat16_logits_compute_in_float32_and_return_bf16_gradients():
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(4, 300, generator=gen) * 5).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 300, (4,), generator=gen)
    logp, ent = log_probs_and_entropy(logits, labels)
    assert logp.dtype == ent.dtype == torch.float32
    ref_logp, ref_ent = reference(logits.detach().float(), labels)
    torch.testing.assert_close(logp.double(), ref_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=1e-5)
    (logp.sum() + ent.sum()).backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad.float()).all()


def test_extreme_logits_stay_finite():
    logits = torch.tensor([[1e4, -1e4, 0.0], [-1e4, -1e4, -1e4]], requires_grad=True)
    logp, ent = log_probs_and_entropy(logits, torch.tensor([1, 0]))
    (logp.sum() + ent.sum()).backward()
    assert torch.isfinite(ent).all() and torch.isfinite(logits.grad).all()
    assert ent[0].item() == pytest.approx(0.0, abs=1e-6)
    assert ent[1].item() == pytest.approx(float(torch.log(torch.tensor(3.0))), rel=1e-6)
    # d entropy / d logits is 0 at one-hot and uniform distributions; d log p / d z is
    # onehot(label) - p.
    expected = torch.tensor([[-1.0, 1.0, 0.0], [2 / 3, -1 / 3, -1 / 3]])
    torch.testing.assert_close(logits.grad, expected, atol=1e-6, rtol=0)


def test_saved_memory_is_per_token_not_per_vocab():
    """Autograd keeps no [tokens, vocab] intermediate beyond the logits themselves."""
    tokens, vocab = 64, 151_936
    logits = torch.randn(tokens, vocab, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, ent = log_probs_and_entropy(logits, labels, chunk_size=16)
    extra = sum(t.numel() * t.element_size() for t in saved if t.data_ptr() != logits.data_ptr())
    assert extra < 16 * tokens * 8  # a few per-token scalars
    (logp.sum() + ent.sum()).backward()
    ref_logp, ref_ent = reference(logits.detach()[:4], labels[:4])
    torch.testing.assert_close(logp[:4].double(), ref_logp, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ent[:4].double(), ref_ent, atol=1e-4, rtol=1e-5)


def test_bad_arguments_are_explained():
    logits = torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match="labels .* must match"):
        log_probs_from_logits(logits, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        entropy_from_logits(logits, temperature=0.0)
