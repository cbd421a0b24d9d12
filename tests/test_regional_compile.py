"""Regional torch.compile (`rayrl.train.regional_compile`, `use_torch_compile`): the
compiled layers and head compute what the eager ones do, generation through a compiled
model stays eager, and a CPU run never compiles unless asked.

The compiled paths run here on a CPU (inductor's C++ backend) with ``on_cpu=True``; on
a GPU the same functions go to Triton (measured in bench/profile_update.py)."""

from __future__ import annotations

import pytest
import torch

from engine_cases import ragged_batch, tiny_model_dir  # noqa: F401 (fixture)
from rayrl.batch import Batch
from rayrl.config.schema import ActorConfig
from rayrl.train.engine import TrainEngine
from rayrl.train.logprob_head import LogProbHead
from rayrl.train.regional_compile import compile_regions, compiled_chunk_math
from rayrl.workers.losses import actor_loss_fn

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_head_with_compiled_math_gives_the_same_gradients():
    torch.manual_seed(1)
    head = LogProbHead(16, 40)
    h = torch.randn(1, 29, 16, requires_grad=True)
    labels = torch.randint(0, 40, (1, 29))
    results = []
    for math in (None, compiled_chunk_math()):
        head.chunk_math = math
        with head.requested(labels, 0.9, with_entropy=True, chunk_size=8):  # 8 chunks 29
            out = head(h)
        loss = (out[..., 0] * 0.3 + out[..., 1] * 0.7).sum()
        results.append((out.detach(), *torch.autograd.grad(loss, [h, head.weight])))
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want)
    assert results[1][0].abs().sum() > 0


CUDA = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("device", "attention_in_graph"),
    [("cpu", True), ("cpu", False), pytest.param("cuda", True, marks=CUDA)],
)
def test_compiled_engine_trains_like_the_eager_one(tiny_model_dir, device, attention_in_graph):  # noqa: F811
    """Packed micro-batches of ragged rows, entropy on: the same log-probs, loss and
    gradient norm over two steps; and `generate` (a KV cache: the eager layers) makes
    the same tokens. Attention traced into the layer's graph or left out of it; on
    CUDA the flash varlen kernel inside the compiled graph, in bf16 (hence looser
    tolerances there)."""
    tol = {"atol": 1e-5, "rtol": 1e-5} if device == "cpu" else {"atol": 2e-2, "rtol": 2e-2}
    batch = ragged_batch(8, seed=3)
    actor = ActorConfig(
        use_kl_loss=False, entropy_coeff=0.01, clip_ratio_low=0.2, clip_ratio_high=0.2
    )
    loss_fn = actor_loss_fn(actor, 10)
    runs = []
    for compiled in (False, True):
        engine = TrainEngine(tiny_model_dir, optim={"lr": 1e-3}, total_steps=4, device=device)
        if compiled:
            assert compile_regions(
                engine.model, engine.device, on_cpu=True, attention_in_graph=attention_in_graph
            )
        old = engine.forward(batch, max_tokens_per_micro_batch=64, with_entropy=True)
        rows = batch.union(Batch({"old_log_probs": old["log_probs"]}))
        steps = [
            engine.train_step(rows, loss_fn, max_tokens_per_micro_batch=64, with_entropy=True)
            for _ in range(2)
        ]
        prompt = torch.arange(3, 15, device=engine.device).view(2, 6)
        with torch.no_grad():
            tokens = engine.model.generate(prompt, max_new_tokens=5, do_sample=False)
        runs.append((old, steps, tokens))
    (old_e, steps_e, tok_e), (old_c, steps_c, tok_c) = runs
    torch.testing.assert_close(old_c["log_probs"], old_e["log_probs"], **tol)
    torch.testing.assert_close(old_c["entropy"], old_e["entropy"], **tol)
    rel = 1e-4 if device == "cpu" else 2e-2
    for a, b in zip(steps_c, steps_e, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=rel, abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=rel)
    if device == "cpu":  # bf16 on CUDA: a near-tie may round the other way
        assert torch.equal(tok_c, tok_e)


def test_cpu_engines_do_not_compile_by_default(tiny_model_dir):  # noqa: F811
    engine = TrainEngine(tiny_model_dir, device="cpu", torch_compile=True)
    assert engine.compiled is False
    assert not compile_regions(engine.model, engine.device)


@pytest.mark.slow
def test_the_compiled_layer_takes_new_micro_batch_shapes_without_recompiling(tiny_model_dir):  # noqa: F811
    """Micro-batches of other row counts, lengths and sequence counts reuse the decoder
    layer's first compile: its rows, tokens and sequence boundaries are dynamic from
    the start (the model's own sizes stay constants of the kernels)."""
    torch._dynamo.reset()
    engine = TrainEngine(tiny_model_dir, optim={"lr": 1e-3}, total_steps=4, device="cpu")
    assert compile_regions(engine.model, engine.device, on_cpu=True)
    for i, (rows, prompt, response) in enumerate(((4, 12, 10), (6, 9, 7), (3, 20, 13))):
        engine.forward(
            ragged_batch(rows, prompt_len=prompt, response_len=response, seed=i),
            max_tokens_per_micro_batch=64,
        )
    layer_forward = type(engine.model.model.layers[0]).forward.__code__
    assert _compiles_of(layer_forward) == 1


def _compiles_of(code) -> int:
    """How many compiled entries dynamo holds for a function's code object."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(code))
