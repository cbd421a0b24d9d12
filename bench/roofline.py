"""The time a workload needs at the hardware's limits: generation and a GRPO step.

Shared by `bench/rollout.py` (`roofline_fraction`) and `bench/gpu_e2e.py`
(`roofline_step_s`, `step_vs_roofline`). The limits are the card's (`Card`): HBM
bandwidth and bf16 matmul rate for generation, from the table below by the device's
name (`card_for`), or measured at start (`measure_card`: a device-to-device copy and an
8192^3 bf16 product), which an unknown card always gets (`resolve_card`). Training is
counted at the device's dense bf16 peak (`rayrl.models.flops.peak_flops`), with the
FLOP count of `perf/mfu/actor` (`rayrl.models.flops.FlopModel`), so that
``step_vs_roofline`` and the MFU agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class Card:
    """A GPU's limits as a roofline uses them; `source` says where they come from."""

    name: str
    hbm_bytes_per_s: float
    matmul_flops: float  # bf16, what a large product reaches
    source: str  # "table: ..." or "measured ..."

    def fields(self) -> dict:
        """The card as a bench's JSON line records it (``gpu``, ``roofline_card``)."""
        return {"gpu": self.name, "roofline_card": asdict(self)}


# By a substring of `torch.cuda.get_device_name()`; the first match wins. The H200's
# are measured on the lent H200 (../shared/gpu/README.md: 4.3 TB/s copy, 790 TFLOP/s on
# an 8192^3 bf16 product; spec 4.8 TB/s, 989 TFLOP/s dense): every reference figure
# so far used them. The H100 SXM's were measured the same way on a lent H100 (spec 3.35
# TB/s HBM3, 989 TFLOP/s dense bf16); the PCIe H100's are its spec.
CARDS: tuple[tuple[str, float, float, str], ...] = (
    ("H200", 4.3e12, 790e12, "table: measured on the lent H200, 2026-11-29"),
    ("H100 PCIe", 2.0e12, 756e12, "table: H100 PCIe spec (2.0 TB/s, 756 TFLOP/s)"),
    ("H100", 3.03e12, 783e12, "table: measured on a lent H100 (SXM), 2026-12-05"),
)
# the card every reference figure before issue 49 was computed for
H200 = Card("NVIDIA H200", CARDS[0][1], CARDS[0][2], CARDS[0][3])
HBM_BYTES_PER_S = H200.hbm_bytes_per_s


def card_for(device_name: str) -> Card | None:
    """The table's limits for a device name, or None for a card not in it."""
    for key, hbm, flops, source in CARDS:
        if key.lower() in device_name.lower():
            return Card(device_name, hbm, flops, source)
    return None


def measure_card(device: str = "cuda", copy_bytes: int = 2**30, matmul_n: int = 8192) -> Card:
    """The limits measured on `device` now: bandwidth from a copy of `copy_bytes`
    (read + write), the matmul rate from an ``matmul_n``^3 bf16 product; best of 5."""
    import time

    import torch

    def best(fn) -> float:
        fn()  # warm-up
        times = []
        for _ in range(5):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return min(times)

    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    hbm = 2 * copy_bytes / best(lambda: dst.copy_(src))
    a = torch.randn(matmul_n, matmul_n, dtype=torch.bfloat16, device=device)
    flops = 2 * matmul_n**3 / best(lambda: a @ a)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return Card(name, hbm, flops, f"measured at start ({copy_bytes} B copy, {matmul_n}^3 bf16)")


def resolve_card(device_name: str, measure: bool = False, device: str = "cuda") -> Card:
    """The card's limits: measured when asked or when the table lacks the card (its
    `source` then says so), else the table's."""
    known = card_for(device_name)
    if known is not None and not measure:
        return known
    card = measure_card(device)
    if known is None:
        return Card(
            device_name, card.hbm_bytes_per_s, card.matmul_flops, card.source + "; not in the table"
        )
    return card


