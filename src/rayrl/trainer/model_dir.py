"""The model a run starts from: the configured directory, or the tiny demo model.

With no model path, `rayrl train` and `rayrl sft` build the tiny Qwen2 demo model
(random weights from the run's seed, a trained tokenizer) under the run directory once
and reuse it on later runs.
"""

from __future__ import annotations

from pathlib import Path

from rayrl.trainer.run_dir import RunDirError

DEMO_MODEL = {"layers": 2, "hidden": 64}


def model_dir(path: str | None, output_dir: str | Path, seed: int) -> str:
    """`path`, or `<output_dir>/tiny-model` (built on first use)."""
    from rayrl.models import build_tiny_model

    if path:
        return path
    out = Path(output_dir) / "tiny-model"
    if not (out / "config.json").is_file():
        try:
            build_tiny_model(out, **DEMO_MODEL, seed=seed, overwrite=True)
        except OSError as err:
            raise RunDirError(
                f"cannot build the demo model in the run directory trainer.output_dir="
                f"{output_dir}: {err.strerror or err} ({err.filename or out}); set "
                "trainer.output_dir to a directory this user can write, or give a model "
                "(actor_rollout_ref.model.path)"
            ) from None
    return str(out)
