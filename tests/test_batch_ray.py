"""Batch through a real Ray: object store round trips and actor arguments/returns."""

from __future__ import annotations

import numpy as np
import pytest
import ray
import torch

from rayrl.batch import Batch


def _sample(kind: str) -> Batch:
    """Batches covering the cases that serialisation treats differently (deterministic)."""
    gen = torch.Generator().manual_seed(0)
    if kind == "empty":
        return Batch.from_dict(
            {"ids": torch.zeros(0, 4, dtype=torch.long), "uid": []}, meta={"step": 0}
        )
    if kind == "non_contiguous":
        base = torch.arange(4000.0).reshape(40, 100)
        tensors = {"t": base.t()[::3][:10], "cols": base[:10, ::7], "half": base.half()[5:25:2]}
        assert not any(t.is_contiguous() for t in tensors.values())
        return Batch(tensors)
    if kind == "strings":
        return Batch.from_dict(
            {"uid": [f"id-{i}" for i in range(50)], "text": ["é", None, "", "\ud800", "x" * 9] * 10}
        )
    if kind == "nested":
        return Batch.from_dict(
            {
                "msgs": [[{"role": "user", "content": f"q{i}"}] for i in range(6)],
                "mixed": [1, "a", None, (1, [2]), {"k": [1, 2]}, np.arange(3)],
                "x": torch.randn(6, 2, generator=gen).bfloat16(),
            },
            meta={"gen": {"temperature": 0.7}, "t": torch.ones(2)},
        )
    if kind == "large":  # over Ray's inline limit, so it lives in the shared-memory store
        return Batch.from_dict(
            {
                "input_ids": torch.randint(0, 1000, (256, 512), generator=gen),
                "mask": torch.ones(256, 512, dtype=torch.bool),
                "log_probs": torch.randn(256, 512, generator=gen),
                "uid": [str(i) for i in range(256)],
            }
        )
    raise ValueError(kind)


KINDS = ["empty", "non_contiguous", "strings", "nested", "large"]


@ray.remote(num_cpus=0)
class Echo:
    """Toy actor: returns what it gets, or changes it in place and returns that."""

    def echo(self, batch: Batch) -> Batch:
        assert isinstance(batch, Batch)
        return batch

    def bump(self, batch: Batch) -> Batch:
        batch = batch.writable()  # received tensors share the object store's memory
        for t in batch.tensors.values():
            t.fill_(7)
        batch["seen"] = [True] * len(batch)
        return batch

    def summary(self, batch: Batch) -> dict:
        return {"len": len(batch), "keys": batch.keys(), "meta": batch.meta}


@pytest.mark.parametrize("kind", KINDS)
def test_put_get_round_trip(ray_local, kind):
    batch = _sample(kind)
    ref = ray.put(batch)
    out = ray.get(ref)
    assert out.equals(batch)
    assert all(t.is_contiguous() for t in out.tensors.values())
    private = out.writable()
    for t in private.tensors.values():
        t.fill_(7)  # a private copy: the stored object is unchanged
    assert ray.get(ref).equals(batch) and out.equals(batch)


def test_tensors_out_of_the_object_store_are_views_not_copies(ray_local):
    batch = _sample("large")
    ref = ray.put(batch)
    first, second = ray.get(ref), ray.get(ref)
    # Both gets read the same shared memory: no copy was made on the way out (one
    # machine: integer columns are not narrowed, so they are shared too).
    for key in ("log_probs", "input_ids"):
        assert first[key].data_ptr() == second[key].data_ptr()
        assert first.writable()[key].data_ptr() != first[key].data_ptr()


def test_actor_argument_and_return(ray_local):
    actor = Echo.remote()
    for kind in KINDS:
        batch = _sample(kind)
        assert ray.get(actor.echo.remote(batch)).equals(batch), kind
        bumped = ray.get(actor.bump.remote(batch))
        assert bumped["seen"].tolist() == [True] * len(batch)
        for key, t in batch.tensors.items():
            assert torch.equal(bumped[key], torch.full_like(t, 7)), (kind, key)
    ref = ray.put(_sample("large"))
    assert ray.get(actor.summary.remote(ref)) == {
        "len": 256,
        "keys": ["input_ids", "mask", "log_probs", "uid"],
        "meta": {},
    }
    chunks = [actor.echo.remote(part) for part in _sample("large").chunk(3)]
    assert Batch.concat(ray.get(chunks)).equals(_sample("large"))
    ray.kill(actor)
