"""bench/rollout.py's workloads: G is the GRPO step's generation (prompts shared by
their samples), the others one sample a prompt."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from rollout import sample_rows, samples_per_prompt, seqs_limit, workload  # noqa: E402


def test_g_is_the_grpo_steps_generation():
    prompts, out_lens = workload("G", "reference", 151936)
    assert len(prompts) == 64 and {len(p) for p in prompts} == {256}
    assert samples_per_prompt(prompts, out_lens) == 8
    assert out_lens.tolist() == [256] * 512
    rows = sample_rows(prompts, out_lens)
    assert len(rows) == 512 and rows[0] is rows[7] is prompts[0] and rows[8] is prompts[1]
    assert seqs_limit(argparse.Namespace(max_num_seqs=None), "G") == 1024


def test_the_other_workloads_have_one_sample_a_prompt():
    for name in ("A", "B", "C"):
        prompts, out_lens = workload(name, "tiny", 512)
        assert samples_per_prompt(prompts, out_lens) == 1
        assert sample_rows(prompts, out_lens) == list(prompts)
        assert seqs_limit(argparse.Namespace(max_num_seqs=None), name) == 256
    assert seqs_limit(argparse.Namespace(max_num_seqs=48), "G") == 48
    a, _ = workload("A", "tiny", 512)
    b, _ = workload("A", "tiny", 512)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))  # seeded
