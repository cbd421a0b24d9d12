"""GPU correctness check of the native engine's CUDA paths (not a benchmark; prints JSON lines).

1. Each Triton kernel against its torch reference on fresh random inputs, in bfloat16
   and float32: add+RMSNorm (Llama's, OLMo 2's and Gemma's styles), rotary+KV write
   (with and without Qwen3 q/k norms), SiLU-and-mul, GELU-and-mul (tanh and erf), split-KV decode attention (1 and 4 splits, empty rows included),
   chunked prefill attention, and the fused sampler against `reference_sample_tokens`.
2. The engine on the reference shape (random weights): greedy tokens against
   transformers' greedy ``generate()`` in float32; CUDA graphs against eager; Triton
   against torch kernels in bfloat16; overlapped decode against the synchronous path;
   sampled tokens the same in another batch order; and ``sleep()`` releasing the KV cache.

    python bench/rollout_check.py [--prompts 8] [--new 32]
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from rayrl.models.tiny import reference_05b
from rayrl.rollout import NativeRolloutEngine, SamplingParams
from rayrl.rollout.native.attention import TorchAttention
from rayrl.rollout.native.ops import TorchOps
from rayrl.rollout.native.step import PREFILL_TILE, StepInput
from rayrl.rollout.native.triton_attention import TritonAttention
from rayrl.rollout.native.triton_ops import TritonOps
from rayrl.rollout.native.triton_sampler import fused_sample
from rayrl.rollout.sampling import reference_sample_tokens, sample_keys


def emit(**record) -> None:
    print(json.dumps({"bench": "rollout_check", **record}), flush=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check_kernels(dtype: torch.dtype) -> None:
    dev, name = "cuda", str(dtype).split(".")[-1]
    ref, tri = TorchOps(), TritonOps()
    x, r = (
        torch.randn(300, 896, device=dev, dtype=dtype),
        torch.randn(300, 896, device=dev, dtype=dtype),
    )
    w = torch.randn(896, device=dev, dtype=dtype)
    a, ar = ref.add_rms_norm(x, r.clone(), w, 1e-6)
    b, br = tri.add_rms_norm(x, r.clone(), w, 1e-6)
    emit(
        check="add_rms_norm",
        dtype=name,
        rel_err=rel(b, a),
        residual_equal=bool(torch.equal(ar, br)),
        mismatched=int((a != b).sum()),
    )
    for style in ({"offset": 0.0, "in_float": True}, {"offset": 1.0, "in_float": True}):
        a, ar = ref.add_rms_norm(x, r.clone(), w, 1e-6, **style)
        b, br = tri.add_rms_norm(x, r.clone(), w, 1e-6, **style)
        emit(
            check="add_rms_norm_styled",
            style=style,
            dtype=name,
            rel_err=rel(b, a),
            residual_equal=bool(torch.equal(ar, br)),
            mismatched=int((a != b).sum()),
        )
    gu = torch.randn(300, 2 * 4864, device=dev, dtype=dtype)
    a, b = ref.silu_and_mul(gu), tri.silu_and_mul(gu)
    emit(check="silu_and_mul", dtype=name, rel_err=rel(b, a), mismatched=int((a != b).sum()))
    for approximate in ("tanh", "none"):
        a, b = ref.gelu_and_mul(gu, approximate), tri.gelu_and_mul(gu, approximate)
        emit(
            check=f"gelu_and_mul_{approximate}",
            dtype=name,
            rel_err=rel(b, a),
            mismatched=int((a != b).sum()),
        )
    heads, kvh, d = 14, 2, 64
    qkv = torch.randn(300, (heads + 2 * kvh) * d, device=dev, dtype=dtype)
    pos = torch.randint(0, 4000, (300,), device=dev)
    cos, sin = torch.randn(4096, d, device=dev), torch.randn(4096, d, device=dev)
    slots = torch.randperm(64 * 16, device=dev)[:300]
    slots[::7] = -1
    for norm in (
        None,
        (torch.randn(d, device=dev, dtype=dtype), torch.randn(d, device=dev, dtype=dtype), 1e-6),
    ):
        caches = [torch.zeros(64, 16, kvh, d, device=dev, dtype=dtype) for _ in range(4)]
        qa = ref.rope_and_store(
            qkv, pos, cos, sin, caches[0], caches[1], slots, (heads, kvh, d), norm
        )
        qb = tri.rope_and_store(
            qkv, pos, cos, sin, caches[2], caches[3], slots, (heads, kvh, d), norm
        )
        emit(
            check="rope_and_store",
            dtype=name,
            qk_norm=norm is not None,
            rel_err=rel(qb, qa),
            q_mismatched=int((qa != qb).sum()),
            k_rel_err=rel(caches[2], caches[0]),
            v_equal=bool(torch.equal(caches[1], caches[3])),
        )
    check_attention(dtype, name)
    logits = (torch.randn(256, 151936, device=dev) * 2).to(dtype)
    keys = sample_keys(0, 1, [f"s{i}" for i in range(256)]).to(dev)
    positions = torch.arange(256, device=dev)
    for params in (
        SamplingParams(do_sample=False),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7),
    ):
        t, lp = fused_sample(logits, keys, positions, params)
        rt, rlp = reference_sample_tokens(logits, keys, positions, params)
        emit(
            check="fused_sampler",
            dtype=name,
            temperature=params.temperature,
            greedy=params.greedy,
            tokens_equal=bool(torch.equal(t, rt)),
            log_prob_max_err=float((lp - rlp).abs().max()),
        )


def check_attention(dtype: torch.dtype, name: str) -> None:
    dev, heads, kvh, d, bs, blocks = "cuda", 14, 2, 64, 16, 4096
    kc = torch.randn(blocks, bs, kvh, d, device=dev, dtype=dtype)
    vc = torch.randn_like(kc)
    table = torch.randperm(blocks, device=dev, dtype=torch.int32).reshape(32, 128)
    lens = torch.randint(1, 128 * bs, (32,), device=dev)
    lens[3], lens[5] = 0, 1
    rows = torch.randperm(32, device=dev)
    q = torch.randn(32, heads, d, device=dev, dtype=dtype)
    step = StepInput(None, None, None, rows, lens, table, None, decode=True)
    a = TorchAttention.decode(q, kc, vc, step, 0.125)
    live = lens > 0
    for splits in (1, 4):
        b = TritonAttention().decode(q, kc, vc, step, 0.125, splits=splits)
        emit(
            check="decode_attention",
            dtype=name,
            splits=splits,
            rel_err=rel(b[live], a[live]),
            empty_rows_zero=bool((b[~live] == 0).all()),
        )
    q_lens, totals = [300, 17, 64, 129], [300, 500, 1000, 129]
    starts = [0, *np.cumsum(q_lens).tolist()]
    q = torch.randn(starts[-1], heads, d, device=dev, dtype=dtype)
    tiles = torch.tensor(
        [(i, a0) for i in range(4) for a0 in range(0, q_lens[i], PREFILL_TILE)],
        dtype=torch.int32,
        device=dev,
    )
    step = StepInput(
        None,
        None,
        None,
        rows[:4],
        torch.tensor(totals, device=dev),
        table,
        None,
        decode=False,
        q_start=torch.tensor(starts, device=dev),
        q_start_host=starts,
        seq_lens_host=totals,
        tiles=tiles,
    )
    a = TorchAttention.prefill(q, kc, vc, step, 0.125)
    b = TritonAttention().prefill(q, kc, vc, step, 0.125)
    emit(check="prefill_attention", dtype=name, rel_err=rel(b, a))


def reference_model(dtype: torch.dtype):
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(reference_05b().to_config()).to(dtype).eval()
    model.generation_config.eos_token_id = None
    return model


def check_engine(n_prompts: int, new: int) -> None:
    rng = np.random.default_rng(1)
    prompts = [rng.integers(10, 150000, int(n)).tolist() for n in rng.integers(5, 300, n_prompts)]
    greedy = SamplingParams(do_sample=False, max_new_tokens=new, ignore_eos=True)
    kw = dict(gpu_memory_utilization=0.2, max_num_seqs=64, max_model_len=1024)
    model = reference_model(torch.float32)
    hf = []
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        out = model.generate(ids, do_sample=False, max_new_tokens=new, pad_token_id=0)
        hf.append(out[0, len(p) :].tolist())
    for eager in (True, False):
        engine = NativeRolloutEngine(model=model, dtype=torch.float32, enforce_eager=eager, **kw)
        out = engine.generate_token_ids(prompts, greedy).tokens.tolist()
        same = sum(a == b for a, b in zip(out, hf, strict=True))
        agree = np.mean([np.mean(np.equal(a, b)) for a, b in zip(out, hf, strict=True)])
        emit(
            check="greedy_vs_transformers",
            dtype="float32",
            graphs=not eager,
            identical_rows=f"{same}/{len(prompts)}",
            token_agreement=float(agree),
        )
        del engine
    del model
    torch.cuda.empty_cache()
    model = reference_model(torch.bfloat16)
    results = {}
    for kernels, eager in (("torch", True), ("triton", True), ("triton", False)):
        engine = NativeRolloutEngine(model=model, kernels=kernels, enforce_eager=eager, **kw)
        results[(kernels, eager)] = engine.generate_token_ids(prompts, greedy)
        if (kernels, eager) == ("triton", False):
            check_overlap(engine, prompts, new)
            check_sampling_and_sleep(engine, prompts, new)
        del engine
        torch.cuda.empty_cache()
    for a, b, what in (
        (("torch", True), ("triton", True), "triton_vs_torch_kernels"),
        (("triton", True), ("triton", False), "graphs_vs_eager"),
    ):
        ta, tb = results[a].tokens, results[b].tokens
        emit(
            check=what,
            dtype="bfloat16",
            greedy_token_agreement=float((ta == tb).float().mean()),
            first_token_log_prob_max_err=float(
                (results[a].log_probs[:, 0] - results[b].log_probs[:, 0]).abs().max()
            ),
        )


def check_overlap(engine, prompts, new) -> None:
    """Overlapped decode (tokens fed on the device, stops a step late) against the
    synchronous path: seeded samples with per-row lengths, greedy with a stop token."""
    limits = [new - (i % 5) * 3 for i in range(2 * len(prompts))]
    free = engine.generate_token_ids(
        prompts, SamplingParams(do_sample=False, max_new_tokens=new, ignore_eos=True)
    ).tokens
    stop = int(free[:, 1:].flatten().mode().values)  # a frequent token: several rows stop
    cases = {
        "sampled_lengths": (
            SamplingParams(n=2, max_new_tokens=new, ignore_eos=True, seed=3),
            limits,
        ),
        "greedy_stop_token": (
            SamplingParams(
                do_sample=False, max_new_tokens=new, ignore_eos=True, stop_token_ids=(stop,)
            ),
            None,
        ),
    }
    for name, (params, lengths) in cases.items():
        outs, stats = [], []
        for overlap in (False, True):
            engine.overlap = overlap
            outs.append(engine.generate_token_ids(prompts, params, max_new_tokens=lengths))
            stats.append(engine.last_stats)
        a, b = outs
        emit(
            check="overlap_vs_sync",
            case=name,
            dtype="bfloat16",
            tokens_equal=bool(torch.equal(a.tokens, b.tokens)),
            lengths_equal=bool(torch.equal(a.lengths, b.lengths)),
            log_probs_equal=bool(torch.equal(a.log_probs, b.log_probs)),
            stopped=int(b.stopped.sum()),
            overlapped_steps=stats[1]["overlapped_steps"],
            dropped_tokens=stats[1]["dropped_tokens"],
        )
    engine.overlap = True


def check_sampling_and_sleep(engine, prompts, new) -> None:
    params = SamplingParams(n=2, max_new_tokens=new, ignore_eos=True, seed=5)
    keys = sample_keys(5, 0, [f"{i}/{k}" for i in range(len(prompts)) for k in range(2)]).numpy()
    full = engine.generate_token_ids(prompts, params, keys=keys).tokens
    order = list(range(len(prompts)))[::-1]
    rows = [2 * i + k for i in order for k in range(2)]
    rev = engine.generate_token_ids([prompts[i] for i in order], params, keys=keys[rows]).tokens
    emit(
        check="sampling_other_batch_order",
        dtype="bfloat16",
        token_agreement=float((rev == full[rows]).float().mean()),
        identical_rows=f"{sum(bool(torch.equal(rev[j], full[r])) for j, r in enumerate(rows))}/{len(rows)}",
    )
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    engine.sleep()
    after = torch.cuda.memory_reserved()
    engine.wake()
    again = engine.generate_token_ids(prompts, params, keys=keys).tokens
    emit(
        check="sleep_frees_kv_cache",
        cache_gb=engine.cache.nbytes / 2**30,
        reserved_drop_gb=(before - after) / 2**30,
        drop_fraction_of_cache=(before - after) / engine.cache.nbytes,
        same_after_wake=bool(torch.equal(again, full)),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--kernels-only", action="store_true", help="bfloat16 kernel checks only")
    args = parser.parse_args()
    for dtype in (torch.bfloat16,) if args.kernels_only else (torch.bfloat16, torch.float32):
        check_kernels(dtype)
    if not args.kernels_only:
        check_engine(args.prompts, args.new)


if __name__ == "__main__":
    main()
