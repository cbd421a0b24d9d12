"""The native engine's Triton kernels against their torch references, in Triton's CPU
interpreter (``TRITON_INTERPRET=1``). Skipped where Triton is not installed (CI: it is not
a dependency); bfloat16 is checked on the GPU by bench/rollout_check.py, since the
interpreter has no bfloat16 arithmetic."""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available():  # the interpreter would take over every kernel of the process
    pytest.skip(
        "interpreter tests; on a GPU the kernels run for real in the native engine's CUDA "
        "tests (tests marked cuda) and bench/rollout_check.py",
        allow_module_level=True,
    )
os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
triton = pytest.importorskip("triton")

import numpy as np  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton was imported without TRITON_INTERPRET=1 before this module")
    import triton.runtime.interpreter as interp

    original = interp._patch_lang_tensor

    def patched(tensor, scope):  # the interpreter's __index__ breaks on numpy 2 arrays
        original(tensor, scope)
        scope.set_attr(
            tensor, "__index__", lambda self: int(np.asarray(self.handle.data).ravel()[0])
        )

    interp._patch_lang_tensor = patched
    yield
    interp._patch_lang_tensor = original


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_elementwise_kernels(dtype):
    from rayrl.rollout.native.ops import TorchOps
    from rayrl.rollout.native.triton_ops import TritonOps

    torch.manual_seed(0)
    ref, tri = TorchOps(), TritonOps()
    exact = dtype != torch.float32  # float32 differs by fused multiply-adds only
    x, r, w = (
        torch.randn(5, 48, dtype=dtype),
        torch.randn(5, 48, dtype=dtype),
        torch.randn(48, dtype=dtype),
    )
    (a, ar), (b, br) = (
        ref.add_rms_norm(x, r.clone(), w, 1e-6),
        tri.add_rms_norm(x, r.clone(), w, 1e-6),
    )
    assert torch.equal(ar, br)
    torch.testing.assert_close(b, a, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-5)
    gu = torch.randn(5, 80, dtype=dtype)
    torch.testing.assert_close(
        tri.silu_and_mul(gu),
        ref.silu_and_mul(gu),
        rtol=0 if exact else 1e-5,
        atol=0 if exact else 1e-6,
    )
    heads, kv_heads, dim = 6, 2, 16
    qkv = torch.randn(7, (heads + 2 * kv_heads) * dim, dtype=dtype)
    pos, slots = torch.tensor([0, 3, 5, 9, 1, 2, 20]), torch.tensor([0, 5, 7, 12, -1, 30, 39])
    cos, sin = torch.randn(32, dim), torch.randn(32, dim)
    for norm in (None, (torch.randn(dim, dtype=dtype), torch.randn(dim, dtype=dtype), 1e-6)):
        caches = [torch.zeros(10, 4, kv_heads, dim, dtype=dtype) for _ in range(4)]
        qa = ref.rope_and_store(
            qkv, pos, cos, sin, caches[0], caches[1], slots, (heads, kv_heads, dim), norm
        )
        qb = tri.rope_and_store(
            qkv, pos, cos, sin, caches[2], caches[3], slots, (heads, kv_heads, dim), norm
        )
        tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-5}
        torch.testing.assert_close(qb, qa, **tol)
        torch.testing.assert_close(caches[2], caches[0], **tol)
        assert torch.equal(caches[3], caches[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("offset", "in_float"),
    [(0.0, True), (1.0, True), (1.0, False)],
    ids=["olmo2", "gemma", "offset"],
)
def test_styled_norms_and_the_gelu_gate(dtype, offset, in_float):
    """OLMo 2's and Gemma's norms (in float32, Gemma's weight offset by 1) and Gemma's
    GELU gate in one kernel each, as the torch ops compute them."""
    from rayrl.rollout.native.ops import TorchOps
    from rayrl.rollout.native.triton_ops import TritonOps

    torch.manual_seed(2)
    ref, tri = TorchOps(), TritonOps()
    exact = dtype != torch.float32
    tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-5}
    x, r, w = torch.randn(5, 48, dtype=dtype), torch.randn(5, 48, dtype=dtype), torch.randn(48)
    w = w.to(dtype)
    style = {"offset": offset, "in_float": in_float}
    torch.testing.assert_close(
        tri.rms_norm(x, w, 1e-6, **style), ref.rms_norm(x, w, 1e-6, **style), **tol
    )
    (a, ar), (b, br) = (
        ref.add_rms_norm(x, r.clone(), w, 1e-6, **style),
        tri.add_rms_norm(x, r.clone(), w, 1e-6, **style),
    )
    assert torch.equal(ar, br)
    torch.testing.assert_close(b, a, **tol)
    gu = torch.randn(5, 80, dtype=dtype) * 3
    for approximate in ("tanh", "none"):
        torch.testing.assert_close(
            tri.gelu_and_mul(gu, approximate),
            ref.gelu_and_mul(gu, approximate),
            rtol=1e-3 if exact else 1e-5,  # one rounding step apart at most
            atol=1e-3 if exact else 1e-6,
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_paged_attention_kernels(dtype, monkeypatch):
    import rayrl.rollout.native.triton_attention as ta
    from rayrl.rollout.native.attention import TorchAttention
    from rayrl.rollout.native.step import PREFILL_TILE, StepInput

    monkeypatch.setitem(ta.DECODE_CONFIG, "BLOCK_N", 16)
    torch.manual_seed(1)
    heads, kv_heads, dim = 6, 2, 16
    kc = torch.randn(40, 4, kv_heads, dim, dtype=dtype)
    vc = torch.randn_like(kc)
    table = torch.randperm(40).reshape(4, 10).int()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    q = torch.randn(4, heads, dim, dtype=dtype)
    step = StepInput(
        None,
        None,
        None,
        torch.tensor([2, 0, 3, 1]),
        torch.tensor([1, 7, 33, 40]),
        table,
        None,
        decode=True,
    )
    expected = TorchAttention.decode(q, kc, vc, step, 0.25)
    for splits in (1, 3):
        got = ta.TritonAttention(block_n=16).decode(q, kc, vc, step, 0.25, splits=splits)
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
    q_lens, totals = [5, 9, 10], [5, 16, 40]  # no prefix, then prefixes of 7 and 30 tokens
    starts = [0, *np.cumsum(q_lens).tolist()]
    q = torch.randn(starts[-1], heads, dim, dtype=dtype)
    tiles = torch.tensor(
        [(i, a) for i in range(3) for a in range(0, q_lens[i], PREFILL_TILE)], dtype=torch.int32
    )
    step = StepInput(
        None,
        None,
        None,
        torch.tensor([1, 3, 0]),
        torch.tensor(totals),
        table,
        None,
        decode=False,
        q_start=torch.tensor(starts),
        q_start_host=starts,
        seq_lens_host=totals,
        tiles=tiles,
    )
    got = ta.TritonAttention(block_n=16).prefill(q, kc, vc, step, 0.25)
    torch.testing.assert_close(
        got, TorchAttention.prefill(q, kc, vc, step, 0.25), rtol=tol, atol=tol
    )


@pytest.mark.parametrize(
    "slice_, block, margin",
    [(1024, 256, None), (256, 256, 1e9), (1024, 256, 1e9)],
    ids=["one-candidate", "many-candidates", "exact-pass"],
)
def test_fused_sampler_draws_the_reference_tokens(monkeypatch, slice_, block, margin):
    """Each way the kernel finds a slice's winner: one candidate lane (the common case),
    several candidate lanes (a huge margin, one token per lane), and the exact float64
    pass when a lane holds two candidates (a huge margin, four tokens per lane)."""
    import rayrl.rollout.native.triton_sampler as ts
    from rayrl.rollout.sampling import SamplingParams, reference_sample_tokens, sample_keys

    monkeypatch.setattr(ts, "_SLICE", slice_)  # several slices (and blocks) per row
    monkeypatch.setattr(ts, "_BLOCK", block)
    if margin is not None:
        monkeypatch.setattr(ts, "_MARGIN", margin)
    keys = sample_keys(0, 3, [f"u{i}" for i in range(4)])
    positions = torch.arange(4)
    gen = torch.Generator().manual_seed(2)
    for scale in (0.5, 4.0):
        logits = torch.randn(4, 2500, generator=gen) * scale
        logits[1, 7] = float("-inf")
        for params in (
            SamplingParams(do_sample=False),
            SamplingParams(temperature=0.7),
            SamplingParams(temperature=1.0),
        ):
            tokens, log_probs = ts.fused_sample(logits, keys, positions, params)
            ref_tokens, ref_log_probs = reference_sample_tokens(logits, keys, positions, params)
            assert torch.equal(tokens, ref_tokens), (scale, params)
            torch.testing.assert_close(log_probs, ref_log_probs, atol=1e-5, rtol=1e-5)
