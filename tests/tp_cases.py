"""Models, prompts, sampling cases and the two-rank worker of the tensor-parallel rollout tests.

The worker runs in processes started by `torch.multiprocessing.spawn`, so it lives in a
module of its own (a test module is not importable there)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from rayrl.rollout import NativeRolloutEngine, SamplingParams

# Few slots and blocks, a small prefill budget: chunked prefill, continuous batching.
SMALL = dict(device="cpu", block_size=4, max_num_seqs=3, max_num_batched_tokens=8)
R = 8
PROMPTS = [np.random.default_rng(i).integers(3, 300, 4 + 3 * i).tolist() for i in range(5)]
CASES = {
    "greedy": SamplingParams(do_sample=False, max_new_tokens=R, ignore_eos=True),
    "sampled": SamplingParams(n=2, max_new_tokens=R, seed=3),
    "top_k_top_p": SamplingParams(
        n=2, max_new_tokens=R, seed=4, temperature=0.8, top_k=20, top_p=0.9, ignore_eos=True
    ),
}

CASES_OF = {
    "tiny": tuple(CASES),
    "qwen3": ("greedy", "sampled"),
    "llama_mqa": ("greedy",),
}


def outputs(engine: NativeRolloutEngine, cases=CASES) -> dict:
    """``{case: (tokens, lengths, log_probs)}`` of the engine on `PROMPTS`."""
    result = {}
    for name, params in cases.items():
        out = engine.generate_token_ids(PROMPTS, params)
        result[name] = (out.tokens, out.lengths, out.log_probs)
    return result


def tp_worker(rank: int, init_file: str, dirs: dict[str, str], out_dir: str) -> None:
    """Every model at TP=2 on gloo; weight updates (whole tensors, then the sharded
    stream from an FSDP2 training engine); a call whose prompts differ between ranks."""
    import torch.distributed as dist

    from rayrl.rollout.native.tp import make_tp_groups
    from rayrl.rollout.native.tp_weights import tp_rollout_weights
    from rayrl.train.engine import TrainEngine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        groups = make_tp_groups(2, 2)
        tp = dict(**groups.engine_options, **SMALL)
        result = {"replica": groups.replica, "tp_rank": groups.tp_rank}
        engines = {}
        for key in ("tiny", "qwen3", "llama_mqa"):
            if key == "llama_mqa":  # from an HF module: whole tensors narrowed on load
                from transformers import AutoModelForCausalLM

                hf = AutoModelForCausalLM.from_pretrained(dirs[key])
                engine = NativeRolloutEngine(model=hf, tokenizer=None, **tp)
            else:  # from the files: each rank reads its parts
                engine = NativeRolloutEngine(model_path=dirs[key], **tp)
            cases = {k: CASES[k] for k in CASES_OF[key]}
            result[key] = outputs(engine, cases)
            result[key + "_kv_heads"] = engine.cache.data.shape[-2]
            engines[key] = engine
        engine = engines["tiny"]
        greedy = {"greedy": CASES["greedy"]}
        engine.update_weights(load_file(Path(dirs["tiny_b"]) / "model.safetensors").items())
        result["update_whole"] = outputs(engine, greedy)
        engine.update_weights(load_file(Path(dirs["tiny"]) / "model.safetensors").items())
        trainer = TrainEngine(dirs["tiny_b"])  # FSDP2 over the two ranks
        stream = tp_rollout_weights(trainer.model, torch.float32, engine.spec, 2, 1 << 14)
        result["update_sharded_count"] = engine.update_weights(stream, sharded=True)
        result["update_sharded"] = outputs(engine, greedy)
        prompts = PROMPTS if rank == 0 else PROMPTS[::-1]
        try:
            engine.generate_token_ids(prompts, CASES["greedy"])
        except RuntimeError as err:
            result["mismatch_error"] = str(err)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
