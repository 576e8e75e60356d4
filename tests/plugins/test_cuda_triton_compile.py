"""chipset-cuda's Triton kernels compile to GPU machine code (cubin) without a GPU.

The interpreter tests (test_cuda_triton.py) check the kernels' numerics; this checks
that Triton's real compiler and ptxas accept every kernel, for every dtype the wrappers
launch them with, for Ampere (sm_80), Hopper (sm_90) and Blackwell (sm_100). Triton
compiles ahead of time for a named target, no driver needed.

It runs in a subprocess: the interpreter tests import triton with TRITON_INTERPRET=1,
after which this process can no longer compile. The signatures below mirror the
launches in chipset_cuda/triton_kernels.py (pointer dtypes, 32-bit ints, constexprs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

TARGETS = (80, 90, 100)
DTYPES = ("fp32", "fp16", "bf16")


def _launches(t: str) -> list[tuple[str, dict, dict]]:
    """(kernel, signature, constexprs) for every way the wrappers launch a kernel at dtype ``t``."""
    p, f32 = f"*{t}", "*fp32"
    rms_fwd = {"X": p, "W": p, "Y": p, "RSTD": f32, "N": "i32", "eps": "fp32", "HAS_W": "constexpr", "BLOCK": "constexpr"}
    rms_bwd = {"DY": p, "X": p, "W": p, "RSTD": f32, "DX": p, "DW": f32, "N": "i32", "n_rows": "i32",
               "rows_per_prog": "i32", "HAS_W": "constexpr", "BLOCK": "constexpr"}
    rope = {"X": p, "COS": p, "SIN": p, "Y": p, "S": "i32", "D": "i32", "HALF": "i32", "BACKWARD": "constexpr", "BLOCK": "constexpr"}
    out = [
        ("_rms_norm_fwd", rms_fwd, {"HAS_W": True, "BLOCK": 4096}),
        ("_rms_norm_fwd", rms_fwd, {"HAS_W": False, "BLOCK": 64}),
        ("_rms_norm_bwd", rms_bwd, {"HAS_W": True, "BLOCK": 4096}),
        ("_rms_norm_bwd", rms_bwd, {"HAS_W": False, "BLOCK": 64}),
        ("_rope", rope, {"BACKWARD": False, "BLOCK": 64}),
        ("_rope", rope, {"BACKWARD": True, "BLOCK": 64}),
        ("_swiglu_fwd", {"G": p, "U": p, "Y": p, "n": "i32", "BLOCK": "constexpr"}, {"BLOCK": 1024}),
        ("_swiglu_bwd", {"DY": p, "G": p, "U": p, "DG": p, "DU": p, "n": "i32", "BLOCK": "constexpr"}, {"BLOCK": 1024}),
        ("_ce_fwd", {"LOGITS": p, "TARGET": "*i64", "LOSS": f32, "LSE": f32, "V": "i32", "ignore_index": "i32",
                     "BLOCK": "constexpr"}, {"BLOCK": 4096}),
        ("_ce_bwd", {"LOGITS": p, "TARGET": "*i64", "LSE": f32, "DLOSS": f32, "DLOGITS": p, "V": "i32",
                     "ignore_index": "i32", "BLOCK": "constexpr"}, {"BLOCK": 4096}),
    ]
    if t != "fp32":  # autocast: bf16/fp16 activations with an fp32 weight give an fp32 output
        out.append(("_rms_norm_fwd", {**rms_fwd, "W": f32, "Y": f32}, {"HAS_W": True, "BLOCK": 4096}))
        out.append(("_rms_norm_bwd", {**rms_bwd, "DY": f32, "W": f32}, {"HAS_W": True, "BLOCK": 4096}))
    return out


def _compile_all() -> dict[str, str]:
    """Compile every launch for every target; ``{"kernel/dtype/sm_N/constexprs": "ok" | error}``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from chipset_cuda import triton_kernels as K

    results = {}
    for cc in TARGETS:
        for t in DTYPES:
            for name, sig, constexprs in _launches(t):
                key = f"{name}/{t}/sm_{cc}/{sig['W'] if 'W' in sig else ''}{constexprs}"
                try:
                    src = ASTSource(fn=getattr(K, name), signature=sig, constexprs=constexprs)
                    compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32),
                                              options={"num_warps": K._warps(constexprs["BLOCK"])})
                    results[key] = "ok" if compiled.asm.get("cubin") else "no cubin produced"
                except Exception as exc:  # report every failure, not just the first
                    results[key] = f"{type(exc).__name__}: {str(exc)[:400]}"
    return results


def test_every_triton_kernel_compiles_for_ampere_hopper_and_blackwell(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "cache"), TRITON_DEFAULT_FP_FUSION="1")
    r = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(r.stdout.strip().splitlines()[-1])
    failed = {k: v for k, v in results.items() if v != "ok"}
    assert not failed, json.dumps(failed, indent=1)
    assert len(results) == len(TARGETS) * sum(len(_launches(t)) for t in DTYPES)


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
