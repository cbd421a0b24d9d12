"""The bodies of `test_expert_parallel`'s gloo runs (imported by name in each spawned
process): the differentiable all-to-all alone, one MoE block under expert parallelism
against transformers' own, and a training step of the engine under each EP layout."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist

from engine_cases import OPTIM, pg_loss
from parallel_cases import BUDGET, LENGTHS, batch, record_gradients
from rayrl.train.all_to_all import AllToAll

# 2 ranks: ep=2; 4 ranks: ep=2 x edp=2 and ep=4 (the tiny model has 4 experts)
LAYOUTS = {2: {"ep2": 2}, 4: {"ep2_dp2": 2, "ep4": 4}}


def _init(rank: int, world: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)


class MisorderedBackward(AllToAll):
    """A wrong backward: the reverse exchange, but of the rows in reverse order."""

    @staticmethod
    def backward(ctx, grad):
        return AllToAll.backward(ctx, grad.flip(0))


def check_all_to_all(fn, rank: int, world: int) -> None:
    """Rows sent with uneven splits arrive where they should, and each row's gradient
    returns to the rank and position it left from."""
    g = torch.Generator().manual_seed(7)
    splits = torch.randint(0, 4, (world, world), generator=g)  # splits[src, dst]
    rows = [torch.randn(int(splits[r].sum()), 3, generator=g) for r in range(world)]
    weights = [torch.randn(int(splits[:, r].sum()), 3, generator=g) for r in range(world)]
    x = rows[rank].clone().requires_grad_(True)
    y = fn.apply(x, splits[:, rank].tolist(), splits[rank].tolist(), None)
    expected = torch.cat([rows[s].split(splits[s].tolist())[rank] for s in range(world)])
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    (y * weights[rank]).sum().backward()
    # row i of rank r went to rank d at some position: its gradient is that weight
    grad = [w.split(splits[:, d].tolist()) for d, w in enumerate(weights)]
    want = torch.cat([grad[d][rank] for d in range(world)])
    torch.testing.assert_close(x.grad, want, rtol=0, atol=0)


def all_to_all_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    _init(rank, world, init_file)
    try:
        check_all_to_all(AllToAll, rank, world)
        try:
            check_all_to_all(MisorderedBackward, rank, world)
            broken = "passed"
        except (AssertionError, RuntimeError) as err:
            broken = type(err).__name__
        torch.save({"broken": broken}, Path(out_dir) / f"a2a{rank}.pt")
    finally:
        dist.destroy_process_group()


def block_worker(rank: int, world: int, init_file: str, model_dir: str, out_dir: str) -> None:
    """Layer 0's MoE block, experts split over all ranks, on this rank's tokens; the
    reference runs every rank's tokens through transformers' block."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from rayrl.train.expert_parallel import expert_parallel

    _init(rank, world, init_file)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        block = model.model.layers[0].mlp
        ep_block = copy.deepcopy(block)
        grid = init_device_mesh("cpu", (1, world), mesh_dim_names=("edp", "ep"))
        expert_parallel(ep_block.experts, grid["ep"])
        g = torch.Generator().manual_seed(11)
        hidden = [
            torch.randn(1, 5 + 3 * r, model.config.hidden_size, generator=g) for r in range(world)
        ]
        every = torch.cat(hidden, dim=1).requires_grad_(True)
        mine = hidden[rank].clone().requires_grad_(True)
        ref, out = block(every), ep_block(mine)
        start = sum(h.shape[1] for h in hidden[:rank])
        ref_mine = ref[:, start : start + mine.shape[1]]
        ref.pow(2).sum().backward()
        out.pow(2).sum().backward()
        router_grad = ep_block.gate.weight.grad.clone()  # this rank's tokens' share
        dist.all_reduce(router_grad)
        flat = mine.view(-1, mine.shape[-1])
        _, w, idx = ep_block.gate(flat)
        unweighted = ep_block.experts(flat, idx, torch.ones_like(w))
        result = {
            "out": (out.detach(), ref_mine.detach()),
            "unweighted": (unweighted.detach().view_as(out), ref_mine.detach()),
            "input_grad": (mine.grad, every.grad[:, start : start + mine.shape[1]]),
            "router_grad": (router_grad, block.gate.weight.grad),
            "experts_grad": {  # 1/ep of the sum (for FSDP's average over the edp ranks)
                n: (
                    getattr(ep_block.experts, n).grad.full_tensor() * world,
                    getattr(block.experts, n).grad,
                )
                for n in ("gate_up_proj", "down_proj")
            },
        }
        torch.save(result, Path(out_dir) / f"block{rank}.pt")
    finally:
        dist.destroy_process_group()


def engine_worker(rank: int, world: int, init_file: str, model_dir: str, out_dir: str) -> None:
    """One training step of the engine per EP layout: gradients, metrics, weights after."""
    from rayrl.train.engine import TrainEngine

    _init(rank, world, init_file)
    out: dict = {}
    try:
        for name, ep in LAYOUTS[world].items():
            engine = TrainEngine(model_dir, optim=OPTIM, expert_parallel_size=ep)
            rows = list(range(engine.dp_rank, len(LENGTHS), engine.dp_size))
            grads = record_gradients(engine)
            metrics = engine.train_step(
                batch().index(rows), pg_loss, max_tokens_per_micro_batch=BUDGET
            )
            forward = engine.forward(batch().index(rows), micro_batch_size=3)
            out[name] = {
                "rows": rows,
                "metrics": metrics,
                "grads": grads,
                "forward": forward.tensors,
                "weights": engine.full_state_dict(),
                "ep": engine.mesh.experts[0].size(),
                "local_experts": engine.model.model.layers[0]
                .mlp.experts.gate_up_proj.to_local()
                .shape,
            }
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
