"""Shared helpers for the algos tests: random ragged masked batches and loop references."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# Hypothesis profile for these pure-tensor tests: no deadline, modest example counts.
FAST = settings(
    deadline=None, max_examples=30, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


@dataclass
class Case:
    """A random batch shape with a ragged (optionally holey) response mask."""

    batch: int
    length: int
    mask: torch.Tensor  # float64 0/1, [batch, length]
    gen: torch.Generator

    def randn(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        """Standard normal float64 tensor, default shape [batch, length]."""
        shape = shape or (self.batch, self.length)
        return torch.randn(*shape, generator=self.gen, dtype=torch.float64) * scale

    def group_index(self, num_groups: int) -> np.ndarray:
        """A numpy object array of prompt uid strings, ``num_groups`` distinct at most."""
        ids = torch.randint(0, num_groups, (self.batch,), generator=self.gen)
        return np.array([f"uid-{int(i)}" for i in ids], dtype=object)


@st.composite
def cases(draw, max_batch: int = 8, max_len: int = 9, holes: bool = False, min_batch: int = 1):
    """Draw a :class:`Case`; lengths may be 0 (an all-padding row)."""
    seed = draw(st.integers(0, 2**31 - 1))
    batch = draw(st.integers(min_batch, max_batch))
    length = draw(st.integers(1, max_len))
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, length + 1, (batch,), generator=gen)
    mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    if holes:
        mask &= torch.rand(batch, length, generator=gen) > 0.3
    return Case(batch, length, mask.to(torch.float64), gen)


def valid_positions(mask: torch.Tensor, row: int) -> list[int]:
    """Indices of the real tokens of one row."""
    return [t for t in range(mask.shape[1]) if mask[row, t] > 0]


def loop_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Whitening over all real tokens, written with loops (unbiased variance)."""
    picked = [
        float(values[i, t])
        for i in range(values.shape[0])
        for t in range(values.shape[1])
        if mask[i, t] > 0
    ]
    out = torch.zeros_like(values)
    if not picked:
        return out
    mean = sum(picked) / len(picked)
    var = sum((x - mean) ** 2 for x in picked) / (len(picked) - 1) if len(picked) > 1 else 0.0
    for i in range(values.shape[0]):
        for t in range(values.shape[1]):
            if mask[i, t] > 0:
                out[i, t] = (float(values[i, t]) - mean) / math.sqrt(var + 1e-8)
    return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-9) -> None:
    """Elementwise comparison in float64 with a small tolerance."""
    torch.testing.assert_close(
        actual.to(torch.float64), expected.to(torch.float64), atol=atol, rtol=1e-7
    )


def loop_aggregate(loss_mat, mask, mode: str, norm_length: float | None = None):
    """Reference loss aggregation written with loops (one micro-batch = whole batch)."""
    seq_terms, token_terms = [], []
    for i in range(loss_mat.shape[0]):
        vals = [loss_mat[i, t] for t in range(loss_mat.shape[1]) if mask[i, t] > 0]
        token_terms += vals
        if not vals:
            continue
        total = sum(vals)
        if mode == "seq-mean-token-sum":
            seq_terms.append(total)
        elif mode == "seq-mean-token-mean":
            seq_terms.append(total / len(vals))
        elif mode == "seq-mean-token-sum-norm":
            seq_terms.append(total / (norm_length or loss_mat.shape[1]))
    zero = loss_mat.sum() * 0.0
    if mode == "token-mean":
        return sum(token_terms) / len(token_terms) if token_terms else zero
    return sum(seq_terms) / len(seq_terms) if seq_terms else zero


AGG_MODE_NAMES = [
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
]


def config_show(capsys, source: str, *overrides: str) -> tuple[int, str, str]:
    """`rayrl config show -c source overrides...` in this process: exit code, stdout,
    stderr (a refused config exits through SystemExit)."""
    from rayrl.cli.main import main

    try:
        code = main(["config", "show", "-c", source, *overrides])
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err
