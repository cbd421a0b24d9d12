"""Recovery in proportion to what was lost, at the engine: two real gloo processes play a
replacement (`rebuild_cases.rebuild_worker`). The survivor rebuilds its policy,
reference and critic on the new process group from the shards it holds and reads
nothing; the new rank reads only its reference's shards (its policy and critic wait for
the snapshot restore) and, asked for its critic's weights before a restore, reads only
the critic's own shards; the step replayed from the snapshot lands bitwise where it did.
A rebuild whose sharding changed reloads on every rank, from one read."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from engine_cases import tiny_model_dir  # noqa: F401 (fixture)
from rebuild_cases import rebuild_worker

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tiny_model_dir, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("rebuild")
    (out / "init").mkdir()
    mp.spawn(rebuild_worker, args=(2, str(out / "init"), str(tiny_model_dir), str(out)), nprocs=2)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _checkpoint_bytes(model_dir) -> int:
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))


def test_the_survivor_keeps_its_shards_and_reads_nothing(ranks):
    survivor = ranks[0]
    assert survivor["build_reads"] == 0 and survivor["restore_reads"] == 0
    assert survivor["sources"] == ["kept", "kept", "kept"]
    held, kept = survivor["held"], survivor["kept"]
    assert held["steps"] == kept["steps"] == 2
    assert held["local"].keys() == kept["local"].keys()
    assert all(torch.equal(held["local"][n], kept["local"][n]) for n in held["local"])
    assert held["moments"] and held["moments"].keys() == kept["moments"].keys()
    assert all(torch.equal(held["moments"][k], kept["moments"][k]) for k in held["moments"])
    assert survivor["ref_initial"]


def test_the_new_rank_reads_only_its_reference_shards(ranks, tiny_model_dir):  # noqa: F811
    new = ranks[1]
    assert new["sources"] == ["restore", "own shards", "restore"]
    assert new["actor_read"] == 0 and new["restore_reads"] == 0
    # the reference's own half of a checkpoint that rank 0 read whole at the start
    assert ranks[0]["first_read"] == _checkpoint_bytes(tiny_model_dir) - 8 - _header(tiny_model_dir)
    assert 0 < new["ref_read"] < 0.75 * ranks[0]["first_read"]
    assert new["build_reads"] == new["ref_read"]
    assert new["ref_initial"]  # its shards are those the start's one read handed it
    assert new["critic_lazy"] and 0 < new["critic_lazy_read"] < 0.75 * ranks[0]["first_read"]


def test_the_step_replayed_from_the_snapshot_is_bitwise_the_same(ranks):
    for rank in ranks:
        assert rank["step_b"] == rank["step_b_again"]
        assert torch.equal(rank["ref_forward"], rank["ref_forward_again"])
    first, again = ranks[0]["after_b"], ranks[0]["after_b_again"]
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)


def test_a_changed_layout_reloads_every_rank_from_one_read(ranks, tiny_model_dir):  # noqa: F811
    assert [r["relayout_source"] for r in ranks] == ["checkpoint", "checkpoint"]
    assert ranks[0]["relayout_reads"] == ranks[0]["first_read"]
    assert ranks[1]["relayout_reads"] == 0
    from safetensors.torch import load_file

    saved = load_file(str(tiny_model_dir / "model.safetensors"))
    weights = ranks[0]["relayout_weights"]
    assert all(torch.equal(weights[k], saved[k].float()) for k in saved)


def _header(model_dir) -> int:
    import struct

    with open(model_dir / "model.safetensors", "rb") as f:
        return struct.unpack("<Q", f.read(8))[0]
