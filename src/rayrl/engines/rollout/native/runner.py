"""Runs the scheduler's steps on the device: step tensors, the forward, sampling.

The runner owns what lives on the device between steps: the block table (rows of
KV block ids, mirrored from the scheduler's numpy table, only changed rows copied), the
KV cache, and on CUDA the decode step's CUDA graphs (`rayrl.engines.rollout.native.graphs`).
A step's inputs go to the device in one copy of a packed int64 array; its sampled
tokens and log-probs come back in one copy, the step's only synchronisation. A decode
step returns once it is queued (a `Launch`): the host waits for its tokens when it
commits them, and the next step may take its input tokens from the device (`feed`),
so that the device runs one step while the host does the bookkeeping of the last.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from rayrl.engines.rollout.native.kv_cache import KVCache
from rayrl.engines.rollout.native.model import NativeModel
from rayrl.engines.rollout.native.sampler import DeviceSampler
from rayrl.engines.rollout.native.scheduler import Chunk, Scheduler
from rayrl.engines.rollout.native.step import PREFILL_TILE, StepInput
from rayrl.engines.rollout.sampling import SamplingParams

__all__ = ["Launch", "ModelRunner"]

_DECODE_FIELDS = ("input_ids", "positions", "slot_mapping", "seq_rows", "seq_lens")


@dataclass
class Launch:
    """A queued decode step: its samples, their sampled tokens and log-probs on the device
    (``drawn``, float64 ``[2, n]``), their host copy once ``ready`` has fired, and each
    sample's token index (``at``, set when the scheduler launches the step)."""

    samples: np.ndarray
    drawn: Tensor
    host: Tensor
    ready: torch.cuda.Event | None
    at: np.ndarray | None = None


