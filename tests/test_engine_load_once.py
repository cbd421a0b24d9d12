"""Loading once: a 4-rank CPU start of a Qwen2-shaped model (fp32 master weights) adds
less than 1.5x one copy of host memory in all, measured per process (``VmHWM``), and
reads the checkpoint once.

The model size is ``RAYRL_TEST_LOAD_PARAMS``: 5e8 parameters by default, which runs in a
few minutes on a shared 2-core machine (1e9 works: docs/benchmarks.md has both); the
measured figures are printed (``pytest -s``).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from parallel_cases import load_once_worker, write_random_checkpoint

pytestmark = pytest.mark.slow

WORLD = 4
PARAMS = float(os.environ.get("RAYRL_TEST_LOAD_PARAMS", "5e8"))


@pytest.mark.timeout(900)  # four processes importing torch on a loaded 2-core machine
def test_four_ranks_hold_one_copy_and_read_it_once(tmp_path):
    model = tmp_path / "model"
    params = write_random_checkpoint(model, PARAMS)
    one_copy = 4 * params  # fp32 master weights
    checkpoint = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    mp.spawn(
        load_once_worker,
        args=(WORLD, str(tmp_path / "init"), str(model), str(tmp_path)),
        nprocs=WORLD,
    )
    ranks = [torch.load(tmp_path / f"load{r}.pt", weights_only=False) for r in range(WORLD)]
    added = sum(r["peak"] - r["before"] for r in ranks)
    report = ranks[0]["report"]
    print(
        f"\nload once, {WORLD} gloo ranks, {params / 1e9:.3f} B parameters: one fp32 copy "
        f"{one_copy / 2**30:.2f} GiB; host memory the start added, summed over the ranks "
        f"(peak VmHWM - VmRSS before): {added / 2**30:.2f} GiB = {added / one_copy:.2f} copies; "
        f"load/host_peak_gb_per_node {report.host_peak_gb_per_node:.2f} (whole processes); "
        f"load/bytes_read {report.bytes_read / 2**30:.2f} GiB of a {checkpoint / 2**30:.2f} GiB "
        f"checkpoint; {report.seconds:.1f} s"
    )
    assert all(r["reset"] for r in ranks) or added > 0
    assert sum(r["local_bytes"] for r in ranks) == one_copy  # the shards make one copy
    assert added < 1.5 * one_copy
    assert report.source == "checkpoint"
    assert 0.99 * checkpoint < report.bytes_read <= checkpoint
