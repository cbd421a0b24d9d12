"""Small prefill steps captured in CUDA graphs, one graph per token-count bucket.

Multi-turn episodes prefill often and little: each step appends the tool answers of
the samples whose tools returned (a few hundred tokens), so its forward is short on the
device but launches as many kernels as a large one (about ten a layer). Queued from
Python while the episodes' tool and turn threads take turns on the GIL, such a step
cost 18 ms of host time on an H200 for about 2 ms of device work (docs/benchmarks.md).
Replaying a graph launches them all at once.

A graph has fixed shapes and addresses, so a step of T tokens and S sequences runs in
the graph of the smallest bucket >= T, its inputs written into that bucket's static
int64 buffer (one copy): the tokens' ids, positions and cache slots, the sequences'
query offsets, context lengths and block-table rows, the rows whose logits are wanted,
and the attention kernel's query tiles. Padding does no work and writes nothing: the
padded tokens have cache slot -1, and the padded sequences (there is always at least
one) have no query tokens and an empty context, the padded tiles point at one of them.
Each token's row of every matmul is computed from that token alone, so the padding
changes no real token's values (up to the matmul kernel a different row count picks).

The graphs share one memory pool, and stay or go at a `sleep` with the decode graphs
(`graphs`). Where they go, a bucket's graph is captured on its `CAPTURE_AFTER`-th step
since the graphs were made (a single-turn rollout, which prefills once in large chunks,
captures none; a multi-turn one captures the few buckets its resumed turns use and
replays them many times); the steps before run the same padded inputs eagerly. Where
they stay (the KV cache at a fixed address), a bucket is captured on its first step:
the capture is paid once for the engine's life. Without CUDA (``capture=False``, the
tests on CPU) every step runs the padded inputs eagerly: the same path but the capture
(with the torch kernels, whose attention loops over the real sequences on the host).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from rayrl.rollout.native.graphs import CapturedForwards
from rayrl.rollout.native.step import PREFILL_TILE, StepInput

__all__ = ["CAPTURE_AFTER", "PREFILL_GRAPH_TOKENS", "PrefillGraphs", "prefill_buckets"]

PREFILL_GRAPH_TOKENS = 2048  # larger steps are compute-bound: eager costs them little
CAPTURE_AFTER = 2  # a bucket is captured on its second step since the engine woke


def prefill_buckets(max_tokens: int) -> list[int]:
    """Token counts with a graph: 16, 32, 64, then powers of two and halfway between
    them (96, 128, 192, 256, ...), up to ``max_tokens``."""
    sizes, size = {16, 32, 64}, 64
    while size < max_tokens:
        sizes.update((size + size // 2, size * 2))
        size *= 2
    return sorted(s for s in sizes if s < max_tokens) + [max_tokens]


@dataclass
class _Layout:
    """Where each field lives in a bucket's static buffer: (offset, length) pairs."""

    tokens: int  # T: token slots
    seqs: int  # S: sequence slots (the last is always padding)
    logits: int  # L: logits rows
    tiles: int  # query tiles (int32 pairs, one int64 each)
    fields: dict[str, tuple[int, int]]
    size: int

    @classmethod
    def of(cls, tokens: int, max_seqs: int) -> _Layout:
        seqs = min(tokens, max_seqs) + 1
        logits = seqs - 1
        tiles = seqs - 1 + -(-tokens // PREFILL_TILE)
        lengths = {
            "input_ids": tokens,
            "positions": tokens,
            "slot_mapping": tokens,
            "q_start": seqs + 1,
            "seq_lens": seqs,
            "seq_rows": seqs,
            "last": logits,
            "tiles": tiles,
        }
        fields, at = {}, 0
        for name, length in lengths.items():
            fields[name] = (at, length)
            at += length + (length & 1)  # every field starts 16 bytes aligned
        return cls(tokens, seqs, logits, tiles, fields, at)


class PrefillGraphs(CapturedForwards):
    """Prefill forwards of a `ModelRunner`'s model in padded buckets (see the module
    docstring); `fits` says whether a step can use them, `forward` runs it."""

    def __init__(self, runner, max_tokens: int, max_seqs: int, capture: bool = True) -> None:
        super().__init__(runner)
        self.capture = capture
        self.buckets = prefill_buckets(max_tokens)
        self.max_seqs = max_seqs
        self.layouts = {t: _Layout.of(t, max_seqs) for t in self.buckets}
        self.static: dict[int, Tensor] = {}  # bucket -> its int64 input buffer
        self.seen: dict[int, int] = {}  # bucket -> steps run in it
        self.replays = 0

    @property
    def capture_after(self) -> int:
        """The step of a bucket that captures it: `CAPTURE_AFTER`, or the first where the
        graphs outlive a sleep (the capture is then paid once for the engine's life)."""
        return 1 if self.runner.cache.fixed_address else CAPTURE_AFTER

    def fits(self, tokens: int, seqs: int) -> bool:
        return 0 < tokens <= self.buckets[-1] and seqs <= self.max_seqs

    def bucket(self, tokens: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, tokens)]

    def forward(self, host: dict[str, np.ndarray], tiles: np.ndarray) -> Tensor:
        """Logits of the step's ``last`` rows, ``[len(host["last"]), vocab]`` (a view of
        the bucket's output, valid until the next step in the same bucket)."""
        size = self.bucket(len(host["input_ids"]))
        self._stage(size, host, tiles)
        self.seen[size] = self.seen.get(size, 0) + 1
        if self.capture and size not in self.graphs and self.seen[size] >= self.capture_after:
            self._capture(size)
        if size in self.graphs:
            self.graphs[size].replay()
            self.replays += 1
            logits = self.logits[size]
        else:
            step = self._step(size)
            if self.runner.model.kernels == "torch":  # its attention loops on the host
                step.q_start_host = host["q_start"].tolist()
                step.seq_lens_host = host["seq_lens"].tolist()
                step.seq_rows_host = host["seq_rows"].tolist()
            logits = self.runner.model.forward(step, self.runner.cache)
        return logits[: len(host["last"])]

    def _stage(self, size: int, host: dict, tiles: np.ndarray) -> None:
        """Write the step's arrays and the padding into the bucket's static buffer (one
        copy from pinned memory, which the caching host allocator reuses only once the
        copy is done)."""
        layout, device = self.layouts[size], self.runner.device
        if size not in self.static:
            self.static[size] = torch.zeros(layout.size, dtype=torch.int64, device=device)
        staging = torch.empty(layout.size, dtype=torch.int64, pin_memory=device.type == "cuda")
        buf = staging.numpy()
        n_tokens, n_seqs = len(host["input_ids"]), len(host["seq_lens"])
        pads = {
            "input_ids": 0,
            "positions": 0,
            "slot_mapping": -1,  # no cache write
            "q_start": n_tokens,  # padded sequences: no query tokens
            "seq_lens": 0,  # and no context
            "seq_rows": 0,
            "last": 0,
        }
        for name, pad in pads.items():
            at, length = layout.fields[name]
            values = host[name]
            buf[at : at + len(values)] = values
            buf[at + len(values) : at + length] = pad
        at, length = layout.fields["tiles"]
        pad_tile = np.array([[layout.seqs - 1, 0]], dtype=np.int32).view(np.int64)[0, 0]
        buf[at : at + len(tiles)] = tiles
        buf[at + len(tiles) : at + length] = pad_tile
        assert n_seqs < layout.seqs  # the last sequence slot stays padding
        self.static[size].copy_(staging, non_blocking=True)

    def _step(self, size: int) -> StepInput:
        layout, buf = self.layouts[size], self.static[size]
        f = {name: buf[at : at + length] for name, (at, length) in layout.fields.items()}
        return StepInput(
            input_ids=f["input_ids"],
            positions=f["positions"],
            slot_mapping=f["slot_mapping"],
            q_start=f["q_start"],
            seq_lens=f["seq_lens"],
            seq_rows=f["seq_rows"],
            logits_rows=f["last"],
            block_table=self.runner.table,
            decode=False,
            tiles=f["tiles"].view(torch.int32).view(-1, 2),
        )
