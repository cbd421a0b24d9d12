"""The algos functions on a CUDA device: same results as on CPU, bounded entropy memory.

Skipped without a GPU. Also runnable as a script on a GPU machine (no pytest needed):
``PYTHONPATH=src python tests/algos/test_algos_cuda.py`` runs the checks and prints one
JSON line per measured figure (peak memory and time of chunked vs naive log-prob and
entropy at a 151,936-token vocabulary).
"""

from __future__ import annotations

import json
import time

import numpy as np
import torch

from rayrl.algos import (
    ADV_ESTIMATORS,
    POLICY_LOSSES,
    LossAggregation,
    apply_kl_penalty,
    compute_advantages,
    filter_groups,
    find_truncated,
    kl_loss,
    log_probs_and_entropy,
    overlong_penalty,
    pf_ppo_weights,
    truncated_is_weights,
    value_loss,
)

try:
    import pytest

    needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    pytestmark = pytest.mark.cuda
except ImportError:  # script mode on a machine without pytest

    def needs_cuda(fn):
        return fn


VOCAB = 151_936


def _inputs(device: str) -> dict:
    gen = torch.Generator().manual_seed(0)
    batch, length = 12, 16
    lengths = torch.randint(0, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length) < lengths[:, None]).float()
    cpu = {
        "mask": mask,
        "rewards": torch.randn(batch, length, generator=gen),
        "values": torch.randn(batch, length, generator=gen),
        "baselines": torch.randn(batch, generator=gen),
        "lp": torch.randn(batch, length, generator=gen) * 0.5,
        "old": torch.randn(batch, length, generator=gen) * 0.5,
        "ids": torch.randint(0, 5, (batch, length), generator=gen),
        "spi": torch.rand(batch, length, generator=gen),
    }
    return {k: v.to(device) for k, v in cpu.items()}


def _everything(device: str) -> dict[str, torch.Tensor]:
    """Run each public function once; return named results moved to CPU."""
    t = _inputs(device)
    index = np.array([f"u{i % 4}" for i in range(t["mask"].shape[0])], dtype=object)
    out: dict[str, torch.Tensor] = {}
    for name in ADV_ESTIMATORS.names():
        adv, ret = compute_advantages(
            name,
            token_level_rewards=t["rewards"],
            response_mask=t["mask"],
            index=index,
            values=t["values"],
            reward_baselines=t["baselines"],
            old_log_probs=-t["old"].abs(),
            sum_pi_squared=t["spi"],
            gamma=0.99,
            lam=0.95,
        )
        out[f"adv/{name}"], out[f"ret/{name}"] = adv, ret
    adv = out["adv/grpo"]
    weights, _ = truncated_is_weights(t["old"], t["lp"], t["mask"], cap=2.0)
    agg = LossAggregation("seq-mean-token-mean", global_token_count=100, global_seq_count=9)
    for name in POLICY_LOSSES.names():
        lp = t["lp"].clone().requires_grad_()
        loss, metrics = POLICY_LOSSES.get(name)(
            lp, t["old"], adv, t["mask"], agg=agg, is_weights=weights
        )
        loss.backward()
        out[f"loss/{name}"], out[f"grad/{name}"] = loss.detach(), lp.grad
        out[f"clipfrac/{name}"] = metrics["pg_clipfrac"]
    out["vf"] = value_loss(t["lp"], t["old"], t["rewards"], t["mask"], agg=agg)[0]
    out["kl_loss"] = kl_loss(t["lp"], t["old"], t["mask"], estimator="k3+", agg=agg)[0]
    out["kl_rewards"] = apply_kl_penalty(t["rewards"], t["lp"], t["old"], t["mask"], 0.1)[0]
    out["overlong"] = overlong_penalty(t["mask"].sum(-1), 16, 4)
    out["truncated"] = find_truncated(t["ids"], t["mask"], [0, 1])
    out["keep"] = filter_groups(index, t["rewards"].sum(-1).round()).keep
    out["pf_ppo"] = pf_ppo_weights(t["rewards"].sum(-1), "pow", 2.0)
    return {k: v.detach().float().cpu() for k, v in out.items()}


@needs_cuda
def test_cuda_results_match_cpu():
    on_gpu, on_cpu = _everything("cuda"), _everything("cpu")
    for key, value in on_cpu.items():
        torch.testing.assert_close(on_gpu[key], value, atol=1e-5, rtol=1e-4, msg=key)


def _naive(logits: torch.Tensor, labels: torch.Tensor):
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(dim=-1)


def _measure(fn, logits: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """Seconds and peak GiB above the logits and their gradient, for forward + backward."""
    for _ in range(2):  # the first pass warms up kernels and the allocator
        logits.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() + logits.numel() * logits.element_size()
        start = time.perf_counter()
        logp, ent = fn(logits, labels)
        (logp.sum() + 0.01 * ent.sum()).backward()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return seconds, (torch.cuda.max_memory_allocated() - base) / 2**30


def entropy_memory_figures(tokens: int = 8192) -> list[dict]:
    """Chunked vs naive log-prob + entropy at the reference vocabulary, bf16 logits."""
    logits = torch.randn(tokens, VOCAB, device="cuda", dtype=torch.bfloat16).requires_grad_()
    labels = torch.randint(0, VOCAB, (tokens,), device="cuda")
    figures = []
    variants = [("naive", _naive)] + [
        (f"chunk{c}", lambda x, y, c=c: log_probs_and_entropy(x, y, chunk_size=c))
        for c in (256, 512, 1024, 2048)
    ]
    for name, fn in variants:
        seconds, gib = _measure(fn, logits, labels)
        common = {"bench": "algos_logprob_entropy", "variant": name, "tokens": tokens}
        figures.append({**common, "metric": "peak_extra_memory", "value": gib, "unit": "GiB"})
        figures.append({**common, "metric": "fwd_bwd_time", "value": seconds, "unit": "s"})
    return figures


@needs_cuda
def test_chunked_entropy_memory_is_bounded_at_150k_vocab():
    figures = {(f["variant"], f["metric"]): f["value"] for f in entropy_memory_figures(tokens=2048)}
    assert figures[("chunk512", "peak_extra_memory")] < 1.0  # two 512 x vocab buffers
    assert figures[("naive", "peak_extra_memory")] > 2 * figures[("chunk512", "peak_extra_memory")]
    logits = torch.randn(64, VOCAB, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, VOCAB, (64,), device="cuda")
    got, expected = log_probs_and_entropy(logits, labels, chunk_size=16), _naive(logits, labels)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)


if __name__ == "__main__":
    test_cuda_results_match_cpu()
    test_chunked_entropy_memory_is_bounded_at_150k_vocab()
    print(json.dumps({"check": "algos_cuda", "status": "passed", "torch": torch.__version__}))
    for figure in entropy_memory_figures():
        print(json.dumps(figure))
