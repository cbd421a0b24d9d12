"""The async sample queue without Ray: admission, bounded staleness, drops and re-queues
counted, the per-epoch ledger, calls no longer current, and state restores (step replay,
resume)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rayrl.algos.routing import ROUTES, unrouted
from rayrl.batch import Batch
from rayrl.trainer.async_ledger import LedgerError
from rayrl.trainer.async_queue import FINISHED, HELD, QUEUED, RUNNING, SampleQueue, concat_samples

N = 2  # samples per prompt
WIDTH, R = 3, 4


def prompts(uids: list[str], width: int = WIDTH) -> Batch:
    rows = len(uids)
    mask = torch.ones(rows, width, dtype=torch.long)
    return Batch(
        {"input_ids": torch.arange(rows * width).view(rows, width), "attention_mask": mask},
        {"uid": np.array(uids, dtype=object)},
    )


def samples_for(item, version: int) -> tuple[Batch, torch.Tensor]:
    """What a replica returns for `item`: n rows per prompt, every token of `version`."""
    rows = len(item.seqs) * N
    width = item.prompts["input_ids"].shape[1]
    uids = np.repeat(item.prompts["uid"], N)
    batch = Batch(
        {
            "prompts": torch.zeros(rows, width, dtype=torch.long),
            "responses": torch.ones(rows, R, dtype=torch.long),
            "response_mask": torch.ones(rows, R, dtype=torch.long),
            "input_ids": torch.zeros(rows, width + R, dtype=torch.long),
            "attention_mask": torch.ones(rows, width + R, dtype=torch.long),
            "position_ids": torch.zeros(rows, width + R, dtype=torch.long),
        },
        {"uid": uids.astype(object)},
    )
    return batch, torch.full((rows, R), version, dtype=torch.int64)


def generate(queue: SampleQueue, version: int, per_call: int = 8) -> int:
    """Run every call admission allows under `version` to completion; prompts done."""
    done = 0
    while (item := queue.next_work(version, per_call)) is not None:
        done += queue.complete(item, *samples_for(item, version))
    return done


def test_staleness_zero_generates_one_batch_per_version_in_feed_order():
    queue = SampleQueue(batch_size=2, n=N, max_lag=0, window=1.0)
    queue.feed(prompts(["a", "b"]), epoch=0, step=0)
    queue.feed(prompts(["c", "d"]), epoch=0, step=1)
    assert generate(queue, version=0) == 2  # admission: one batch ahead of training
    assert queue.counts() == {FINISHED: 2, QUEUED: 2}
    taken = queue.take(0)
    assert [p.uid for p in taken] == ["a", "b"] and all(p.state == HELD for p in taken)
    queue.trained(0, taken)
    assert generate(queue, version=0) == 0  # policy 1 not offered yet: nothing starts
    assert generate(queue, version=1) == 2
    queue.trained(1, queue.take(1))
    assert queue.ledger.count(0) == 4 and sum(queue.ledger.requeued.values()) == 0


def test_too_stale_samples_are_dropped_requeued_counted_and_trained_once():
    queue = SampleQueue(batch_size=2, n=N, max_lag=1, window=2.0)
    queue.feed(prompts(["a", "b"]), epoch=0, step=0)
    queue.feed(prompts(["c", "d"]), epoch=0, step=1)
    queue.feed(prompts(["e", "f"]), epoch=0, step=2)
    assert generate(queue, version=0) == 4  # two batches ahead under staleness 1
    queue.trained(0, queue.take(0))
    queue.prune()  # the next step starts
    # step 1 would take c, d (lag 1: allowed); pretend training ran ahead instead
    queue.steps_done = 2
    assert queue.take(2) is None  # c, d are version 0 at step 2: lag 2 > 1, dropped
    assert queue.dropped == 2 and queue.ledger.requeued["stale"] == 2
    assert queue.counts() == {QUEUED: 4}
    generate(queue, version=2)
    taken = queue.take(2)
    assert sorted(p.uid for p in taken) == ["c", "d"] and {p.version for p in taken} == {2}
    queue.trained(2, taken)
    with pytest.raises(LedgerError, match="c of epoch 0"):
        queue.trained(3, taken)


def test_a_partial_rollouts_staleness_is_its_oldest_tokens():
    """A prompt whose samples were generated across a weight update carries token
    versions like [0, 0, 2, 2]: its staleness is its oldest token's (0), so at step 2
    with max_lag 1 it is too stale, whatever its newer tokens say. Padding and appended
    (unsampled) positions do not count."""
    queue = SampleQueue(batch_size=1, n=N, max_lag=1, window=3.0)
    queue.feed(prompts(["a"]), epoch=0, step=0)
    item = queue.next_work(0, 8)
    batch, versions = samples_for(item, 2)
    versions[:, :2] = 0  # the first two tokens came from policy 0, the rest from 2
    batch["response_mask"][:, :2] = torch.tensor([[1, 1], [1, 1]])
    queue.complete(item, batch, versions)
    queue.steps_done = 2
    assert queue.take(2) is None and queue.dropped == 1  # lag 2 - 0 > 1
    item = queue.next_work(2, 8)
    batch, versions = samples_for(item, 2)
    versions[:, -1] = 0  # a padded (unsampled) tail position: not a token of policy 0
    batch["response_mask"][:, -1] = 0
    queue.complete(item, batch, versions)
    taken = queue.take(2)
    assert [p.uid for p in taken] == ["a"] and taken[0].version == 2


def test_results_of_lost_or_aborted_calls_requeue_and_old_results_are_ignored():
    queue = SampleQueue(batch_size=2, n=N, max_lag=1, window=2.0)
    queue.feed(prompts(["a", "b"]), epoch=0, step=0)
    lost = queue.next_work(0, 8)
    assert queue.lose(lost) == 2 and queue.ledger.requeued["replica_lost"] == 2
    assert queue.complete(lost, *samples_for(lost, 0)) == 0  # a result too late: ignored
    aborted = queue.next_work(0, 8)
    assert queue.complete(aborted, None, None) == 0 and queue.ledger.requeued["aborted"] == 2
    assert generate(queue, 0) == 2
    queue.trained(0, queue.take(0))
    assert queue.ledger.count(0) == 2


def test_a_uid_is_taken_once_per_batch_and_epochs_are_kept_apart():
    queue = SampleQueue(batch_size=2, n=N, max_lag=1, window=2.0)
    queue.feed(prompts(["a", "b"]), epoch=0, step=0)
    queue.feed(prompts(["a", "b"]), epoch=1, step=1)
    generate(queue, 0)
    first = queue.take(0)
    assert [(p.uid, p.epoch) for p in first] == [("a", 0), ("b", 0)]
    queue.trained(0, first)
    queue.trained(1, queue.take(1))
    assert queue.ledger.count(0) == 2 and queue.ledger.count(1) == 2


def test_a_replayed_step_takes_the_same_prompts_and_a_resume_queues_the_pending_again():
    queue = SampleQueue(batch_size=2, n=N, max_lag=1, window=2.0)
    queue.feed(prompts(["a", "b"]), epoch=0, step=0)
    queue.feed(prompts(["c", "d"]), epoch=0, step=1)
    generate(queue, 0)
    before = queue.state_dict()  # the step's start, as step replay captures it
    taken = queue.take(0)
    queue.feed(prompts(["e", "f"]), epoch=0, step=2)  # fed during the failed attempt
    queue.trained(0, taken)
    queue.load_state_dict(before)  # the attempt failed after training: replayed
    assert queue.ledger.count(0) == 0 and queue.fed_through == 1
    again = queue.take(0)
    assert [p.seq for p in again] == [p.seq for p in taken] and again[0].samples is taken[0].samples
    queue.trained(0, again)
    queue.prune()
    # a new process resuming from the checkpoint after step 0: c, d queued again
    fresh = SampleQueue(batch_size=2, n=N, max_lag=1, window=2.0)
    fresh.load_state_dict(queue.state_dict())
    assert fresh.counts() == {QUEUED: 2} and fresh.steps_done == 1 and fresh.ledger.count(0) == 2
    assert sum(fresh.ledger.requeued.values()) == 0
    generate(fresh, 1)
    fresh.trained(1, fresh.take(1))
    assert fresh.ledger.count(0) == 4


def test_samples_of_a_policy_newer_than_a_restored_one_are_generated_again():
    queue = SampleQueue(batch_size=2, n=N, max_lag=1, window=2.0)
    queue.feed(prompts(["a", "b"]), epoch=0, step=0)
    queue.feed(prompts(["c", "d"]), epoch=0, step=1)
    generate(queue, 0)
    queue.trained(0, queue.take(0))
    state = queue.state_dict()
    queue.reset_running()
    generate(queue, 0)  # nothing left to start
    queue.steps_done = 1
    # c, d regenerated under policy 5, then the run goes back to the step-1 boundary
    for p in queue.prompts.values():
        if p.state == FINISHED:
            p.version = 5
    queue.load_state_dict(state)
    assert queue.counts()[QUEUED] == 2 and queue.ledger.requeued["restored"] == 2
    assert RUNNING not in queue.counts()


def test_samples_of_several_prompt_widths_are_left_padded_into_one_batch():
    def one_call(uid: str, width: int) -> Batch:
        queue = SampleQueue(batch_size=1, n=N, max_lag=0, window=1.0)
        queue.feed(prompts([uid], width=width), epoch=0, step=0)
        return samples_for(queue.next_work(0, 8), 0)[0]

    a, b = one_call("a", 2), one_call("b", 4)
    for call in (a, b):  # a mixture of experts' routing record, aligned with input_ids
        call[ROUTES] = torch.full((*call["input_ids"].shape, 3, 2), 5, dtype=torch.uint8)
    both = concat_samples([a, b], pad_id=9)
    assert both["prompts"].shape == (4, 4) and both["input_ids"].shape == (4, 4 + R)
    assert both["prompts"][0].tolist() == [9, 9, 0, 0]
    assert both["attention_mask"][0, :2].tolist() == [0, 0]
    assert both[ROUTES].shape == (4, 4 + R, 3, 2)
    assert bool((both[ROUTES][:2, :2] == unrouted(torch.uint8)).all())
    assert bool((both[ROUTES][:2, 2:] == 5).all()) and bool((both[ROUTES][2:] == 5).all())