def generation_seconds(
    config, prompts, out_lens, card: Card, gpus: int = 1, experts: str = "touched"
) -> float:
    """Ideal generation time of ``prompts`` (token lists, or anything with a length)
    answered with ``out_lens`` tokens each: the prefill at the matmul rate, then each
    decode step at max(bytes / bandwidth, FLOPs / matmul rate), with the bandwidth and
    rate of ``gpus`` of ``card`` (a tensor-parallel replica). bf16 weights and KV cache.

    A mixture of experts' decode step reads the experts its tokens chose: with
    ``experts="touched"`` (the physical limit) the expected number of distinct experts
    that ``B`` live tokens pick under uniform routing, ``E (1 - (1 - k/E)^B)`` of each
    sparse layer's ``E`` (at 256 tokens, top-8 of 128: all of them); with
    ``experts="active"`` only the ``k`` one token meets, as if the batch shared its
    experts (below the physical limit at any batch past one token). FLOPs count the
    active experts either way."""
    from rayrl.cli.plan_model import shape_of

    shape = shape_of(config)
    head = config.vocab_size * shape.hidden
    experts_all = shape.expert_params
    dense = shape.params - shape.root_params - experts_all + head  # what every token reads
    share = shape.experts.top_k / shape.experts.experts if shape.experts else 0.0
    active = dense + experts_all * share
    layers, heads, head_dim = shape.layers, shape.heads, shape.head_size
    kv_per_token = 2 * layers * shape.kv_heads * head_dim * 2
    p = np.array([len(x) for x in prompts], dtype=np.float64)
    out_lens = np.asarray(out_lens)
    attn_q = 2 * 2 * layers * heads * head_dim  # qk and pv, per query-key pair
    prefill = 2 * (active - head) * p.sum() + 2 * head * len(p) + attn_q * (p * p / 2).sum()
    total = prefill / card.matmul_flops
    for t in range(int(out_lens.max())):
        live = out_lens > t
        ctx = p[live] + t
        batch = int(live.sum())
        read = 1.0 - (1.0 - share) ** batch if experts == "touched" else share
        flops = 2 * active * batch + attn_q * ctx.sum()
        bytes_ = 2 * (dense + experts_all * read) + kv_per_token * ctx.sum()
        total += max(bytes_ / card.hbm_bytes_per_s, flops / card.matmul_flops)
    return float(total / gpus)


def flop_model(config):
    """`FlopModel` of the model of a transformers ``config``, built on the meta device
    (no memory, no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rayrl.models.flops import FlopModel

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return FlopModel.of(model)


def training_seconds(
    config, seq_lens: Sequence[int], head_tokens: int, peak_flops: float, forward_passes: int = 0
) -> float:
    """Ideal time of one update over sequences of ``seq_lens`` tokens (``head_tokens``
    of them through the output head) plus ``forward_passes`` forward-only passes over
    the same tokens (old log-probs, reference), at ``peak_flops``."""
    model = flop_model(config)
    flops = model.train_flops(seq_lens, head_tokens)
    flops += forward_passes * model.forward_flops(seq_lens, head_tokens)
    return flops / peak_flops


def grpo_step_seconds(
    config,
    seqs: int,
    prompt_len: int,
    response_len: float,
    peak_flops: float,
    forward_passes: int = 0,
    *,
    card: Card,
) -> dict[str, float]:
    """The GRPO step of ``seqs`` sequences of ``prompt_len`` + ``response_len`` tokens
    at the roofline of ``card``: generation (`generation_seconds`) plus training
    (`training_seconds`); the three figures by name."""
    response = int(round(response_len))
    gen = generation_seconds(config, [range(prompt_len)] * seqs, [response] * seqs, card)
    train = training_seconds(
        config, [prompt_len + response] * seqs, seqs * response, peak_flops, forward_passes
    )
    return {"roofline_gen_s": gen, "roofline_train_s": train, "roofline_step_s": gen + train}


def shared_prompt_savings(
    config, seqs: int, group: int, prompt_len: int, peak_flops: float, forward_passes: int = 0
) -> float:
    """Seconds at ``peak_flops`` that the training part of `grpo_step_seconds` spends on
    prompts repeated within groups of ``group`` rows (each shared prompt run once:
    `rayrl.train.shared_prompts`): their body FLOPs, forward and backward plus the
    forward-only passes (the attention to the prompt remains)."""
    repeated = (seqs - seqs // group) * prompt_len
    body = flop_model(config).body_params
    return (6 + 2 * forward_passes) * body * repeated / peak_flops
