"""bench/roofline.py: the GRPO step at the hardware's limits, which `bench/gpu_e2e.py`
divides the measured step by (`step_vs_roofline`, issue 26)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from gpu_e2e_report import lines_for, roofline_of  # noqa: E402
from rayrl.models.flops import peak_flops  # noqa: E402
from rayrl.models.tiny import reference_05b  # noqa: E402
from roofline import (  # noqa: E402
    Card,
    card_for,
    flop_model,
    generation_seconds,
    grpo_step_seconds,
    measure_card,
    resolve_card,
    training_seconds,
)

H200 = peak_flops("NVIDIA H200")
H200_CARD = card_for("NVIDIA H200")


def test_the_reference_step_at_the_roofline_is_about_a_second():
    """512 x (256 + 256) tokens of the reference shape: training at the dense peak is
    the 0.69 s the issue derives from perf/mfu/actor's FLOP count; generation of 131k
    tokens in batches of 512 is bandwidth-bound, a little under workload A's 0.38 s."""
    found = grpo_step_seconds(reference_05b().to_config(), 512, 256, 256, H200, card=H200_CARD)
    assert found["roofline_train_s"] == pytest.approx(0.695, rel=0.01)
    assert 0.25 < found["roofline_gen_s"] < 0.38
    assert found["roofline_step_s"] == pytest.approx(
        found["roofline_gen_s"] + found["roofline_train_s"]
    )


def test_one_sequence_decodes_at_the_weights_bandwidth():
    """A single short sequence: each decode step reads every bf16 weight once."""
    config = reference_05b().to_config()
    sizes = flop_model(config)  # the layers' weights and the head's, as perf/mfu counts them
    weights = 2 * (sizes.body_params + sizes.head_params)
    for card in (H200_CARD, card_for("NVIDIA H100 80GB HBM3")):
        seconds = generation_seconds(config, [range(1)], [100], card)
        per_token = seconds / 100
        assert per_token == pytest.approx(weights / card.hbm_bytes_per_s, rel=0.05)


def test_forward_passes_add_a_third_of_the_update_each():
    config = reference_05b().to_config()
    update = training_seconds(config, [512] * 8, 8 * 256, H200)
    with_two = training_seconds(config, [512] * 8, 8 * 256, H200, forward_passes=2)
    assert with_two == pytest.approx(update * 5 / 3)


def test_gpu_e2e_reports_the_step_over_its_roofline(tmp_path):
    reference_05b().to_config().save_pretrained(tmp_path)
    args = argparse.Namespace(prompt_len=256, response_len=256, group=8)
    res = {
        "step_s": 3.0,
        "tokens_per_s": 1.0,
        "peak_mem_gb": 1.0,
        "grad_finite": True,
        "grad_norms": [0.1],
        "response_len": 256.0,
        "stages": {"old_log_prob": 0.0, "gen": 1.0},
    }
    res.update(roofline_of(tmp_path, 512, args, res, H200_CARD))
    lines = {
        line["metric"]: line
        for line in lines_for("rayrl", 512, res, {"bench": "t", "model_name": "0.5b"})
    }
    ratio = lines["step_vs_roofline"]
    assert ratio["value"] == pytest.approx(3.0 / lines["roofline_step_s"]["value"])
    assert ratio["target"] == 2.0 and ratio["better"] == "lower"
    # with each prompt trained once for its 8 rows: 7/8 of the prompts' body FLOPs less
    shared = lines["step_vs_roofline_shared"]
    saved = lines["roofline_step_s"]["value"] - shared["roofline_step_shared_s"]
    body = 358_000_000  # about, for the 0.5B shape's layers
    assert saved == pytest.approx(6 * body * 448 * 256 / 989e12, rel=0.05)
    assert shared["value"] == pytest.approx(3.0 / shared["roofline_step_shared_s"], rel=1e-3)
    assert roofline_of(tmp_path, 512, args, res, None) == {}
    # on an H100 the decode-bound generation takes longer (3.03 vs 4.3 TB/s)
    h100 = roofline_of(tmp_path, 512, args, res, card_for("NVIDIA H100 80GB HBM3"))
    assert h100["roofline_gen_s"] > res["roofline_gen_s"]


