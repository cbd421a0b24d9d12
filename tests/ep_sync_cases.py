"""The bodies of `test_expert_sync`'s gloo runs (imported by name in each spawned
process): the rollout weight stream of an expert-parallel engine (whole tensors, and a
tensor-parallel rollout's parts) against each weight made whole alone, with the
collectives it ran."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

# ranks -> {layout: expert_parallel_size}; the test model has 6 experts, so at 4 ranks
# ep=2 puts 3 experts on each EP rank, split 2 + 1 over its 2 edp ranks (padded chunks)
LAYOUTS = {2: {"ep1": 1, "ep2": 2}, 4: {"ep2_dp2": 2}}
SMALL_BUCKET = 1 << 16  # several buckets, some with experts and other weights together
WHOLE_MODEL = 1 << 30  # one bucket: one all-gather per mesh


def build_moe(out: Path, experts: int = 6) -> Path:
    """A tiny Qwen3-MoE with ``experts`` experts a block, random weights (fp32)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rayrl.models.tiny import build_tiny_model

    path = build_tiny_model(out, family="qwen3_moe", seed=4)
    config = AutoConfig.from_pretrained(path)
    config.num_experts = experts
    torch.manual_seed(4)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


class Counted:
    """Counts, while active, the all-gathers the stream runs (with their output bytes)
    and the DTensors made whole one at a time (``full_tensor``)."""

    def __enter__(self):
        from torch.distributed.tensor import DTensor

        self.gathers: list[int] = []
        self.full_tensors = 0
        self._gather, self._full = dist.all_gather_into_tensor, DTensor.full_tensor

        def gather(out, *args, **kwargs):
            self.gathers.append(out.numel() * out.element_size())
            return self._gather(out, *args, **kwargs)

        def full(tensor, *args, **kwargs):
            self.full_tensors += 1
            return self._full(tensor, *args, **kwargs)

        dist.all_gather_into_tensor, DTensor.full_tensor = gather, full
        return self

    def __exit__(self, *exc):
        from torch.distributed.tensor import DTensor

        dist.all_gather_into_tensor, DTensor.full_tensor = self._gather, self._full


def _stream(engine, bucket: int) -> dict:
    from rayrl.train.expert_sync import expert_shard

    with Counted() as counted:
        got = [(n, t.clone()) for n, t in engine.rollout_weights(torch.float32, bucket)]
    experts = [n for n, p in engine.model.named_parameters() if expert_shard(p)]
    return {
        "names": [n for n, _ in got],
        "tensors": dict(got),
        "gathers": counted.gathers,
        "full_tensors": counted.full_tensors,
        "expert_names": experts,
    }


def _tp_parts(engine, model_dir: str) -> dict:
    """This rank's TP=2 parts streamed (`tp_rollout_weights`) and cut from whole tensors."""
    from transformers import AutoConfig

    from rayrl.rollout.native.families import family_for
    from rayrl.rollout.native.shards import TPShard
    from rayrl.rollout.native.tp_weights import tp_rollout_weights

    config = AutoConfig.from_pretrained(model_dir)
    spec = family_for(config).read(config)
    mine = TPShard(spec, 2, dist.get_rank() % 2)
    whole = {n: t.clone() for n, t in engine.rollout_weights(torch.float32, SMALL_BUCKET)}
    with Counted() as counted:
        parts = {
            n: t.clone()
            for n, t in tp_rollout_weights(engine.model, torch.float32, spec, 2, SMALL_BUCKET)
        }
    want = {n: mine.take(n, t).contiguous() for n, t in whole.items()}
    return {"parts": parts, "want": want, "full_tensors": counted.full_tensors}


def sync_worker(rank: int, world: int, init_file: str, model_dir: str, out_dir: str) -> None:
    """Per layout: each weight made whole alone (the reference), then the stream with a
    small and a whole-model bucket; at 2 ranks with EP, a TP=2 rollout's parts too."""
    from rayrl.train.engine import TrainEngine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    out: dict = {}
    try:
        for name, ep in LAYOUTS[world].items():
            engine = TrainEngine(model_dir, trainable=False, expert_parallel_size=ep)
            reference = {
                n: p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
                for n, p in engine.model.named_parameters()
            }
            out[name] = {
                "reference": reference,
                "order": list(reference),
                "small": _stream(engine, SMALL_BUCKET),
                "whole": _stream(engine, WHOLE_MODEL),
            }
            if world == 2 and ep == 2:
                out[name]["tp"] = _tp_parts(engine, model_dir)
        torch.save(out, Path(out_dir) / f"sync{rank}.pt")
    finally:
        dist.destroy_process_group()
