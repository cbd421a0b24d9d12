"""Runs the scheduler's steps on the device: step tensors, the forward, sampling.

The runner owns what lives on the device between steps: the block table (rows of
KV block ids, mirrored from the scheduler's numpy table, only changed rows copied), the
KV cache, and on CUDA the decode step's CUDA graphs (`rayrl.rollout.native.graphs`).
A step's inputs go to the device in one copy of a packed int64 array; its sampled
tokens and log-probs come back in one copy, the step's only synchronisation. A decode
step returns once it is queued (a `Launch`): the host waits for its tokens when it
commits them, and the next step may take its input tokens from the device (`feed`),
so that the device runs one step while the host does the bookkeeping of the last.

A prefill step whose chunks hold a vision-language prompt's tokens (`images`) runs
eager: the chunks' M-RoPE positions and image features (`_prefill_images`) go with it;
a decode step is text and needs nothing more (its positions carry each prompt's
``rope_delta``: `Scheduler.decode_inputs`), in CUDA graphs or not.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from rayrl.rollout.native.kv_cache import KVCache
from rayrl.rollout.native.model import NativeModel
from rayrl.rollout.native.sampler import DeviceSampler
from rayrl.rollout.native.scheduler import Chunk, Scheduler
from rayrl.rollout.native.step import PREFILL_TILE, StepInput
from rayrl.rollout.sampling import SamplingParams

if TYPE_CHECKING:
    from rayrl.rollout.native.graphs import DecodeGraphs
    from rayrl.rollout.native.prefill_graphs import PrefillGraphs

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
        self.graphs: DecodeGraphs | None = None  # set by the engine on CUDA
        self.prefill_graphs: PrefillGraphs | None = None  # likewise
        self.forward_s = 0.0  # host time spent in prefill forwards (queueing them on CUDA)

    # --------------------------------------------------------------- sync
    def sync(self, sched: Scheduler) -> None:
        """Copy changed block-table rows and pending fork copies (KV and routing record)
        to the device."""
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
            if self.model.routes is not None:  # the blocks' routing record goes along
                self.model.routes.copy_blocks(list(src), list(dst), sched.block_size)

    def _to_device(self, arrays: list[np.ndarray]) -> list[Tensor]:
        """One host-to-device copy of several equal-length integer arrays (as int64)."""
        packed = torch.from_numpy(np.stack(arrays).astype(np.int64, copy=False))
        return list(packed.to(self.device).unbind(0))

    # ------------------------------------------------------------- prefill
    def prefill(
        self, sched: Scheduler, chunks: list[Chunk], keys: np.ndarray, params: SamplingParams
    ) -> Launch | None:
        """Queue the chunks and the draw of the first token of every sample whose prompt
        completes (None: none completes); the host waits for the tokens when it commits
        them (`tokens_of`), as for a decode step.

        Every input of the step, the first-token draw's included, goes to the device
        before the forward (one copy, two in a prefill graph's bucket), so nothing waits
        for the device. Small steps run in a CUDA graph (`prefill_graphs`) where the
        engine set them up."""
        self.sync(sched)
        host = _prefill_inputs(chunks, self.table_host, sched.block_size)
        counts, samples = sched.sample_rows(chunks)
        # Row of the logits each sample draws from: a job's n samples share its last row.
        pick = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        tiles = _tiles(host["q_start"]) if self.model.kernels == "triton" else _NO_TILES
        draw = [pick, keys[samples], sched.gen[samples]]  # the first tokens' draw's inputs
        graphs = self.prefill_graphs
        images = _prefill_images(chunks, host["q_start"])
        since = time.perf_counter()
        if (
            graphs is not None
            and images is None
            and graphs.fits(len(host["input_ids"]), len(chunks))
        ):
            pick_d, keys_d, gen_d = self._upload(draw)
            logits = graphs.forward(host, tiles)
        else:
            logits, (pick_d, keys_d, gen_d) = self._eager_prefill(host, tiles, draw, images)
        self.forward_s += time.perf_counter() - since
        if not len(samples):
            return None
        if len(pick) != len(counts):  # a prompt's n samples: a copy of its row each
            logits = logits.index_select(0, pick_d)
        drawn = self.sampler.draw(logits, keys_d, gen_d, params)
        return Launch(samples, drawn, *self.sampler.fetch(drawn))

    def _eager_prefill(
        self, host: dict, tiles: np.ndarray, draw: list[np.ndarray], images: _Images | None
    ):
        """The prefill forward, eager: its logits, and ``draw`` on the device (one copy
        with the step's inputs, ``images``' positions and placeholder rows too)."""
        mrope, image_rows, features = images if images is not None else (_EMPTY, _EMPTY, [])
        parts = self._upload(
            [
                host["input_ids"],
                host["positions"],
                host["slot_mapping"],
                host["q_start"],
                host["seq_lens"],
                host["seq_rows"],
                host["last"],
                *draw,
                tiles,
                mrope.reshape(-1),
                image_rows,
            ]
        )
        input_ids, positions, slots, q_start, lens, rows, last = parts[:7]
        step = StepInput(
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slots,
            q_start=q_start,
            seq_lens=lens,
            seq_rows=rows,
            logits_rows=last,
            block_table=self.table,
            decode=False,
            q_start_host=host["q_start"].tolist(),
            seq_lens_host=host["seq_lens"].tolist(),
            seq_rows_host=host["seq_rows"].tolist(),
            tiles=parts[10].view(torch.int32).view(-1, 2) if len(tiles) else None,
        )
        if images is not None:
            step.mrope = parts[11].view(3, -1)
            if features:
                step.image_rows, step.image_features = parts[12], torch.cat(features)
        return self.model.forward(step, self.cache), parts[7:10]

    def _upload(self, arrays: list[np.ndarray]) -> list[Tensor]:
        """One host-to-device copy of integer arrays of any lengths (as int64): their
        device views, each starting 16 bytes aligned (Triton specialises kernels on the
        alignment of their pointers: the same one every step, the same compiled kernel)."""
        sizes = [len(a) + (len(a) & 1) for a in arrays]
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        packed = np.zeros(int(offsets[-1]), dtype=np.int64)
        for a, start in zip(arrays, offsets[:-1], strict=True):
            packed[start : start + len(a)] = a
        buffer = torch.from_numpy(packed)
        if self.device.type == "cuda":  # a copy that never waits for the device's queue
            buffer = buffer.pin_memory()
        buffer = buffer.to(self.device, non_blocking=True)
        return [
            buffer[start : start + len(a)] for a, start in zip(arrays, offsets[:-1], strict=True)
        ]

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
                the device, ``tokens[rows[i]]`` for sample i, rather than from the host;
                a row of -1: sample i's token is on the host (committed already).
        """
        self.sync(sched)
        host = sched.decode_inputs(samples)
        n = len(samples)
        rows = feed[1] if feed is not None else np.zeros(n, dtype=np.int64)
        arrays = [host[f] for f in _DECODE_FIELDS] + [keys[samples], host["sample_positions"], rows]
        mixed = feed is not None and bool((rows < 0).any())
        if self.graphs is not None and self.graphs.fits(n):
            tensors = self.graphs.stage(arrays)
            if feed is not None:
                tensors[0][:n].copy_(_fed(feed[0], tensors[7][:n], tensors[0][:n], mixed))
            logits = self.graphs.run(n)[:n]
            keys_d, sample_pos = tensors[5][:n], tensors[6][:n]
        else:
            tensors = self._to_device(arrays)
            if feed is not None:
                tensors[0] = _fed(feed[0], tensors[7], tensors[0], mixed).long()
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


_NO_TILES = np.zeros(0, dtype=np.int64)
_EMPTY = _NO_TILES  # no positions, no placeholder rows (a text step)


def _fed(drawn: Tensor, rows: Tensor, host_ids: Tensor, mixed: bool) -> Tensor:
    """A decode step's input tokens: ``drawn[rows[i]]``, or where ``mixed`` and
    ``rows[i]`` is -1, ``host_ids[i]`` (a token committed on the host)."""
    if not mixed:
        return drawn.index_select(0, rows)
    fed = drawn.index_select(0, rows.clamp(min=0))
    return torch.where(rows >= 0, fed, host_ids.to(fed.dtype))


def _prefill_inputs(chunks: list[Chunk], table: np.ndarray, block_size: int) -> dict:
    """Host arrays of a prefill step, int64: per token ``input_ids``, ``positions``,
    ``slot_mapping``; per chunk ``q_start`` (S + 1 offsets), ``seq_lens``, ``seq_rows``;
    ``last``: the token index of each completing chunk's last token."""
    s = len(chunks)
    starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=s)
    counts = np.fromiter((c.count for c in chunks), dtype=np.int64, count=s)
    rows = np.fromiter((c.row for c in chunks), dtype=np.int64, count=s)
    completes = np.fromiter((c.completes for c in chunks), dtype=bool, count=s)
    q_start = np.zeros(s + 1, dtype=np.int64)
    np.cumsum(counts, out=q_start[1:])
    ids = np.concatenate([c.job.tokens[c.start : c.start + c.count] for c in chunks])
    # Token t of chunk i sits at position starts[i] + (t - q_start[i]).
    positions = np.arange(q_start[-1], dtype=np.int64) + np.repeat(starts - q_start[:-1], counts)
    blocks = table[np.repeat(rows, counts), positions // block_size].astype(np.int64)
    return {
        "input_ids": ids.astype(np.int64, copy=False),
        "positions": positions,
        "slot_mapping": blocks * block_size + positions % block_size,
        "q_start": q_start,
        "seq_lens": starts + counts,
        "seq_rows": rows,
        "last": q_start[1:][completes] - 1,
    }


# A prefill step's images: M-RoPE positions [3, T], placeholder rows [K], their features.
_Images = tuple[np.ndarray, np.ndarray, list[Tensor]]


def _prefill_images(chunks: list[Chunk], q_start: np.ndarray) -> _Images | None:
    """The M-RoPE positions of a prefill step's tokens (a text chunk's three equal to its
    indices), and the image placeholders among them with their features; None when no
    chunk is of a prompt with images (the step runs as text: graphs allowed)."""
    if all(c.job.images is None for c in chunks):
        return None
    mrope: list[np.ndarray] = []
    rows: list[np.ndarray] = [_EMPTY]
    features: list[Tensor] = []
    for chunk, first in zip(chunks, q_start[:-1].tolist(), strict=True):
        images = chunk.job.images
        if images is None:
            indices = np.arange(chunk.start, chunk.start + chunk.count, dtype=np.int64)
            mrope.append(np.broadcast_to(indices, (3, chunk.count)))
            continue
        mrope.append(images.rope_positions(chunk.start, chunk.count))
        offsets, rows_features = images.features_in(chunk.start, chunk.count)
        if len(offsets):
            rows.append(offsets + first)
            features.append(rows_features)
    return np.concatenate(mrope, axis=1), np.concatenate(rows), features


def _tiles(q_start: np.ndarray) -> np.ndarray:
    """(sequence, first query) of every PREFILL_TILE queries, for the Triton kernel: int32
    pairs, the bytes of each held by one int64, so that the device view of them as int32
    is ``[n, 2]``."""
    counts = np.diff(q_start)
    per_seq = -(-counts // PREFILL_TILE)
    seq = np.repeat(np.arange(len(counts), dtype=np.int64), per_seq)
    first_tile = np.concatenate([[0], np.cumsum(per_seq)[:-1]]).astype(np.int64)
    first = (np.arange(len(seq), dtype=np.int64) - np.repeat(first_tile, per_seq)) * PREFILL_TILE
    pairs = np.stack([seq, first], axis=1).astype(np.int32)
    return pairs.view(np.int64).reshape(-1)
