"""`bench/gpu_e2e.py`'s JSON lines: a system's figures for one batch size, and the
GRPO step's roofline (`bench/roofline.py`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from roofline import Card, grpo_step_seconds, shared_prompt_savings


def roofline_of(
    model_dir: Path, seqs: int, args: argparse.Namespace, res: dict, card: Card | None
) -> dict:
    """``roofline_step_s`` (with its generation and training parts) and
    ``step_vs_roofline`` of a rayrl result on ``card`` (None: a CPU run, {}); training
    at the card's dense bf16 peak (`peak_flops`), else at its measured matmul rate.
    The forward passes that ran (old log-probs, reference) count in the training part."""
    from transformers import AutoConfig

    from rayrl.models.flops import peak_flops

    if card is None or not res.get("step_s"):
        return {}
    peak = peak_flops(card.name) or card.matmul_flops
    stages = res.get("stages", {})
    passes = sum(1 for s in ("old_log_prob", "ref") if (stages.get(s) or 0) > 0)
    found = grpo_step_seconds(
        AutoConfig.from_pretrained(model_dir),
        seqs,
        args.prompt_len,
        res.get("response_len") or args.response_len,
        peak,
        forward_passes=passes,
        card=card,
    )
    saved = shared_prompt_savings(
        AutoConfig.from_pretrained(model_dir), seqs, args.group, args.prompt_len, peak, passes
    )
    shared = found["roofline_step_s"] - saved
    return {
        **found,
        "step_vs_roofline": res["step_s"] / found["roofline_step_s"],
        # the same step's roofline with each prompt trained once for its group
        "roofline_step_shared_s": shared,
        "step_vs_roofline_shared": res["step_s"] / shared,
    }


def _with_steps(line: dict, values: list[float] | None) -> dict:
    """``line`` with ``per_step`` (each measured step's value) where there are any."""
    return {**line, "per_step": values} if values else line


def lines_for(system: str, seqs: int, res: dict, common: dict) -> list[dict]:
    base = {**common, "system": system, "seqs_per_step": seqs}
    if "error" in res:
        return [{**base, "metric": "error", "value": None, "unit": "", "error": res["error"]}]
    each = res.get("per_step", {})
    step = {**base, "metric": "step_s", "value": res["step_s"], "unit": "s", "better": "lower"}
    out = [
        _with_steps(step, each.get("step")),
        {
            **base,
            "metric": "tokens_per_s_per_gpu",
            "value": res["tokens_per_s"],
            "unit": "tokens/s",
            "better": "higher",
        },
        {
            **base,
            "metric": "peak_mem_gb",
            "model": common["model_name"],
            "value": res["peak_mem_gb"],
            "unit": "GiB",
            "better": "lower",
        },
        {
            **base,
            "metric": "grad_norm_finite",
            "value": int(res["grad_finite"]),
            "unit": "bool",
            "target": 1,
            "better": "higher",
            "grad_norms": res["grad_norms"],
        },
        {**base, "metric": "response_length", "value": res.get("response_len"), "unit": "tokens"},
    ]
    for stage, value in res.get("stages", {}).items():
        if value is not None:
            line = {**base, "metric": "stage_s", "stage": stage, "value": value, "unit": "s"}
            out.append(_with_steps(line, each.get(stage)))
    if res.get("mfu") is not None:
        out.append(
            {
                **base,
                "metric": "actor_mfu",
                "value": res["mfu"],
                "unit": "fraction",
                "target": 0.4,
                "better": "higher",
            }
        )
    sync = res.get("stages", {}).get("weight_sync")
    if sync:
        out.append(
            {
                **base,
                "metric": "weight_sync_ms",
                "value": sync * 1e3,
                "unit": "ms",
                "target": 100,
                "better": "lower",
            }
        )
    if res.get("roofline_step_s"):
        parts = {k: round(res[k], 4) for k in ("roofline_gen_s", "roofline_train_s")}
        out.append(
            {**base, "metric": "roofline_step_s", "value": res["roofline_step_s"], "unit": "s"}
            | parts
        )
        out.append(
            {
                **base,
                "metric": "step_vs_roofline",
                "value": res["step_vs_roofline"],
                "unit": "x",
                "target": 2.0,
                "better": "lower",
            }
        )
        out.append(
            {
                **base,
                "metric": "step_vs_roofline_shared",
                "value": res["step_vs_roofline_shared"],
                "unit": "x",
                "roofline_step_shared_s": round(res["roofline_step_shared_s"], 4),
                "better": "lower",
            }
        )
    return out
