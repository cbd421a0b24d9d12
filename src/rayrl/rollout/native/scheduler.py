"""Continuous batching: which tokens the next step runs, and the bookkeeping after it.

The scheduler lives as long as its engine and serves *requests*: `add` queues a prompt
with the samples that fork from it (each with its length limit, sampler key and
whether it parks at the end of a turn), and returns their sample ids; `abort` drops
samples wherever they are; `release` gives a read sample's id back for reuse. A *job* is
a prefill to run: a prompt's tokens and the samples that fork from it, or a preempted
sample's prompt plus what it had generated (recomputed, then it carries on). Each step
is either

- a **prefill**: partly done jobs first, then waiting jobs admitted in order while the
  token budget (``max_batched_tokens``, chunked prefill), the free sequence slots and
  the free KV blocks allow; or
- a **decode** of every running sample, one token each.

A job that finishes its prefill forks into its samples: the first takes the job's
blocks, the others share its full blocks and get a copy of the last, partly filled one.
Sampled tokens are appended, each tagged with the policy `version` the engine held
when it drew it; a sample ends at a stop token, a stop string or its length limit, and
frees its slot and blocks at once, so a waiting job can join the next step. When a
decode step needs a block and none is free, the most recently admitted sample is
preempted: its blocks are freed and it waits, first in line, to be recomputed. What
happened to samples goes into `events` (a sample done, a turn ended), which the engine
hands to its caller after each step.

A decode step is *launched* (`launch_decode`: positions and counts advance, samples
at their length limit leave the batch) before its tokens are *committed*
(`commit_decode`: tokens written, stops checked); so is a prefill step's first token
of each sample it completes (`launch_prefill`, then `commit_decode`). Between the two,
the engine may plan and launch the next step (`can_overlap`), whose input tokens stay
on the device: a sample that turns out to have stopped ran one step too many, and that
step's token is dropped at its commit (never written, never counted). For the same
reason a released sample id is reused only once no launched step holds it (`recycle`).

Multi-turn episodes (samples added with ``park``): a sample that stops with room left
is *parked* instead of finished: it leaves the running set and gives back its sequence
slot, but keeps its KV blocks, and a turn event is queued. Other samples keep decoding
meanwhile. The caller later either `resume`s it with tokens to append (a tool's
response and the turn separators), which become a prefill job that starts where the
sample's cache ends (so only the new tokens are computed), or ends it
(`finish_parked`). A token of a parked sample that an overlapped step drew a step late
is dropped, as for a finished one. When KV blocks run short, parked samples (and
resumed jobs still waiting) give theirs up first (`_reclaim`); such a sample is then
recomputed from its prompt and everything in its response, like a preempted one.
A prefill step stalls every running sample, so while others decode, resumed samples
are not prefilled one by one as their answers come back: they wait, and are prefilled
together once the decode steps they have lost waiting, summed over them, reach
``resume_cost`` times the running samples (what one more prefill step costs those:
``resume_cost`` is a prefill step's time in decode steps), or after
``resume_max_wait`` decode steps at most (`prefill_due`). With nothing running they
are prefilled at once; ``resume_cost=0`` prefills every answer at the next step.
Responses hold the appended tokens too: ``tokens[s, :gen[s]]`` is the whole
multi-turn continuation, and a sampled token's position is its column there.

With a prefix cache (`prefix_cache`), full blocks are recorded by the tokens they hold
when a prefill completes and when a decoding sample fills one; a new job (a prompt seen
before, a preempted or reclaimed sample recomputed) claims the blocks of its longest
recorded prefix at admission and prefills only the rest.

All per-sample state lives in numpy arrays (grown as requests need) so a decode
step's bookkeeping is a few vectorised operations, whatever the batch size.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np

from rayrl.rollout.native.images import PromptImages
from rayrl.rollout.native.jobs import Chunk, Job
from rayrl.rollout.native.kv_cache import BlockAllocator
from rayrl.rollout.native.parking import Parking
from rayrl.rollout.native.prefix_cache import PrefixCache
from rayrl.rollout.native.sample_table import SampleTable
from rayrl.rollout.requests import DONE

__all__ = ["Chunk", "Job", "Scheduler"]


class Scheduler(SampleTable, Parking):
    """Admission, chunking, forking, preemption and finishing over a block allocator
    (the samples' own state: `SampleTable`; multi-turn parking: `Parking`)."""

    def __init__(
        self,
        *,
        allocator: BlockAllocator,
        block_size: int,
        max_batched_tokens: int,
        table: np.ndarray,
        stop_ids: np.ndarray,
        stop_check: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
        resume_cost: float = 0.0,
        resume_max_wait: int = 16,
        capacity: int = 64,
        width: int = 16,
        prefix: PrefixCache | None = None,
    ) -> None:
        self.alloc, self.block_size = allocator, block_size
        self.prefix = prefix  # full blocks found again by their tokens (None: off)
        self.max_batched_tokens = max_batched_tokens
        self.table = table  # [max_seqs, blocks per row] int32, shared with the runner
        self.watermark = max(1, allocator.num_blocks // 100)
        self.resume_cost, self.resume_max_wait = resume_cost, resume_max_wait
        self.stop_check = stop_check
        self.set_stop_ids(stop_ids)
        self.version = 0  # the policy version tokens drawn now are tagged with
        # called with each sample that ends (not aborted) before its blocks are freed: the
        # engine gathers its routing record then (`routes.RouteStore.on_finish`)
        self.on_finish: Callable[[int], None] | None = None
        super().__init__(capacity, width)
        self.dirty_rows: set[int] = set()
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) blocks to copy first
        self.free_slots = list(range(len(table) - 1, -1, -1))
        self.waiting: deque[Job] = deque()
        self.prefilling: list[Job] = []
        self.running: dict[int, None] = {}  # insertion order = admission order
        self.parked: dict[int, None] = {}  # park order: the last one gives its KV first
        self.events: list[tuple[int, str]] = []  # (sample, DONE | TURN) since the last take
        self.live = 0  # samples added and not finished
        self.parking = 0  # of them, samples that park at the end of a turn
        self.preemptions = self.resumes = self.reclaimed = 0
        self.deferred = 0  # decode steps lost by waiting samples since the last admission
        self.deferred_steps = 0  # decode steps run since then while some sample waited

    # ---------------------------------------------------------------- requests
    def set_stop_ids(self, stop_ids: np.ndarray) -> None:
        """The token ids that end a turn (no request may be live: they apply to all)."""
        self.stop_ids = np.asarray(stop_ids, dtype=np.int64)
        # as a lookup table by token id: a step's stop test is one gather, whatever the
        # number of stop ids (np.isin sorts them at every call)
        size = int(self.stop_ids.max()) + 1 if len(self.stop_ids) else 0
        self._is_stop = np.zeros(size, dtype=bool)
        self._is_stop[self.stop_ids] = True

    def add(
        self,
        prompt: np.ndarray,
        limits: np.ndarray,
        keys: np.ndarray,
        park: bool = False,
        images: PromptImages | None = None,
    ) -> np.ndarray:
        """Queue ``prompt`` with ``len(limits)`` samples forking from it, sample k drawing
        with ``keys[k]`` and at most ``limits[k]`` response tokens; with ``park`` they
        park at the end of each turn; ``images``: a vision-language prompt's (its
        features, M-RoPE positions and cache key). Returns their sample ids."""
        limits = np.asarray(limits, dtype=np.int64).reshape(-1)
        count = len(limits)
        ids = self.take_ids(count, int(limits.max()))
        prompt = np.asarray(prompt, dtype=np.int64)
        for s in ids.tolist():
            self.prompt_of[s] = prompt
            self.images_of[s] = images
            self.blocks[s] = []
        self.rope_delta[ids] = 0 if images is None else images.delta
        self.salt[ids] = 0 if images is None else images.salt
        self.max_new[ids] = limits
        self.keys[ids] = np.asarray(keys, dtype=np.int64).reshape(count)
        for name in ("gen", "kv_len", "n_blocks", "turn_start"):
            getattr(self, name)[ids] = 0
        self.slot[ids] = -1
        self.tokens[ids] = 0
        self.log_probs[ids] = 0.0
        self.versions[ids] = self.version
        for flags in (self.stopped, self.finished, self.paused, self.aborted):
            flags[ids] = False
        self.parks[ids] = park
        self.live += count
        self.parking += count if park else 0
        self.waiting.append(Job(prompt, ids.tolist(), images=images))
        return ids

    def abort(self, samples) -> None:
        """End these samples wherever they are (waiting, prefilling, running, parked);
        they get no event, and their late tokens are dropped. Finished ones stay."""
        for s in [int(s) for s in samples]:
            if self.finished[s]:
                continue
            self.aborted[s] = True
            if s in self.running:
                self._finish(s)
            elif s in self.parked:
                del self.parked[s]
                self._release_blocks(s)
                self._end(s)
            elif not self._drop_waiting(s) and not self._in_prefill(s):
                self._release(s)  # out of the batch at its length limit, not yet committed
                self._end(s)

    def _drop_waiting(self, sample: int) -> bool:
        """Take ``sample`` out of the job waiting with it (the job goes when empty)."""
        for job in self.waiting:
            if sample in job.samples:
                job.samples.remove(sample)
                if not job.samples:
                    self.waiting.remove(job)
                    if job.blocks:  # a resumed job holds its cached prefix
                        self.alloc.release(job.blocks)
                self._release_blocks(sample)
                self._end(sample)
                return True
        return False

    def _in_prefill(self, sample: int) -> bool:
        """True when ``sample``'s job is mid-prefill: it ends when the job forks."""
        return any(sample in job.samples for job in self.prefilling)

    def take_events(self) -> list[tuple[int, str]]:
        events, self.events = self.events, []
        return events

    @property
    def done(self) -> bool:
        """True when no sample is waiting, prefilling, running or parked."""
        return not (self.waiting or self.prefilling or self.running or self.parked)

    @property
    def runnable(self) -> bool:
        """True when a step has something to run (parked samples wait for the caller)."""
        return bool(self.waiting or self.prefilling or self.running)

    # ----------------------------------------------------------------- prefill
    def prefill_due(self) -> bool:
        """True when the next step should be a prefill: a job is mid-prefill, or jobs
        wait and either no sample decodes, or this is not a multi-turn rollout, or the
        resumed samples waiting have waited long enough (see the module docstring)."""
        if self.prefilling:
            return True
        if not self.waiting:
            return False
        if not self.parking or self.resume_cost <= 0 or not self.running:
            return True
        if self.deferred_steps >= self.resume_max_wait:
            return True
        return self.deferred >= self.resume_cost * len(self.running)

    def plan_prefill(self) -> list[Chunk]:
        """Chunks for a prefill step (empty: run a decode step instead)."""
        if not self.prefill_due():
            return []
        budget, chunks = self.max_batched_tokens, []
        for job in self.prefilling:
            take = min(len(job.tokens) - job.done, budget)
            if take <= 0:
                break
            chunks.append(Chunk(job, job.done, take, int(self.slot[job.samples[0]])))
            budget -= take
        while budget > 0 and self.waiting and self._admit(self.waiting[0]):
            job = self.waiting.popleft()
            self.prefilling.append(job)
            take = min(len(job.tokens) - job.done, budget)  # a resumed job starts past 0
            chunks.append(Chunk(job, job.done, take, int(self.slot[job.samples[0]])))
            budget -= take
        if chunks:
            self.deferred, self.deferred_steps = 0, 0
        return chunks

    def _admit(self, job: Job) -> bool:
        """Reserve slots and blocks for ``job``; False (nothing taken) if they do not fit.

        A resumed job already holds the blocks of its cached prefix (``job.blocks``) and
        needs only the rest; a new one claims the blocks the prefix cache holds of its
        longest prefix seen before (`prefix_cache`), and prefills from there.
        """
        length, forks = len(job.tokens), len(job.samples) - 1
        hits = self._prefix_hits(job)
        need = -(-length // self.block_size) - len(job.blocks) - len(hits)
        extra = forks if length % self.block_size else 0
        busy = bool(self.running or self.prefilling)
        reserve = self.watermark if busy else 0
        if not busy and self._room(hits) < need + extra:
            self._reclaim(need + extra, keep=job)
            hits = self._prefix_hits(job)  # it may have lost its own blocks
            need = -(-length // self.block_size) - len(job.blocks) - len(hits)
        if len(self.free_slots) < len(job.samples) or self._room(hits) < need + extra + reserve:
            if not busy and not self.parked:
                raise RuntimeError(
                    f"native rollout engine: a prompt of {length} tokens with {forks + 1} "
                    f"samples needs {need + extra} KV blocks of {self.block_size} tokens and "
                    f"{forks + 1} sequence slots, but the cache has {self.alloc.free_blocks} "
                    f"blocks and {len(self.free_slots)} slots in all. Raise "
                    "actor_rollout_ref.rollout.gpu_memory_utilization (or max_num_seqs), or "
                    "shorten the prompts."
                )
            return False
        if self.prefix is not None and not job.blocks:
            self.prefix.claim(hits, looked=length)  # before allocating: none is evicted
            job.blocks, job.done = list(hits), len(hits) * self.block_size
        fresh, fork_blocks = self.alloc.allocate(need), self.alloc.allocate(extra)
        assert fresh is not None and fork_blocks is not None, "_room counted them free"
        job.blocks, job.fork_blocks = job.blocks + fresh, fork_blocks
        for s in job.samples:
            self.slot[s] = self.free_slots.pop()
        self._set_row(int(self.slot[job.samples[0]]), job.blocks)
        return True

    def _prefix_hits(self, job: Job) -> list[int]:
        """The cached blocks of a new job's prefix (none for a resumed one, or when the
        prefix cache is off)."""
        if self.prefix is None or job.done or job.blocks:
            return []
        return self.prefix.match(job.tokens, job.salt)

    def _room(self, hits: list[int]) -> int:
        """Free blocks once ``hits`` are claimed (a hit still in the free pool leaves it)."""
        return self.alloc.free_blocks - sum(self.alloc.is_free(b) for b in hits)

    def commit_prefill(
        self, chunks: list[Chunk], tokens: np.ndarray, log_probs: np.ndarray
    ) -> None:
        """Advance the chunks; fork finished jobs and append their first sampled tokens.

        ``tokens`` / ``log_probs`` hold one entry per sample of each completing chunk's
        job, in chunk order (`sample_rows`).
        """
        samples, at = self.launch_prefill(chunks)
        if len(samples):
            self.commit_decode(samples, at, tokens, log_probs)

    def launch_prefill(self, chunks: list[Chunk]) -> tuple[np.ndarray, np.ndarray]:
        """The prefill step over ``chunks`` is running: advance them, fork the jobs they
        complete, whose samples join the running set. Returns those samples (in chunk
        order, `sample_rows`) and the index each one's first token takes, which
        `commit_decode` writes once the step's draw is back, as for a decode step
        (samples at their length limit with that token leave the batch now)."""
        samples = []
        for chunk in chunks:
            job = chunk.job
            job.done += chunk.count
            if not chunk.completes:
                continue
            self.prefilling.remove(job)
            if self.prefix is not None:  # its full blocks, found again by later jobs
                self.chain[job.samples] = self.prefix.record(job.blocks, job.tokens, job.salt)
            self._fork(job)
            samples.extend(job.samples)
        samples = np.asarray(samples, dtype=np.int64)
        at = self.gen[samples].copy()
        self.gen[samples] = at + 1
        for s in samples[at + 1 >= self.max_new[samples]].tolist():
            self.running.pop(s, None)
        return samples, at

    def sample_rows(self, chunks: list[Chunk]) -> tuple[list[int], np.ndarray]:
        """For the completing chunks: how many samples each forks into, and those samples."""
        counts, samples = [], []
        for chunk in chunks:
            if chunk.completes:
                counts.append(len(chunk.job.samples))
                samples.extend(chunk.job.samples)
        return counts, np.asarray(samples, dtype=np.int64)

    def _fork(self, job: Job) -> None:
        length, bs = len(job.tokens), self.block_size
        partial = length % bs != 0
        first, rest = job.samples[0], job.samples[1:]
        self.blocks[first] = job.blocks
        self.n_blocks[job.samples] = len(job.blocks)
        for i, s in enumerate(rest):
            if partial:
                own = job.fork_blocks[i]
                self.blocks[s] = self.alloc.share(job.blocks[:-1]) + [own]
                self.pending_copies.append((job.blocks[-1], own))
            else:
                self.blocks[s] = self.alloc.share(job.blocks)
            self._set_row(int(self.slot[s]), self.blocks[s])
        for s in job.samples:
            self.kv_len[s] = length
            self.running[s] = None
        self.paused[job.samples] = False
        for s in job.samples:
            if self.aborted[s]:  # aborted while its job was prefilling
                self._finish(s)

    # ------------------------------------------------------------------ decode
    def plan_decode(self) -> np.ndarray:
        """The samples of a decode step, each with a cache block for its next token."""
        samples = np.fromiter(self.running, dtype=np.int64, count=len(self.running))
        full = self.n_blocks[samples] * self.block_size <= self.kv_len[samples]
        for s in samples[full].tolist():
            if s not in self.running:
                continue  # preempted while finding room for another sample
            if self.prefix is not None and self.n_blocks[s]:
                self._record_filled(self.prefix, s)
            while True:
                block = self.alloc.allocate(1)
                if block is not None:
                    self.blocks[s].append(block[0])
                    self.n_blocks[s] += 1
                    self.table[self.slot[s], self.n_blocks[s] - 1] = block[0]
                    self.dirty_rows.add(int(self.slot[s]))
                    break
                if self._reclaim(1):
                    continue
                victim = next(reversed(self.running))
                self._preempt(victim)
                if victim == s:
                    break
        if len(samples) != len(self.running):
            samples = np.fromiter(self.running, dtype=np.int64, count=len(self.running))
        return samples

    def _record_filled(self, prefix: PrefixCache, sample: int) -> None:
        """The sample's last block just filled while decoding: into the prefix cache."""
        bs, last = self.block_size, int(self.n_blocks[sample]) - 1
        prompt = self.prompt_of[sample]
        assert prompt is not None  # a running sample's prompt
        start, end = last * bs, (last + 1) * bs
        if start >= len(prompt):
            tokens = self.tokens[sample, start - len(prompt) : end - len(prompt)]
        else:
            tokens = np.concatenate([prompt[start:], self.tokens[sample, : end - len(prompt)]])
        block = self.blocks[sample][last]
        salt = int(self.salt[sample])
        self.chain[sample] = prefix.extend(block, int(self.chain[sample]), tokens, salt)

    def decode_inputs(self, samples: np.ndarray) -> dict[str, np.ndarray]:
        """Host arrays of a decode step: last tokens, positions, cache slots, rows, lengths.
        A position is the rotary one: the token's index plus its prompt's M-RoPE
        ``rope_delta`` (0 without images); its cache slot is by its index."""
        pos = self.kv_len[samples]
        rows = self.slot[samples]
        blocks = self.table[rows, pos // self.block_size].astype(np.int64)
        return {
            "input_ids": self.tokens[samples, self.gen[samples] - 1],
            "positions": pos + self.rope_delta[samples],
            "slot_mapping": blocks * self.block_size + pos % self.block_size,
            "seq_rows": rows,
            "seq_lens": pos + 1,
            "sample_positions": self.gen[samples],
        }

    def launch_decode(self, samples: np.ndarray) -> np.ndarray:
        """The step over ``samples`` is running: advance them; return each one's token index.

        Samples that reach their length limit with this token leave the batch now (they
        end at the commit); the others carry on into the next step's plan.
        """
        if self.waiting and self.parking:
            self.deferred += sum(len(job.samples) for job in self.waiting)
            self.deferred_steps += 1
        at = self.gen[samples].copy()
        self.kv_len[samples] += 1
        self.gen[samples] = at + 1
        for s in samples[at + 1 >= self.max_new[samples]].tolist():
            self.running.pop(s, None)
        return at

    def commit_decode(self, samples, at, tokens: np.ndarray, log_probs: np.ndarray) -> int:
        """Write a launched step's tokens; returns how many were kept.

        A sample that ended (or was parked) at an earlier commit while this step was
        already running (a stop found a step late) has its token dropped.
        """
        live = ~(self.finished[samples] | self.paused[samples])
        if not live.all():
            samples, at, tokens, log_probs = samples[live], at[live], tokens[live], log_probs[live]
        self._settle(samples, at, tokens, log_probs)
        return len(samples)

    def rows_in(self, earlier: np.ndarray, samples: np.ndarray) -> np.ndarray:
        """The index in ``earlier`` of each of ``samples``; -1 for a sample not in it
        (its last token is committed: on the host)."""
        self._where[samples] = -1
        self._where[earlier] = np.arange(len(earlier))
        return self._where[samples]

    def can_overlap(self) -> bool:
        """True when the next decode step can be planned before the last one's commit:
        no prefill is due (no join), and no sample must be preempted."""
        if self.prefill_due():
            return False
        samples = np.fromiter(self.running, dtype=np.int64, count=len(self.running))
        full = self.n_blocks[samples] * self.block_size <= self.kv_len[samples]
        return int(full.sum()) <= self.alloc.free_blocks

    # ---------------------------------------------------------------- shared
    def _settle(self, samples, at, tokens: np.ndarray, log_probs: np.ndarray) -> None:
        """Token ``at[i]`` of sample ``samples[i]`` is known: store it, end stopped samples."""
        self.tokens[samples, at] = tokens
        self.log_probs[samples, at] = log_probs
        self.versions[samples, at] = self.version
        stop = self._stops(tokens)
        if self.stop_check is not None:
            stop |= self.stop_check(samples, at + 1)
        self.stopped[samples] = stop
        room = at + 1 < self.max_new[samples]
        ended = stop | ~room
        self.gen[samples[ended]] = at[ended] + 1  # a later step may have advanced it already
        park = stop & room & self.parks[samples]
        for s in samples[ended & ~park].tolist():
            self._finish(s)
        for s in samples[park].tolist():
            self._park(s)

    def _stops(self, tokens: np.ndarray) -> np.ndarray:
        """Whether each token is a stop id (``np.isin(tokens, stop_ids)``)."""
        table = self._is_stop
        if not len(table):
            return np.zeros(len(tokens), dtype=bool)
        tokens = np.asarray(tokens, dtype=np.int64)
        inside = (tokens >= 0) & (tokens < len(table))
        return inside & table[np.where(inside, tokens, 0)]

    def _finish(self, sample: int) -> None:
        self._finishing(sample)
        self._release(sample)
        self._end(sample)

    def _finishing(self, sample: int) -> None:
        """``on_finish`` of a sample that ends (not aborted), while it holds its blocks."""
        if self.on_finish is not None and not self.aborted[sample]:
            self.on_finish(sample)

    def _end(self, sample: int) -> None:
        """The sample is finished: counted out, and (unless aborted) a done event."""
        self.finished[sample] = True
        self.paused[sample] = False
        self.live -= 1
        self.parking -= int(self.parks[sample])
        if not self.aborted[sample]:
            self.events.append((sample, DONE))

    def _release(self, sample: int) -> None:
        self._release_blocks(sample)
        self._release_slot(sample)
        self.running.pop(sample, None)

    def _release_blocks(self, sample: int) -> None:
        self.alloc.release(self.blocks[sample])
        self.blocks[sample] = []
        self.n_blocks[sample] = 0

    def _release_slot(self, sample: int) -> None:
        if self.slot[sample] >= 0:
            self.free_slots.append(int(self.slot[sample]))
            self.slot[sample] = -1

    def _preempt(self, sample: int) -> None:
        """Free ``sample``'s cache; it waits first in line to recompute prompt + output."""
        prompt = self.prompt_of[sample]
        generated = self.tokens[sample, : self.gen[sample]]
        self._release(sample)
        self.kv_len[sample] = 0
        images = self.images_of[sample]
        self.waiting.appendleft(Job(np.concatenate([prompt, generated]), [sample], images=images))
        self.preemptions += 1

    def _set_row(self, row: int, blocks: list[int]) -> None:
        self.table[row, : len(blocks)] = blocks
        self.dirty_rows.add(row)
