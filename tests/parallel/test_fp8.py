"""FP8 training (train.fp8, parallel/fp8.py) through the backend's fp8_matmul (kernels/fp8.py).

A one-process run with each FP8 scaling trains like the run without FP8, within the documented
tolerance (docs/engine.md, "FP8 training"): e4m3 keeps 3 mantissa bits, so rounding an operand to it makes a
relative error uniform in [-u, u], u = 2^-4, of RMS u/sqrt(3); a product of two rounded operands
has RMS relative error sqrt(2/3) u (about 5.1%). The loss is held to that at every step:
``|loss_fp8 - loss| <= sqrt(2/3) u loss``. Measured here: under 1.0% (tensorwise); the same
runs with a scale 4x too large (the top of each operand saturated) leave it by step 5 (7.9%).
The kernel's exact numerics are conformance's check (test_fp8_matmul_matches_exact_emulation).
This file is also the job's script.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch

import forked_cli
import multirank
import testenv

HERE = Path(__file__).resolve()
BASE = testenv.TINY_RUN
U_E4M3 = 2.0**-4
REL_TOL = (2 / 3) ** 0.5 * U_E4M3
MODES = ("off", "tensorwise", "rowwise")


def _job(mode: str, out_path: str) -> None:
    from chipset.train import train
    from chipset.train.config import RunConfig

    b = multirank.start()
    results = {}
    for fp8 in MODES:
        cfg = RunConfig.from_dict(multirank.merge(BASE, {"train": {"fp8": fp8}})).validate(world_size=1)
        results[fp8] = train(cfg, b, None, out=io.StringIO()).losses
    multirank.finish(b, results, out_path)


@pytest.fixture(scope="module")
def losses(tmp_path_factory):
    import chipset

    if not {"tensorwise", "rowwise"} <= set(chipset.backend().capabilities.fp8):
        pytest.skip("the default backend does not declare FP8 GEMMs (Capabilities.fp8)")
    return multirank.run_jobs(HERE, [{"ref": 1}], tmp_path_factory.mktemp("fp8"), timeout=400)["ref"]


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_fp8_run_trains_within_the_tolerance_of_the_run_without(losses, scaling):
    ref, got = losses["off"], losses[scaling]
    assert ref[-1] < ref[0] - 0.1  # it trains
    for step, (a, b) in enumerate(zip(got, ref, strict=True), 1):
        assert abs(a - b) <= REL_TOL * b, f"step {step}: fp8 {scaling} loss {a}, without fp8 {b}"
    assert got != ref  # the projections really ran in FP8


def test_fp8_is_refused_on_a_backend_that_does_not_declare_it(tmp_path):
    """few_caps (tests/broken_backends, installed as a real distribution) declares no FP8."""
    import os

    import broken_backends

    site = broken_backends.install(tmp_path / "site")
    env = multirank.env()
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    env["CHIPSET_BACKEND"] = "few_caps"
    r = forked_cli.run([sys.executable, "-m", "chipset.cli.main", "train", "--set", 'train.fp8="rowwise"',
                        "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "train.fp8 = 'rowwise': backend 'few_caps' declares no FP8 GEMM with rowwise scaling" in r.stderr
    assert not (tmp_path / "run").exists()


def test_cuda_scaled_mm_gemm_equals_the_emulation_where_torch_runs_it_on_the_cpu():
    """The cuda plugin's primitive (chipset_cuda/fp8.py) quantises as the reference does and hands
    the FP8 operands to torch._scaled_mm; where this torch runs _scaled_mm on CPU tensors the
    code path runs here: its products of FP8 values (exact in float32, 8 significant bits each)
    summed in float32 equal the emulation's to float32 rounding of the sum."""
    from chipset.kernels.fp8 import FORWARD_FORMAT, GRADIENT_FORMAT, fp8_gemm

    fp8 = pytest.importorskip("chipset_cuda.fp8")
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(32, 64, generator=g).bfloat16(), torch.randn(64, 48, generator=g).bfloat16()
    try:
        fp8.scaled_mm_gemm(a, b, "tensorwise", FORWARD_FORMAT, FORWARD_FORMAT, torch.bfloat16)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"this torch does not run _scaled_mm on the CPU: {e}")
    for scaling in ("tensorwise", "rowwise"):
        for fa in (FORWARD_FORMAT, GRADIENT_FORMAT):
            got = fp8.scaled_mm_gemm(a, b, scaling, fa, FORWARD_FORMAT, torch.float32 if scaling == "tensorwise" else torch.bfloat16)
            want = fp8_gemm(a, b, scaling, fa, FORWARD_FORMAT, got.dtype)
            eps = torch.finfo(got.dtype).eps
            torch.testing.assert_close(got, want, rtol=2 * eps, atol=64 * torch.finfo(torch.float32).eps * want.abs().max().item())


if __name__ == "__main__":
    _job(sys.argv[1], sys.argv[2])