def test_the_card_table_by_device_name():
    """torch.cuda.get_device_name() spellings: the H200's reference figures measured on
    the lent one, the H100 SXM's measured on a lent H100 (3.03 TB/s, 783 TFLOP/s), the
    PCIe H100 apart (its spec)."""
    h200 = card_for("NVIDIA H200")
    assert (h200.hbm_bytes_per_s, h200.matmul_flops) == (4.3e12, 790e12)
    assert "measured on the lent H200" in h200.source
    sxm = card_for("NVIDIA H100 80GB HBM3")
    assert (sxm.hbm_bytes_per_s, sxm.matmul_flops) == (3.03e12, 783e12)
    assert sxm.name == "NVIDIA H100 80GB HBM3" and "lent H100" in sxm.source
    assert card_for("NVIDIA H100 PCIe").hbm_bytes_per_s == 2.0e12
    assert card_for("NVIDIA A10G") is None
    assert resolve_card("NVIDIA H200") == h200  # known: the table, nothing measured


def test_a_bench_line_records_the_card_and_its_figures():
    fields = card_for("NVIDIA H100 80GB HBM3").fields()
    assert fields["gpu"] == "NVIDIA H100 80GB HBM3"
    assert fields["roofline_card"]["hbm_bytes_per_s"] == 3.03e12
    assert set(fields["roofline_card"]) == {"name", "hbm_bytes_per_s", "matmul_flops", "source"}


def test_the_probe_measures_a_copy_and_a_product(monkeypatch):
    """The probe's arithmetic on a CPU, at small sizes (the figures mean nothing there);
    an unknown card is measured and says so."""
    card = measure_card("cpu", copy_bytes=2**20, matmul_n=64)
    assert card.hbm_bytes_per_s > 0 and card.matmul_flops > 0 and "measured" in card.source
    import roofline

    monkeypatch.setattr(roofline, "measure_card", lambda device: Card("x", 1.0, 2.0, "measured"))
    unknown = resolve_card("NVIDIA A10G")
    assert (unknown.name, unknown.hbm_bytes_per_s) == ("NVIDIA A10G", 1.0)
    assert "not in the table" in unknown.source


def test_every_emitted_line_names_its_card(capsys):
    import json

    from _common import emit_line

    emit_line("b", "m", 1.0, "s")  # CUDA unused here: no card
    emit_line("b", "m", 1.0, "s", gpu="NVIDIA H100 80GB HBM3")
    first, second = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert first["gpu"] is None and second["gpu"] == "NVIDIA H100 80GB HBM3"


def test_a_mixture_of_experts_decode_reads_the_experts_its_batch_touches():
    """Qwen3-30B-A3B's layer: one token reads its 8 of 128 experts, a batch of 256 reads
    every expert (1 - (15/16)^256 of them), so the physical decode limit ("touched") sits
    far below the active-parameter one at that batch and meets it at one token; a
    dense model has no difference between the two."""
    from rollout_models import moe_config

    config = moe_config()
    one = ([range(256)], [64])
    batch = ([range(1)] * 256, [256] * 256)  # decode, the prefill a token each
    touched_1 = generation_seconds(config, *one, H200_CARD)
    active_1 = generation_seconds(config, *one, H200_CARD, experts="active")
    assert touched_1 == pytest.approx(active_1, rel=1e-9)  # 8 of 128 either way
    touched = generation_seconds(config, *batch, H200_CARD)
    active = generation_seconds(config, *batch, H200_CARD, experts="active")
    # 8 layers x 128 experts x 3 x 2048 x 768 bf16: 9.7 GB a step; active ones 0.6 GB
    assert touched > 4 * active
    dense = reference_05b().to_config()
    assert generation_seconds(dense, *batch, H200_CARD) == generation_seconds(
        dense, *batch, H200_CARD, experts="active"
    )
