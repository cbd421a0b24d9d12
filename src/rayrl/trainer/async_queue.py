"""The sample queue of asynchronous training: prompts fed, generated, finished, trained.

Under `rollout.mode=async` the trainer feeds the prompts of each batch ahead of time
(`feed`); the rollout manager hands them to idle replicas (`next_work`), a call's
samples come back tagged with the policy version of each token (`complete`), and the
trainer takes a batch of finished prompts for each step (`take`). Every prompt has a
sequence number (its feed order) and moves through four states:

    queued --next_work--> running --complete--> finished --take--> held --trained--> trained
       ^                     |                      |                |
       +---- replica lost, --+                      |                |
       +---- call aborted ---+                      |                |
       +---- too stale at take ---------------------+                |
       +---- put back by a restore (step replay, rewind) ------------+

(`trained` prompts stay until the next step starts, `prune`: a replay of their step
takes them again, as they were.)

Rules:

- **Bounded staleness.** A prompt whose oldest token came from policy version v trains
  at step s only if s - v <= `max_lag`; an older one is dropped at `take` and queued
  again (counted). Admission keeps generation from running ahead: with policy v
  offered, the prompts running, finished or held may not exceed
  (v + `window`) x batch size minus the prompts trained, so most samples arrive fresh.
- **Order.** `take` hands out the finished prompts with the lowest sequence numbers, a
  prompt uid at most once per batch (GRPO groups by uid). With staleness 0 and no
  partial rollouts this is exactly the synchronous run's batch, in its order.
- **Exactly once.** `trained` records each (epoch, uid) in the `Ledger` (a second time
  is a `LedgerError`); a result that comes back for a call no longer current (its
  prompts were re-queued, or fed after a restored state) is ignored.

`state_dict` keeps what a checkpoint needs (the prompts fed and not yet trained, the
feed position, the steps done, the ledger); `load_state_dict` reconciles the live
queue with it: for step replay that keeps what is still valid (finished samples of the
restored policy or older, the batch held for the step being replayed), for a resume
it queues every pending prompt again.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rayrl.algos.routing import ROUTES, unrouted
from rayrl.batch import Batch
from rayrl.trainer.async_ledger import Ledger

QUEUED, RUNNING, FINISHED, HELD, TRAINED = "queued", "running", "finished", "held", "trained"
# prompt-side columns of a sample batch: [rows, P] or [rows, P + R], left-padded
PROMPT_SIDE = ("prompts", "input_ids", "attention_mask", "position_ids")


@dataclass
class Prompt:
    """One fed prompt and where it stands (module docstring)."""

    seq: int
    uid: str
    epoch: int
    step: int  # the step it was fed for: its samples are seeded by it
    row: Batch  # the prompt row, padded as its fed batch
    state: str = QUEUED
    ticket: int = 0  # the call generating it (RUNNING)
    samples: Batch | None = None  # rollout.n rows (FINISHED, HELD)
    versions: torch.Tensor | None = None  # [n, R] policy version of each token
    version: int = -1  # the oldest of them
    held_for: int | None = None  # the step it was taken for (HELD)


@dataclass(frozen=True)
class WorkItem:
    """Prompts for one replica call: all fed for one step (one sampling seed step)."""

    ticket: int
    step: int
    prompts: Batch
    seqs: tuple[int, ...]


class SampleQueue:
    """Prompts between feeding and training (module docstring).

    Args:
        batch_size: prompts per training step (`data.train_batch_size`).
        n: samples per prompt (`rollout.n`).
        max_lag: the largest s - v a prompt may train with.
        window: policy versions of generation allowed ahead of training (admission).
    """

    def __init__(self, batch_size: int, n: int, max_lag: int, window: float) -> None:
        self.batch_size, self.n, self.max_lag, self.window = batch_size, n, max_lag, window
        self.cond = threading.Condition(threading.RLock())
        self.prompts: dict[int, Prompt] = {}
        self.next_seq = 0
        self.next_ticket = 1
        self.fed_through = -1  # the last step whose batch was fed
        self.steps_done = 0  # training steps completed (prompts trained: x batch_size)
        self.ledger = Ledger()
        self.dropped = 0  # stale prompts dropped at take (also in ledger.requeued)

    # ---------------------------------------------------------------- feeding
    def feed(self, batch: Batch, epoch: int, step: int) -> None:
        """Queue the prompts of `step`'s batch (of `epoch`), in their order."""
        with self.cond:
            for i in range(len(batch)):
                row = batch.index([i])
                uid = str(row["uid"][0])
                self.prompts[self.next_seq] = Prompt(self.next_seq, uid, epoch, step, row)
                self.next_seq += 1
            self.fed_through = max(self.fed_through, step)
            self.cond.notify_all()

    # ------------------------------------------------------------- generation
    def room(self, version: int) -> int:
        """Prompts that may start generating under policy `version` (admission)."""
        with self.cond:
            busy = sum(p.state in (RUNNING, FINISHED, HELD) for p in self.prompts.values())
            limit = math.floor((version + self.window) * self.batch_size + 1e-9)
            return limit - self.steps_done * self.batch_size - busy

    def next_work(self, version: int, max_prompts: int) -> WorkItem | None:
        """The next queued prompts (lowest sequence numbers, one fed step) that
        admission lets start under `version`, at most `max_prompts`; None: none."""
        with self.cond:
            room = min(self.room(version), max_prompts)
            queued = sorted(s for s, p in self.prompts.items() if p.state == QUEUED)
            if room <= 0 or not queued:
                return None
            step = self.prompts[queued[0]].step
            seqs = [s for s in queued if self.prompts[s].step == step][:room]
            ticket, self.next_ticket = self.next_ticket, self.next_ticket + 1
            for s in seqs:
                self.prompts[s].state, self.prompts[s].ticket = RUNNING, ticket
            rows = Batch.concat([self.prompts[s].row for s in seqs])
            return WorkItem(ticket, step, rows, tuple(seqs))

    def complete(self, item: WorkItem, samples: Batch | None, versions: torch.Tensor | None) -> int:
        """A call's result: `samples` (n adjacent rows per prompt, in `item`'s order) and
        their token `versions`; None: the call aborted (its prompts are queued again).
        Returns how many of its prompts it finished (0 for a call no longer current)."""
        with self.cond:
            live = [s for s in item.seqs if self._running(s, item.ticket)]
            if samples is None:
                self._requeue(live, "aborted")
                return 0
            assert versions is not None  # they come with the samples (`ReplicaResult`)
            n = self.n
            for i, seq in enumerate(item.seqs):
                if seq not in live:
                    continue
                p = self.prompts[seq]
                p.samples = samples.index(list(range(i * n, (i + 1) * n)))
                p.versions = versions[i * n : (i + 1) * n]
                p.version = oldest_version(p.versions, p.samples["response_mask"])
                p.state = FINISHED
            self.cond.notify_all()
            return len(live)

    def lose(self, item: WorkItem) -> int:
        """The replica running `item` was lost: its prompts are queued again."""
        with self.cond:
            live = [s for s in item.seqs if self._running(s, item.ticket)]
            self._requeue(live, "replica_lost")
            return len(live)

    def reset_running(self, reason: str = "restored") -> int:
        """Every running prompt queued again (their calls' results will be ignored)."""
        with self.cond:
            running = [s for s, p in self.prompts.items() if p.state == RUNNING]
            self._requeue(running, reason)
            return len(running)

    def prune(self) -> None:
        """Forget the prompts trained by the last step (its replay can no longer come)."""
        with self.cond:
            for seq in [s for s, p in self.prompts.items() if p.state == TRAINED]:
                del self.prompts[seq]

    def _running(self, seq: int, ticket: int) -> bool:
        p = self.prompts.get(seq)
        return p is not None and p.state == RUNNING and p.ticket == ticket

    def _requeue(self, seqs: list[int], reason: str) -> None:
        for s in seqs:
            p = self.prompts[s]
            p.state, p.ticket, p.samples, p.versions, p.version = QUEUED, 0, None, None, -1
            p.held_for = None
        if seqs:
            self.ledger.requeue(reason, len(seqs))
            self.cond.notify_all()

    # --------------------------------------------------------------- training
    def take(self, step: int) -> list[Prompt] | None:
        """`batch_size` finished prompts for `step` (module docstring), now held for it;
        the prompts already held for `step` (a replayed step) first. Too stale ones are
        dropped and queued again. None: not enough finished yet."""
        with self.cond:
            held = sorted(
                (p for p in self.prompts.values() if p.state == HELD and p.held_for == step),
                key=lambda p: p.seq,
            )
            if held:
                return held
            finished = [(s, p) for s, p in self.prompts.items() if p.state == FINISHED]
            stale = [s for s, p in finished if step - p.version > self.max_lag]
            self.dropped += len(stale)
            self._requeue(stale, "stale")
            # samples of a policy newer than the step's: left from before a restore
            self._requeue([s for s, p in finished if p.version > step], "restored")
            chosen: list[Prompt] = []
            uids: set[str] = set()
            for seq in sorted(s for s, p in self.prompts.items() if p.state == FINISHED):
                p = self.prompts[seq]
                if p.uid in uids:
                    continue
                chosen.append(p)
                uids.add(p.uid)
                if len(chosen) == self.batch_size:
                    break
            if len(chosen) < self.batch_size:
                return None
            for p in chosen:
                p.state, p.held_for = HELD, step
            return chosen

    def wait_take(self, step: int, check: Callable[[], None], poll_s: float = 0.05) -> list[Prompt]:
        """`take(step)`, waiting until it succeeds; `check()` runs between tries, outside
        the queue's lock (it raises to stop the wait: no replica left, a stop asked)."""
        while True:
            with self.cond:
                taken = self.take(step)
                if taken is None:
                    self.cond.wait(poll_s)
            if taken is not None:
                return taken
            check()

    def trained(self, step: int, prompts: list[Prompt]) -> None:
        """`prompts` trained at `step`: recorded in the ledger; they leave the queue at
        the next `prune`."""
        with self.cond:
            for p in prompts:
                self.ledger.record(p.epoch, p.uid, step)
                p.state = TRAINED
            self.steps_done = step + 1
            self.cond.notify_all()

    def counts(self) -> Counter[str]:
        """Prompts by state."""
        with self.cond:
            return Counter(p.state for p in self.prompts.values())

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The prompts fed and not trained (their rows, compactly, by fed step), the
        feed position, the steps done, the counters and the ledger."""
        with self.cond:
            by_step: dict[int, list[Prompt]] = {}
            for seq in sorted(self.prompts):
                p = self.prompts[seq]
                if p.state != TRAINED:
                    by_step.setdefault(p.step, []).append(p)
            pending = [
                {
                    "step": step,
                    "seqs": [p.seq for p in items],
                    "epochs": [p.epoch for p in items],
                    "rows": Batch.concat([p.row for p in items]),
                }
                for step, items in sorted(by_step.items())
            ]
            return {
                "pending": pending,
                "next_seq": self.next_seq,
                "fed_through": self.fed_through,
                "steps_done": self.steps_done,
                "dropped": self.dropped,
                "ledger": self.ledger.state_dict(),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Reconcile the live queue with `state` (module docstring)."""
        with self.cond:
            steps_done = int(state["steps_done"])
            kept: dict[int, Prompt] = {}
            for group in state["pending"]:
                rows: Batch = group["rows"]
                for i, (seq, epoch) in enumerate(zip(group["seqs"], group["epochs"], strict=True)):
                    row = rows.index([i])
                    uid = str(row["uid"][0])
                    live = self.prompts.get(seq)
                    if live is not None and (live.uid, live.epoch) == (uid, epoch):
                        kept[seq] = live
                    else:
                        kept[seq] = Prompt(seq, uid, int(epoch), int(group["step"]), row)
            self.prompts = kept
            self.ledger.load_state_dict(state["ledger"])
            for p in kept.values():  # trained by a step that is being replayed: held again
                if p.state == TRAINED:
                    p.state = HELD
            stale = [
                s
                for s, p in kept.items()
                if (p.state == HELD and p.held_for != steps_done)
                or (p.state == FINISHED and p.version > steps_done)
            ]
            self._requeue(stale, "restored")
            self.next_seq = int(state["next_seq"])
            self.fed_through = int(state["fed_through"])
            self.steps_done = steps_done
            self.dropped = max(self.dropped, int(state.get("dropped", 0)))  # counts go on
            self.cond.notify_all()


