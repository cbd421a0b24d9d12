"""Expert-parallel weights to the rollout engine in buckets (`rayrl.train.expert_sync`,
`rayrl.train.weight_sync.rollout_weights`) on real gloo processes: the same tensors, bit
for bit and in the same order, as each weight made whole alone; one all-gather per
bucket and mesh, none per expert weight; no gather larger than about a bucket; and a
tensor-parallel rollout's parts (`tp_rollout_weights`) as cut from the whole tensors."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp


@pytest.fixture(scope="module")
def moe6_dir(tmp_path_factory):
    from ep_sync_cases import build_moe

    return build_moe(tmp_path_factory.mktemp("sync") / "m")


def _results(world: int, tmp_path, model_dir) -> list[dict]:
    from ep_sync_cases import sync_worker

    init = str(tmp_path / "init")
    mp.spawn(sync_worker, args=(world, init, str(model_dir), str(tmp_path)), nprocs=world)
    return [torch.load(tmp_path / f"sync{r}.pt", weights_only=False) for r in range(world)]


def _check_stream(layout: dict, bucket: int) -> None:
    for key in ("small", "whole"):
        got = layout[key]
        assert got["names"] == layout["order"], key  # every weight once, in model order
        for name, want in layout["reference"].items():
            assert torch.equal(got["tensors"][name], want), (key, name)
        # no weight made whole alone: the experts go in the buckets
        assert got["full_tensors"] == 0, key
    # the whole model in one bucket: one all-gather for the experts, one for the rest
    experts = bool(layout["whole"]["expert_names"])
    assert len(layout["whole"]["gathers"]) == (2 if experts else 1)
    # small buckets: no gather holds much more than a bucket (or the one tensor larger)
    largest = max(t.numel() * 4 for t in layout["reference"].values())
    assert max(layout["small"]["gathers"]) <= 2 * max(bucket, largest)
    assert len(layout["small"]["gathers"]) < len(layout["order"])


@pytest.mark.slow  # two layouts and a TP stream on 2 gloo ranks: ~25 s on two cores
def test_two_ranks_stream_same_tensors_in_buckets(tmp_path, moe6_dir):
    from ep_sync_cases import SMALL_BUCKET

    results = _results(2, tmp_path, moe6_dir)
    for rank, result in enumerate(results):
        assert result["ep2"]["small"]["expert_names"], "the EP layout has expert shards"
        assert not result["ep1"]["small"]["expert_names"], "ep=1: experts are FSDP shards"
        for name in ("ep1", "ep2"):
            _check_stream(result[name], SMALL_BUCKET)
        tp = result["ep2"]["tp"]
        assert set(tp["parts"]) == set(tp["want"])
        for name, want in tp["want"].items():
            assert torch.equal(tp["parts"][name], want), (rank, name)
        assert tp["full_tensors"] == 0


@pytest.mark.slow  # 4 gloo ranks, experts split 2 x 2 with padded chunks: ~30 s
def test_four_ranks_ep_and_edp_stream_same_tensors(tmp_path, moe6_dir):
    from ep_sync_cases import SMALL_BUCKET

    for result in _results(4, tmp_path, moe6_dir):
        _check_stream(result["ep2_dp2"], SMALL_BUCKET)
