"""`data.loader=ray`: Ray Data reads, tokenises and orders the prompts; the order is
deterministic for a seed, differs by epoch, and resumes at a data position."""

from __future__ import annotations

import pytest

from rayrl.data import synthetic_rows, write_parquet
from rayrl.data.ray_loader import RayPromptLoader


@pytest.fixture(scope="module")
def tokenizer():
    from rayrl.models.tokenizer import train_tokenizer

    return train_tokenizer()


def _uids(loader, epoch, start=0, seed=7):
    return [list(b["uid"]) for b in loader.batches(4, epoch=epoch, seed=seed, start=start)]


@pytest.mark.slow
def test_ray_loader_is_deterministic_and_resumes(ray_local, tmp_path, tokenizer):
    rows = synthetic_rows("arithmetic", 22, seed=1)
    long = [{"role": "user", "content": "seven " * 200}]
    rows[5] = {**rows[5], "prompt": long}  # over max_prompt_length: set aside
    files = [
        str(write_parquet(rows[:11], tmp_path / "a.parquet")),
        str(write_parquet(rows[11:], tmp_path / "b.parquet")),
    ]
    loader = RayPromptLoader(files=files, tokenizer=tokenizer, max_prompt_length=64, num_blocks=2)
    assert len(loader) == 21 and loader.rejected == 1
    epoch0 = _uids(loader, 0)
    assert len(epoch0) == 5 and all(len(b) == 4 for b in epoch0)  # 21 rows: 5 whole batches
    assert _uids(loader, 0, start=3) == epoch0[3:]  # the same order again, resumed at batch 3
    assert _uids(loader, 1) != epoch0  # each epoch its own order
    batch = next(loader.batches(4, epoch=0, seed=7))
    assert {"input_ids", "attention_mask", "position_ids"} <= set(batch.tensors)
    assert {"data_source", "ground_truth", "raw_prompt", "extra_info"} <= set(batch.non_tensors)


def test_a_cluster_whose_pools_hold_every_cpu_is_refused_not_hung(ray_multinode):
    """Ray Data's ordering tasks need a CPU outside placement groups; when the pools
    hold them all the loader says so in seconds instead of waiting forever."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from rayrl.data import DataError
    from rayrl.data.ray_loader import require_free_cpu

    ray_multinode([{"num_cpus": 2}])
    require_free_cpu(wait_s=0)
    group = placement_group([{"CPU": 2}])
    ray.get(group.ready(), timeout=60)
    try:
        with pytest.raises(DataError, match="hold all 2 CPUs of the cluster"):
            require_free_cpu(wait_s=1)
    finally:
        remove_placement_group(group)
