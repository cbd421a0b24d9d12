"""Pieces the role workers share: engine arguments from the config, metric collection,
and the per-rank mini-batch size."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from rayrl.config.schema import ModelConfig


def engine_kwargs(model: ModelConfig, mixed_precision: bool, seed: int) -> dict[str, Any]:
    """TrainEngine keyword arguments from a model config group."""
    return {
        "dtype": "float32" if model.dtype == "auto" else model.dtype,
        "attn_implementation": model.attn_implementation,
        "gradient_checkpointing": model.enable_gradient_checkpointing,
        "use_remove_padding": model.use_remove_padding,
        "mixed_precision": mixed_precision,
        "seed": seed,
        "tokenizer_path": model.tokenizer_path,
    }


def join_process_group(worker: Any, backend: str) -> None:
    """Join the group's process group before building engines (FSDP needs it), once per
    process: colocated roles share it."""
    import torch.distributed as dist

    if worker.world_size > 1 and not (dist.is_available() and dist.is_initialized()):
        worker.init_distributed(backend)


def mean_metrics(outputs: list, state: Any) -> dict[str, float]:
    """Collect: per-rank metric dicts (or lists of them) averaged key by key."""
    sums: dict[str, list[float]] = defaultdict(list)
    stack = list(outputs)
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for k, v in item.items():
                sums[k].append(float(v))
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return {k: sum(v) / len(v) for k, v in sorted(sums.items())}


def per_rank_mini_batch(mini_batch_samples: int, world_size: int, local_rows: int) -> int:
    """Rows of one rank per optimizer step; the config validation made it exact."""
    if mini_batch_samples % world_size:
        raise ValueError(
            f"a mini-batch of {mini_batch_samples} samples does not split over {world_size} ranks"
        )
    per_rank = mini_batch_samples // world_size
    if local_rows % per_rank:
        raise ValueError(
            f"this rank got {local_rows} rows, not a whole number of mini-batches of "
            f"{per_rank}; the step's batch must be train_batch_size x rollout.n samples"
        )
    return per_rank
