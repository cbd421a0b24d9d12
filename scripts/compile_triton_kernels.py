"""Compile every Triton kernel of the native rollout engine for Hopper (sm_90), on any machine.

Triton's CPU interpreter runs the kernels' arithmetic but skips the compiler's checks
(a global that is not a constexpr, a variable retyped in a branch); this compiles each
kernel, for each dtype and flag it is launched with, to PTX without a GPU, so those
errors show before any GPU time is spent. Exit status 1 if any kernel fails.

    python scripts/compile_triton_kernels.py
"""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from rayrl.rollout.native import triton_attention as ta  # noqa: E402
from rayrl.rollout.native import triton_ops as to  # noqa: E402
from rayrl.rollout.native import triton_sampler as ts  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def compile_kernel(kernel, types: dict[str, str], constants: dict[str, object]) -> None:
    names = kernel.arg_names
    signature = {n: types.get(n, "constexpr" if n in constants else "i64") for n in names}
    constexprs = {(names.index(n),): v for n, v in constants.items()}
    triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=TARGET)


def cases():
    for dt in ("bf16", "fp32"):
        ptr = f"*{dt}"
        yield (
            "rms_norm",
            to._rms_norm_kernel,
            {"X": ptr, "R": ptr, "W": ptr, "Y": ptr, "eps": "fp32"},
            {"HAS_RESIDUAL": True, "BLOCK": 1024},
        )
        yield "silu_mul", to._silu_mul_kernel, {"GU": ptr, "OUT": ptr}, {"BLOCK": 1024}
        for norm in (False, True):
            rope = {
                "QKV": ptr,
                "POS": "*i64",
                "COS": "*fp32",
                "SIN": "*fp32",
                "QOUT": ptr,
                "KC": ptr,
                "VC": ptr,
                "SLOTS": "*i64",
                "QNW": ptr,
                "KNW": ptr,
                "eps": "fp32",
            }
            yield (
                f"rope norm={norm}",
                to._rope_store_kernel,
                rope,
                {
                    "HEADS": 14,
                    "KV_HEADS": 2,
                    "H_PAD": 16,
                    "KV_PAD": 2,
                    "D": 64,
                    "HAS_QK_NORM": norm,
                },
            )
        attn = {
            "Q": ptr,
            "K": ptr,
            "V": ptr,
            "BT": "*i32",
            "ROWS": "*i64",
            "LENS": "*i64",
            "scale": "fp32",
        }
        for splits in (1, 4):
            out = {"OUT": ptr if splits == 1 else "*fp32", "LSE": ptr if splits == 1 else "*fp32"}
            yield (
                f"decode splits={splits}",
                ta._decode_kernel,
                {**attn, **out},
                {
                    "GROUP": 7,
                    "GROUP_PAD": 16,
                    "D": 64,
                    "BS": 16,
                    "BLOCK_N": ta.DECODE_CONFIG["BLOCK_N"],
                    "SPLITS": splits,
                    "PRECISION": "ieee" if dt == "fp32" else "tf32",
                },
            )
        yield (
            "merge",
            ta._merge_kernel,
            {"PART": "*fp32", "LSE": "*fp32", "OUT": ptr},
            {"SPLITS": 4, "SPLITS_PAD": 4, "D": 64},
        )
        yield (
            "prefill",
            ta._prefill_kernel,
            {**attn, "OUT": ptr, "QSTART": "*i64", "TILES": "*i32"},
            {
                "GROUP": 7,
                "D": 64,
                "BS": 16,
                "BLOCK_M": 64,
                "BLOCK_N": 64,
                "PRECISION": "ieee" if dt == "fp32" else "tf32",
            },
        )
        for greedy in (True, False):
            sample = {
                "LOGITS": ptr,
                "KEYS": "*i64",
                "POSITIONS": "*i64",
                "BEST": "*fp64",
                "BEST_AT": "*i64",
                "MAX": "*fp32",
                "SUM": "*fp32",
                "vocab": "i32",
                "temperature": "fp32",
            }
            yield (
                f"sample greedy={greedy}",
                ts._sample_kernel,
                sample,
                {"GREEDY": greedy, "SLICE": ts._SLICE, "BLOCK": ts._BLOCK, "PARTS": 19},
            )
            combine = {
                "LOGITS": ptr,
                "BEST": "*fp64",
                "BEST_AT": "*i64",
                "MAX": "*fp32",
                "SUM": "*fp32",
                "OUT": "*fp64",
                "temperature": "fp32",
            }
            yield (
                f"combine greedy={greedy}",
                ts._combine_kernel,
                combine,
                {"GREEDY": greedy, "PARTS": 19, "PARTS_PAD": 32},
            )


def main() -> int:
    failed = 0
    for name, kernel, types, constants in cases():
        try:
            compile_kernel(kernel, types, constants)
            print(f"ok      {name} ({types.get('Q', types.get('X', types.get('LOGITS', '')))})")
        except Exception as err:  # noqa: BLE001 - report every kernel, then fail
            failed += 1
            print(f"FAILED  {name}: {type(err).__name__}: {str(err).splitlines()[-1][:300]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
