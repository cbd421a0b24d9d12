"""GPU check of tensor-parallel rollout (not a benchmark; prints JSON lines).

The native engine split over ``--tp`` ranks against one unsplit engine (CUDA graphs,
Triton kernels), on a Qwen2-shaped model (hidden 512, 4 layers, 8 heads, 2 KV heads,
an odd vocabulary of 32003 tokens) with larger random weights so that logits are
decisive, for greedy decoding, sampling at temperature 1, and top-k + top-p:

- default: ``--tp`` processes, one GPU each, NCCL, CUDA graphs on (the decode graph
  then holds the all-reduces), as a run uses them;
- ``--one-gpu``: the processes share GPU 0 over gloo, eager (gloo collectives cannot be
  captured): what one GPU can check, i.e. the Triton kernels on each rank's heads, the
  sampler over the split vocabulary on CUDA, the ranks in lockstep.

In float32 the split model's tokens should equal the unsplit one's (its all-reduces
round differently, by float32 rounding); in bfloat16 that rounding is coarse enough to
flip near-ties, so the token agreement is reported, not required. Every rank of the
group must return the very same output (``ranks_equal``).

    python bench/rollout_tp_check.py [--tp 2] [--one-gpu] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rayrl.rollout import NativeRolloutEngine, SamplingParams
from rayrl.rollout.native.tp import make_tp_groups

R = 24
PROMPTS = [np.random.default_rng(i).integers(10, 32000, 20 + 37 * i).tolist() for i in range(12)]
CASES = {
    "greedy": SamplingParams(do_sample=False, max_new_tokens=R, ignore_eos=True),
    "sampled": SamplingParams(n=2, max_new_tokens=R, ignore_eos=True, seed=3),
    "top_k_top_p": SamplingParams(
        n=2, max_new_tokens=R, ignore_eos=True, seed=4, temperature=0.8, top_k=50, top_p=0.9
    ),
}


def build_model(path: str) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=1024,
        vocab_size=32003,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=0,
        pad_token_id=0,
    )
    model = Qwen2ForCausalLM(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.06 if p.dim() == 2 else 0.3
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else scale * noise)
    model.save_pretrained(path)


def engine_options(dtype: str) -> dict:
    return dict(
        device="cuda",
        dtype=dtype,
        tokenizer=object(),  # no tokenizer files: ids only, EOS and pad from the config
        gpu_memory_utilization=0.2,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        max_model_len=1024,
    )


def outputs(engine: NativeRolloutEngine) -> dict:
    result = {}
    for name, params in CASES.items():
        out = engine.generate_token_ids(PROMPTS, params)
        result[name] = (out.tokens, out.log_probs)
    return result


def tp_rank(rank: int, args: argparse.Namespace, path: str, dtype: str, out_dir: str) -> None:
    if not args.one_gpu:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "gloo" if args.one_gpu else "nccl",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=rank,
        world_size=args.tp,
    )
    try:
        groups = make_tp_groups(args.tp, args.tp)
        engine = NativeRolloutEngine(
            model_path=path,
            enforce_eager=args.one_gpu,
            **groups.engine_options,
            **engine_options(dtype),
        )
        result = outputs(engine)
        result["kernels"] = engine.kernels
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def compare(dtype: str, ref: dict, ranks: list[dict], args) -> None:
    for case in CASES:
        tokens, log_probs = ranks[0][case]
        same = all(
            torch.equal(r[case][0], tokens) and torch.equal(r[case][1], log_probs) for r in ranks
        )
        ref_tokens, ref_log_probs = ref[case]
        record = {
            "bench": "rollout_tp_check",
            "tp": args.tp,
            "mode": "one_gpu_gloo_eager" if args.one_gpu else "nccl_graphs",
            "dtype": dtype,
            "case": case,
            "kernels": ranks[0]["kernels"],
            "ranks_equal": same,
            "tokens_equal": bool(torch.equal(tokens, ref_tokens)),
            "token_agreement": round(float((tokens == ref_tokens).float().mean()), 4),
            "first_token_agreement": round(
                float((tokens[:, 0] == ref_tokens[:, 0]).float().mean()), 4
            ),
            "first_log_prob_max_diff": float((log_probs[:, 0] - ref_log_probs[:, 0]).abs().max()),
        }
        print(json.dumps(record), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--one-gpu", action="store_true")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        args.port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model")
        build_model(path)
        for dtype in args.dtypes.split(","):
            engine = NativeRolloutEngine(model_path=path, **engine_options(dtype))
            ref = outputs(engine)
            engine.sleep()
            del engine
            torch.cuda.empty_cache()
            out_dir = os.path.join(tmp, dtype)
            os.makedirs(out_dir)
            mp.spawn(tp_rank, args=(args, path, dtype, out_dir), nprocs=args.tp)
            ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(args.tp)]
            compare(dtype, ref, ranks, args)
            with socket.socket() as s:  # a fresh port for the next group
                s.bind(("127.0.0.1", 0))
                args.port = s.getsockname()[1]


if __name__ == "__main__":
    main()
