"""A vision-language model on FSDP2 over two real processes (gloo), one rank's rows with
images and the other's text only: every micro-batch runs the vision tower on both ranks
(a blank image where a rank has none), so the ranks' collectives match and nothing
hangs; the log-probs are the one-process engine's, and the vision tower learns unless
frozen."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from rayrl.train.engine import TrainEngine
from vision_cases import mixed_rows, prompts, samples, sharp_vision_model

pytestmark = pytest.mark.slow

ROWS = [[0, 2], [1, 1]]  # rank 0: the rows with images; rank 1: the text row, twice
OPTIM = {"lr": 1e-2}


def _batch(model_dir: Path):
    _, prompt_batch = prompts(model_dir, mixed_rows())
    responses = torch.randint(0, 500, (3, 6), generator=torch.Generator().manual_seed(0))
    return samples(prompt_batch, responses, [6, 4, 5])


def _loss(outputs: dict, micro) -> tuple[torch.Tensor, dict]:
    return -(outputs["log_probs"] * micro["response_mask"]).sum() / 16, {}


def _worker(rank: int, init: str, model_dir: str, out: str, frozen: bool) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    try:
        engine = TrainEngine(model_dir, device="cpu", optim=OPTIM, freeze_vision_tower=frozen)
        rows = _batch(Path(model_dir)).index(ROWS[rank])
        before = engine.forward(rows, micro_batch_size=1)["log_probs"]
        tower = [p.full_tensor().clone() for p in engine.model.model.visual.parameters()]
        engine.train_step(rows, _loss, micro_batch_size=1)
        after = [p.full_tensor() for p in engine.model.model.visual.parameters()]
        moved = any(not torch.equal(a, b) for a, b in zip(tower, after, strict=True))
        torch.save({"before": before, "moved": moved}, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
def test_two_ranks_with_and_without_images_step_together(tmp_path, frozen):
    model_dir = sharp_vision_model(tmp_path)
    init = tmp_path / f"init-{os.getpid()}"
    mp.spawn(_worker, args=(str(init), str(model_dir), str(tmp_path), frozen), nprocs=2)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    alone = TrainEngine(model_dir, device="cpu").forward(_batch(model_dir), micro_batch_size=1)
    for rank, result in enumerate(results):
        expected = alone["log_probs"][ROWS[rank]]
        assert torch.allclose(result["before"], expected, atol=1e-5), rank
        assert result["moved"] != frozen  # the same on both ranks: one model
