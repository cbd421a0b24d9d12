"""The fused output head: exact log-probs, entropy and gradients at any temperature, the
model's parameters untouched, and no [tokens x vocab] tensor kept for the backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine_cases import ragged_batch, tiny_model_dir  # noqa: F401 (fixture)
from rayrl.train.engine import TrainEngine
from rayrl.train.logprob_head import LogProbHead, install_logprob_head, logprob_head_of
from rayrl.train.outputs import response_outputs

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("bias", [False, True])
def test_fused_head_matches_log_softmax_and_its_gradients(bias):
    torch.manual_seed(0)
    n, hidden, vocab, temperature = 37, 16, 50, 0.7
    head = LogProbHead(hidden, vocab, bias=bias).double()
    h = torch.randn(2, n, hidden, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, vocab, (2, n))
    with head.requested(
        labels, temperature, with_entropy=True, chunk_size=8
    ):  # 8 does not divide 37
        out = head(h)
    log_softmax = (F.linear(h, head.weight, head.bias) / temperature).log_softmax(-1)
    ref_lp = log_softmax.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(log_softmax.exp() * log_softmax).sum(-1)
    torch.testing.assert_close(out[..., 0], ref_lp)
    torch.testing.assert_close(out[..., 1], ref_ent)
    w1, w2 = torch.randn(2, n, dtype=torch.float64), torch.randn(2, n, dtype=torch.float64)
    params = [h, *head.parameters()]
    got = torch.autograd.grad((out[..., 0] * w1 + out[..., 1] * w2).sum(), params)
    want = torch.autograd.grad((ref_lp * w1 + ref_ent * w2).sum(), params)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    assert head(h).shape == (2, n, vocab)  # outside `requested`: the plain linear layer


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_kept_logits_give_the_recomputed_gradients_without_a_second_projection(
    monkeypatch, temperature
):
    """The forward keeping its logits (memory allowing) or the backward recomputing
    them: bitwise the same outputs and gradients; kept, the backward never projects."""
    from types import SimpleNamespace

    from rayrl.train import logprob_head

    torch.manual_seed(0)
    head = LogProbHead(16, 50, bias=True)
    h = torch.randn(37, 16, requires_grad=True)
    labels = torch.randint(0, 50, (37,))
    w = torch.randn(37, 2)
    runs = []
    for limit in (0, 2**30):  # bytes the host may keep: none, all
        monkeypatch.setattr(logprob_head, "KEEP_LOGITS_HOST_BYTES", limit)
        projections = []

        def linear(*args, _seen=projections):
            _seen.append(1)
            return F.linear(*args)

        monkeypatch.setattr(logprob_head, "F", SimpleNamespace(linear=linear))
        with head.requested(labels, temperature, with_entropy=True, chunk_size=8):
            out = head(h)
        forward_projections = len(projections)
        grads = torch.autograd.grad((out * w).sum(), [h, *head.parameters()])
        runs.append((out.detach(), *grads, forward_projections, len(projections)))
    (*recomputed, f0, n0), (*kept, f1, n1) = runs
    for a, b in zip(kept, recomputed, strict=True):
        assert torch.equal(a, b)
    assert (f0, n0) == (5, 10) and (f1, n1) == (5, 5)  # 5 chunks of 37 rows


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_head_on_cuda_accumulates_the_weight_gradient_in_float32():
    """bf16 weights and hidden states on CUDA: the weight gradient is added chunk by
    chunk into float32 by cuBLAS itself; it matches a float64 reference to bf16 rounding
    of the inputs, not of each chunk's partial sum."""
    torch.manual_seed(0)
    n, hidden, vocab = 1000, 64, 3000
    head = LogProbHead(hidden, vocab, bias=False).cuda().bfloat16()
    h = torch.randn(n, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (n,), device="cuda")
    with head.requested(labels, 1.0, with_entropy=False, chunk_size=64):
        out = head(h)
    (grad_w,) = torch.autograd.grad(out[..., 0].sum(), [head.weight])
    w64 = head.weight.detach().double().requires_grad_()
    h64 = h.detach().double()
    ref = F.linear(h64, w64).log_softmax(-1).gather(-1, labels.unsqueeze(-1)).sum()
    (want,) = torch.autograd.grad(ref, [w64])
    assert grad_w.dtype == torch.bfloat16
    torch.testing.assert_close(grad_w.double(), want, atol=2e-2, rtol=2e-2)


def test_install_keeps_names_and_tied_weights(tiny_model_dir):  # noqa: F811
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    head = install_logprob_head(model)
    assert logprob_head_of(model) is head and isinstance(model.lm_head, LogProbHead)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_training_keeps_no_vocab_sized_tensor(tiny_model_dir, monkeypatch):  # noqa: F811
    """Without room to keep logits (`keep_logits`), nothing vocabulary-sized is saved
    for the backward."""
    from rayrl.train import logprob_head

    monkeypatch.setattr(logprob_head, "KEEP_LOGITS_HOST_BYTES", 0)
    monkeypatch.setattr(logprob_head, "KEEP_LOGITS_SHARE", 0.0)  # on CUDA: no room either
    engine = TrainEngine(tiny_model_dir)
    batch = ragged_batch(6, seed=4)
    vocab = engine.config.vocab_size
    saved: list[tuple[int, ...]] = []

    def keep(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = response_outputs(
            engine.model,
            batch,
            packed=True,
            with_entropy=True,
            temperature=0.7,
            device=engine.device,  # the batch moves where the model is (a GPU, when there is one)
        )
    (out["log_probs"].sum() + out["entropy"].sum()).backward()
    assert saved and not [s for s in saved if s[-1:] == (vocab,)]  # no logits, no softmax


@pytest.mark.parametrize(
    ("family", "change"),
    [("granite", {"logits_scaling": 2.0}), ("gemma2", {"final_logit_softcapping": 4.0})],
)
def test_models_that_change_their_logits_keep_the_log_probs_of_their_logits(family, change):
    """Granite divides the head's output by ``logits_scaling``, Gemma 2 soft-caps it: a
    fused head, whose output is log-probs, would have them divided or capped. Such a
    model keeps its linear head, and its log-probs and entropy are its logits'."""
    from family_cases import family_model

    models = [family_model(family, vocab_size=512, **change) for _ in range(2)]
    assert install_logprob_head(models[1]) is None
    batch = ragged_batch(3, seed=1)
    plain, installed = (
        response_outputs(m, batch, packed=False, with_entropy=True, temperature=0.7) for m in models
    )
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(installed[key], plain[key])