def oldest_version(versions: torch.Tensor, mask: torch.Tensor) -> int:
    """The policy version of the oldest sampled token (``mask`` 1: padding and appended
    tool tokens do not count); with no sampled token, the newest version there."""
    sampled = versions[mask.bool()]
    return int(sampled.min()) if sampled.numel() else int(versions.max())


def concat_samples(groups: list[Batch], pad_id: int) -> Batch:
    """Sample batches of several replica calls as one: prompt-side columns left-padded
    to the widest (`PROMPT_SIDE`, pad id / 0 / 0, and a routing record with its
    no-routing mark), then stacked; batches of one width are stacked as they are."""
    widths = {g["prompts"].shape[1] for g in groups}
    if len(widths) > 1:
        width = max(widths)
        groups = [_left_pad(g, width, pad_id) for g in groups]
    return Batch.concat(groups)


def _left_pad(batch: Batch, width: int, pad_id: int) -> Batch:
    extra = width - batch["prompts"].shape[1]
    if extra == 0:
        return batch
    tensors = dict(batch.tensors)
    for key in [k for k in (*PROMPT_SIDE, ROUTES) if k in tensors]:
        value = tensors[key]
        fill = pad_id if key in ("prompts", "input_ids") else 0
        fill = unrouted(value.dtype) if key == ROUTES else fill  # expert 0 is a routing
        pad = torch.full((value.shape[0], extra, *value.shape[2:]), fill, dtype=value.dtype)
        tensors[key] = torch.cat([pad, value], dim=1)
    return Batch(tensors, dict(batch.non_tensors), dict(batch.meta))
