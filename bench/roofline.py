"""The time a workload needs at the hardware's limits: generation and a GRPO step.

Shared by `bench/rollout.py` (`roofline_fraction`) and `bench/gpu_e2e.py`
(`roofline_step_s`, `step_vs_roofline`). The limits were measured on the H200 of the
GPU machine (`../shared/gpu/README.md`): HBM bandwidth and the bf16 matmul rate of an
8192^3 product. Training is counted at the device's dense bf16 peak
(`rayrl.models.flops.peak_flops`), with the FLOP count of `perf/mfu/actor`
(`rayrl.models.flops.FlopModel`), so that ``step_vs_roofline`` and the MFU agree.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

HBM_BYTES_PER_S = 4.3e12  # measured on the H200 here (../shared/gpu/README.md)
MATMUL_FLOPS = 790e12  # bf16, measured there on an 8192^3 product


def generation_seconds(config, prompts, out_lens, gpus: int = 1) -> float:
    """Ideal generation time of ``prompts`` (token lists, or anything with a length)
    answered with ``out_lens`` tokens each: the prefill at the matmul rate, then each
    decode step at max(bytes / bandwidth, FLOPs / matmul rate), with the bandwidth and
    rate of ``gpus`` GPUs (a tensor-parallel replica). bf16 weights and KV cache."""
    hidden, layers, inter = config.hidden_size, config.num_hidden_layers, config.intermediate_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = hidden // heads
    layer_params = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    layer_params += 3 * hidden * inter
    body = layers * layer_params
    head = config.vocab_size * hidden
    weight_bytes = 2 * (body + head)
    kv_per_token = 2 * layers * kv_heads * head_dim * 2
    p = np.array([len(x) for x in prompts], dtype=np.float64)
    out_lens = np.asarray(out_lens)
    attn_q = 2 * 2 * layers * heads * head_dim  # qk and pv, per query-key pair
    prefill = 2 * body * p.sum() + 2 * head * len(p) + attn_q * (p * p / 2).sum()
    total = prefill / MATMUL_FLOPS
    for t in range(int(out_lens.max())):
        live = out_lens > t
        ctx = p[live] + t
        flops = 2 * (body + head) * live.sum() + attn_q * ctx.sum()
        bytes_ = weight_bytes + kv_per_token * ctx.sum()
        total += max(bytes_ / HBM_BYTES_PER_S, flops / MATMUL_FLOPS)
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
) -> dict[str, float]:
    """The GRPO step of ``seqs`` sequences of ``prompt_len`` + ``response_len`` tokens
    at the roofline: generation (`generation_seconds`) plus training
    (`training_seconds`); the three figures by name."""
    response = int(round(response_len))
    gen = generation_seconds(config, [range(prompt_len)] * seqs, [response] * seqs)
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