class ModelRunner:
    """Device side of generation for one model and one KV cache."""

    def __init__(
        self,
        model: NativeModel,
        cache: KVCache,
        max_seqs: int,
        table_width: int,
        sampler: DeviceSampler | None = None,
    ) -> None:
        """``sampler``: default a `DeviceSampler` for the model's kernels (tensor-parallel:
        the engine passes one that samples over the split vocabulary)."""
        self.model, self.cache = model, cache
        self.device = model.weights.device
        self.table_host = np.zeros((max_seqs, table_width), dtype=np.int32)
        self.table = torch.zeros(max_seqs, table_width, dtype=torch.int32, device=self.device)
        self.sampler = sampler if sampler is not None else DeviceSampler(model.kernels)
        self.graphs = None  # set by the engine on CUDA (DecodeGraphs)

    # --------------------------------------------------------------- sync
    def sync(self, sched: Scheduler) -> None:
        """Copy changed block-table rows and pending fork copies to the device."""
        if sched.dirty_rows:
            rows = sorted(sched.dirty_rows)
            sched.dirty_rows.clear()
            index, src = torch.tensor(rows), torch.from_numpy(self.table_host[rows])
            if self.device.type == "cuda":  # copies that never wait for the device's queue
                index, src = index.pin_memory(), src.pin_memory()
            dev = self.device
            self.table.index_copy_(
                0, index.to(dev, non_blocking=True), src.to(dev, non_blocking=True)
            )
        if sched.pending_copies:
            src, dst = zip(*sched.pending_copies, strict=True)
            sched.pending_copies.clear()
            self.cache.copy_blocks(list(src), list(dst))

    def _to_device(self, arrays: list[np.ndarray]) -> list[Tensor]:
        """One host-to-device copy of several equal-length integer arrays (as int64)."""
        packed = torch.from_numpy(np.stack(arrays).astype(np.int64, copy=False))
        return list(packed.to(self.device).unbind(0))

    # ------------------------------------------------------------- prefill
    def prefill(
        self, sched: Scheduler, chunks: list[Chunk], keys: np.ndarray, params: SamplingParams
    ):
        """Run the chunks; sample the first token of every sample whose prompt completed."""
        self.sync(sched)
        bs = sched.block_size
        ids, pos, q_start, lens, rows, last = [], [], [0], [], [], []
        for chunk in chunks:
            p = np.arange(chunk.start, chunk.start + chunk.count)
            ids.append(chunk.job.tokens[chunk.start : chunk.start + chunk.count])
            pos.append(p)
            q_start.append(q_start[-1] + chunk.count)
            lens.append(chunk.start + chunk.count)
            rows.append(chunk.row)
            if chunk.completes:
                last.append(q_start[-1] - 1)
        positions = np.concatenate(pos)
        row_of_token = np.repeat(np.asarray(rows), [c.count for c in chunks])
        blocks = self.table_host[row_of_token, positions // bs].astype(np.int64)
        slots = blocks * bs + positions % bs
        input_ids, positions_d, slots_d = self._to_device([np.concatenate(ids), positions, slots])
        meta = torch.tensor([*q_start, *lens, *rows, *last], dtype=torch.int64).to(
            self.device, non_blocking=True
        )
        s = len(chunks)
        step = StepInput(
            input_ids=input_ids,
            positions=positions_d,
            slot_mapping=slots_d,
            q_start=meta[: s + 1],
            seq_lens=meta[s + 1 : 2 * s + 1],
            seq_rows=meta[2 * s + 1 : 3 * s + 1],
            logits_rows=meta[3 * s + 1 :],
            block_table=self.table,
            decode=False,
            q_start_host=q_start,
            seq_lens_host=lens,
            tiles=self._tiles(q_start),
        )
        if not last:
            self.model.forward(step, self.cache)
            return None
        logits = self.model.forward(step, self.cache)
        counts, samples = sched.sample_rows(chunks)
        logits = logits.repeat_interleave(torch.tensor(counts, device=self.device), dim=0)
        return samples, self._sample(logits, keys[samples], sched.gen[samples], params)

    def _tiles(self, q_start: list[int]) -> Tensor | None:
        """(sequence, first query) of every PREFILL_TILE queries, for the Triton kernel."""
        if self.model.kernels != "triton":
            return None
        tiles = [
            (i, a)
            for i in range(len(q_start) - 1)
            for a in range(0, q_start[i + 1] - q_start[i], PREFILL_TILE)
        ]
        return torch.tensor(tiles, dtype=torch.int32).to(self.device, non_blocking=True)

    # -------------------------------------------------------------- decode
    def decode(
        self,
        sched: Scheduler,
        samples: np.ndarray,
        keys: np.ndarray,
        params: SamplingParams,
        feed: tuple[Tensor, np.ndarray] | None = None,
    ) -> Launch:
        """Queue one token for each of ``samples``.

        Args:
            feed: ``(tokens, rows)``: take the input tokens from an earlier step's draw on
                the device, ``tokens[rows[i]]`` for sample i, rather than from the host.
        """
        self.sync(sched)
        host = sched.decode_inputs(samples)
        n = len(samples)
        rows = feed[1] if feed is not None else np.zeros(n, dtype=np.int64)
        arrays = [host[f] for f in _DECODE_FIELDS] + [keys[samples], host["sample_positions"], rows]
        if self.graphs is not None and self.graphs.fits(n):
            tensors = self.graphs.stage(arrays)
            if feed is not None:
                tensors[0][:n].copy_(feed[0].index_select(0, tensors[7][:n]))
            logits = self.graphs.run(n)[:n]
            keys_d, sample_pos = tensors[5][:n], tensors[6][:n]
        else:
            tensors = self._to_device(arrays)
            if feed is not None:
                tensors[0] = feed[0].index_select(0, tensors[7]).long()
            fields = dict(zip(_DECODE_FIELDS, tensors[:5], strict=True))
            step = StepInput(
                **fields,
                block_table=self.table,
                decode=True,
                logits_rows=torch.arange(n, device=self.device),
            )
            logits = self.model.forward(step, self.cache)
            keys_d, sample_pos = tensors[5], tensors[6]
        drawn = self.sampler.draw(logits, keys_d, sample_pos, params)
        return Launch(samples, drawn, *self.sampler.fetch(drawn))

    def tokens_of(self, launch: Launch) -> tuple[np.ndarray, np.ndarray]:
        """A launched step's (tokens, log-probs) on the host; waits for the device."""
        return self.sampler.wait(launch.host, launch.ready)

    def _sample(self, logits: Tensor, keys: np.ndarray, positions: np.ndarray, params):
        keys_d, pos_d = self._to_device([keys, positions])
        return self.sampler.sample(logits, keys_d, pos_d, params)
