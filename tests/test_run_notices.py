"""Silent fallbacks said once at the start of a run: no validation for a run on files
of its own without data.val_files, and prompts cut by data.truncation=left|right."""

from __future__ import annotations

from types import SimpleNamespace

from rayrl.config import load_config
from rayrl.trainer.data import no_validation_notice, truncation_notes


def test_a_run_on_its_own_files_without_val_files_says_it_does_not_validate():
    own = load_config("grpo", ["data.train_files=/data/train.parquet", "trainer.test_freq=5"])
    assert "no validation: data.val_files is not set" in no_validation_notice(own)
    before = load_config("grpo", ["data.train_files=/data/train.parquet"])
    assert before.trainer.val_before_train and no_validation_notice(before)
    with_val = load_config(
        "grpo", ["data.train_files=/data/train.parquet", "data.val_files=/data/val.parquet"]
    )
    assert no_validation_notice(with_val) is None
    synthetic = load_config("grpo", [])  # its held-out split validates
    assert no_validation_notice(synthetic) is None
    never = load_config(
        "grpo",
        [
            "data.train_files=/data/train.parquet",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
        ],
    )
    assert no_validation_notice(never) is None


def test_truncated_prompts_are_counted_in_one_line_per_split():
    cfg = load_config("grpo", ["data.truncation=left", "data.max_prompt_length=64"])
    data = SimpleNamespace(
        dataset=SimpleNamespace(truncated=3, total_rows=40),
        val=SimpleNamespace(truncated=0, total_rows=8),
    )
    assert truncation_notes(data, cfg.data) == [
        "NOTE: data.truncation=left cut 3 of 40 train prompts to data.max_prompt_length=64 "
        "tokens (their start dropped)"
    ]
    data.val = None
    data.dataset.truncated = 0
    assert truncation_notes(data, cfg.data) == []


def test_a_run_message_quoting_brackets_prints_as_it_is():
    """A replica lost mid-broadcast: the run's message quotes gloo's error, whose
    `[/.../pair.cc:553]` rich would read as a closing tag and fail on (the run died)."""
    import io

    from rich.console import Console

    from rayrl.cli.common import plain_printer

    out = io.StringIO()
    text = "lost: [/__w/pytorch/third_party/gloo/pair.cc:553] Connection closed [bold]x"
    plain_printer(Console(file=out, width=200))(text)
    assert out.getvalue().strip() == text
