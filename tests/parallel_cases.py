"""The body of the 4-rank gloo run of `test_engine_parallel` (imported by name in each
spawned process): the same training step and forward under every layout of ranks.

Each layout trains one step on its data-parallel share of `BATCH` (rows ``dp_rank::
dp_size``: the ranks of a sequence-parallel group take the same rows) under a token
budget that gives ragged micro-batches, dummies on some ranks and, under SP=4, a rank
whose share of a packed row holds no response token. The full gradients (before the
optimizer step), the step's metrics and a forward's outputs are saved for the parent to
compare with one unsharded process.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine_cases import OPTIM, pg_loss, ragged_batch, value_loss

LENGTHS = [(12, 1), (1, 10), (5, 5), (9, 10), (2, 2), (3, 1), (12, 10), (6, 3)]
BUDGET = 24
LAYOUTS = {
    "flat": {},
    "hsdp": {"fsdp_size": 2},
    "sp2": {"ulysses_sequence_parallel_size": 2, "gradient_checkpointing": True},
    "sp2_hsdp": {"ulysses_sequence_parallel_size": 2, "fsdp_size": 2},
    "sp4": {"ulysses_sequence_parallel_size": 4},  # 2 KV heads: each repeated to 4 ranks
}


def batch():
    return ragged_batch(len(LENGTHS), seed=1, lengths=LENGTHS)


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def record_gradients(engine) -> dict[str, torch.Tensor]:
    """Full gradients of the last optimizer step, taken just before it (every rank
    gathers them together: the step runs on all ranks at once)."""
    grads: dict[str, torch.Tensor] = {}
    step = engine.residency.step

    def recording() -> None:
        for name, p in engine.model.named_parameters():
            if p.grad is not None:
                grads[name] = full(p.grad)
        step()

    engine.residency.step = recording
    return grads


def run_layout(engine, loss_fn, with_entropy: bool) -> dict:
    rows = list(range(engine.dp_rank, len(LENGTHS), engine.dp_size))
    grads = record_gradients(engine)
    metrics = engine.train_step(batch().index(rows), loss_fn, max_tokens_per_micro_batch=BUDGET)
    forward = engine.forward(
        batch().index(rows), max_tokens_per_micro_batch=BUDGET, with_entropy=with_entropy
    )
    return {
        "rows": rows,
        "metrics": metrics,
        "forward": forward.tensors,
        "grads": grads,
        "mesh": tuple(engine.mesh.fsdp.shape),
        "dp": (engine.dp_rank, engine.dp_size, engine.sp_rank, engine.sp_size),
        "load": engine.load_report,
    }


def parallel_worker(rank: int, world: int, init_file: str, model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist

    from rayrl.train.engine import TrainEngine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    out: dict = {}
    try:
        for name, kwargs in LAYOUTS.items():
            engine = TrainEngine(model_dir, optim=OPTIM, **kwargs)
            if name == "flat":
                out["refs"] = reference_copies(engine, model_dir)
            out[name] = run_layout(engine, pg_loss, with_entropy=True)
            if name == "hsdp":
                out["hsdp_weights"] = engine.full_state_dict(cpu_offload=True)
                out["hsdp_streamed"] = [
                    (k, v.clone()) for k, v in engine.rollout_weights(torch.bfloat16, 1 << 12)
                ]
                engine.save(Path(out_dir) / "hsdp_ckpt")
            if name == "sp2":
                out["mixed_rows_error"] = mixed_rows_error(engine)
        critic = TrainEngine(
            model_dir, value_head=True, optim=OPTIM, ulysses_sequence_parallel_size=2
        )
        out["critic_sp2"] = run_layout(critic, value_loss, with_entropy=False)
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def reference_copies(actor, model_dir: str) -> dict:
    """Frozen engines filled from ``actor``'s load: alike (shard to shard) and laid out
    otherwise (HSDP, bf16: gathered per tensor); their weights and load reports."""
    from rayrl.train.engine import TrainEngine

    out = {}
    for name, kwargs in (("alike", {}), ("other", {"fsdp_size": 2, "dtype": "bfloat16"})):
        ref = TrainEngine(model_dir, trainable=False, weights_from=actor, **kwargs)
        out[name] = {"weights": ref.full_state_dict(cpu_offload=True), "load": ref.load_report}
    return out


def mixed_rows_error(engine) -> str:
    """What a forward says when the two ranks of an SP group get different rows."""
    import torch.distributed as dist

    try:
        engine.forward(batch().index([dist.get_rank()]), micro_batch_size=1)
    except ValueError as err:
        return str(err)
    return ""


# ------------------------------------------------------------------- load once
def write_random_checkpoint(path: Path, params: float) -> int:
    """A Qwen2-shaped model directory of about ``params`` parameters (hidden 2048, as many
    layers as it takes) with constant bf16 weights (a value per tensor: what is measured
    is memory, and drawing random numbers would take minutes on two cores), written into
    shards of about 512 MB as they are made; returns the parameter count."""
    import json

    from transformers import Qwen2Config

    from rayrl.train.loading import build_empty_model

    per_layer, embeddings = 46_399_488, 2 * 32000 * 2048
    config = Qwen2Config(
        hidden_size=2048,
        intermediate_size=5504,
        num_hidden_layers=max(1, round((params - embeddings) / per_layer)),
        num_attention_heads=16,
        num_key_value_heads=8,
        vocab_size=32000,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    model = build_empty_model(str(path), False, "bfloat16", "sdpa")
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    count = 0
    for i, (name, p) in enumerate(model.named_parameters()):  # never the whole model at once
        shard[name] = torch.full(p.shape, 0.01 * (i % 7 + 1), dtype=torch.bfloat16)
        count += p.numel()
        if sum(t.numel() * 2 for t in shard.values()) >= 2**29:
            _write_shard(path, shard, weight_map)
    _write_shard(path, shard, weight_map)
    index = {"metadata": {"total_size": 2 * count}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return count


def _write_shard(path: Path, shard: dict, weight_map: dict) -> None:
    from safetensors.torch import save_file

    if shard:
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard.clear()


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


def load_once_worker(rank: int, world: int, init_file: str, model_dir: str, out_dir: str) -> None:
    """Build the engine (fp32 master weights, sharded over ``world`` gloo ranks) and
    record this process's resident memory before and its peak during the build."""
    import torch.distributed as dist

    from rayrl.train.engine import TrainEngine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        reset = True
        try:  # the peak from here on, not since the process started
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            reset = False
        before = _status("VmRSS:")
        engine = TrainEngine(model_dir, dtype="float32")
        peak = _status("VmHWM:")
        local = sum(p.to_local().numel() * 4 for p in engine.model.parameters())
        result = {
            "before": before,
            "peak": peak,
            "reset": reset,
            "local_bytes": local,
            "report": engine.load_report,
        }
        torch.save(result, Path(out_dir) / f"load{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
