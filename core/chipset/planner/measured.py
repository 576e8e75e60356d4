"""The planner's GEMM cost against GEMMs timed on a real GPU.

``chipset.planner.kernels.gemm_time`` costs every matrix multiply of a step. These rows
were timed by the CUDA plugin's GPU check (``plugins/cuda/gpu_check.py``, step
``gemm_curve``) on one NVIDIA H200 SXM (torch 2.11.0+cu130, cuBLAS through ``torch.matmul``,
bf16 random inputs, each the mean of 60 replays of a CUDA graph of 20 products, so no
launch overhead is in the time) on 2026-12-04, twice, each on a freshly started machine. The
same runs measured a device-to-device copy at 4,195-4,226 GB/s (0.87-0.88 of the declared
4.8 TB/s) and flash attention (torch SDPA, causal, bf16, forward + backward, head_dim 128)
at 0.46-0.47 of the bf16 peak at 8 x 2,048 tokens and 0.54-0.55 at 2 x 8,192 (the profile
declares 0.40 for Hopper).

``TRAINING_SHAPES`` are the GEMMs a transformer step is made of (smallest dimension 512 or
more, no small squares): the planner is bounded on those (``tests/planner/test_planner_measured.py``).
The others are reported, not bounded: below a few hundred tokens, and for small squares
that fill a fraction of one wave of the 132 multiprocessors, the curve is optimistic, and
a lone tiny GEMM takes about 3 us whatever its size (a whole block's kernels are bounded
from below by the launch floor instead, ``time.launch_floor``).

Print the table: ``python -m chipset.planner.measured``.
"""

from __future__ import annotations

import argparse
import sys

from chipset.planner.assumptions import Assumptions
from chipset.planner.kernels import gemm_curve, gemm_time

__all__ = ["H200_GEMMS", "PROFILE", "SOURCE", "TRAINING_SHAPES", "is_training_shape", "main", "relative_errors"]

PROFILE = "h200"
SOURCE = ("plugins/cuda/gpu_check.py step gemm_curve, NVIDIA H200 (driver 580.159.04), torch 2.11.0+cu130, "
          "2026-12-04")

H200_GEMMS: list[tuple[int, int, int, float]] = [
    # (M, N, K, microseconds): the mean of two runs on two fresh machines (their rows differ
    # by 0-7%; docs/planner.md gives both)
    (256, 256, 256, 2.9), (512, 512, 512, 3.5), (1024, 1024, 1024, 5.6), (2048, 2048, 2048, 23.6),
    (4096, 4096, 4096, 174.6), (8192, 8192, 8192, 1592.7),
    (512, 4096, 4096, 29.6), (512, 11008, 4096, 81.9), (512, 4096, 11008, 70.8),
    (2048, 4096, 4096, 99.0), (2048, 11008, 4096, 261.7), (2048, 4096, 11008, 249.8),
    (8192, 4096, 4096, 397.1), (8192, 11008, 4096, 1095.0), (8192, 4096, 11008, 1046.4),
    (16384, 4096, 4096, 820.0), (16384, 11008, 4096, 2197.2), (16384, 4096, 11008, 2237.8),
    (64, 4096, 4096, 12.9), (128, 4096, 4096, 15.2), (256, 4096, 4096, 20.1),
    (8192, 1024, 4096, 115.8), (8192, 4096, 1024, 125.7),
]


def is_training_shape(m: int, n: int, k: int) -> bool:
    return min(m, n, k) >= 512 and not (m == n == k and m < 2048)


TRAINING_SHAPES = [row for row in H200_GEMMS if is_training_shape(*row[:3])]


def relative_errors(props, assumptions: Assumptions | None = None,
                    rows: list[tuple[int, int, int, float]] = H200_GEMMS) -> list[tuple[tuple[int, int, int], float]]:
    """((M, N, K), predicted / measured time - 1) per row, for device properties ``props``."""
    a = assumptions or Assumptions()
    peak = props.peak_flops["bfloat16"]
    e_max, half = gemm_curve(props, a)
    out = []
    for m, n, k, us in rows:
        t = gemm_time(m, n, k, peak, props.memory_bandwidth, e_max, half)
        out.append(((m, n, k), t / (us * 1e-6) - 1))
    return out


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description="The planner's GEMM time against GEMMs timed on an H200.").parse_args(argv)
    from chipset.planner.cluster import list_profiles

    profiles = list_profiles()
    if PROFILE not in profiles:
        print(f"profile {PROFILE!r} is not installed (it comes with chipset-cuda); known: {sorted(profiles)}",
              file=sys.stderr)
        return 2
    props = profiles[PROFILE][1]
    a = Assumptions()
    e_max, half = gemm_curve(props, a)
    print(f"Planner: efficiency {e_max} * d / (d + {half:g}), d = min(M, N, K); {SOURCE}\n")
    print("| M x N x K | measured us | measured TFLOP/s | predicted us | predicted / measured | bounded |")
    print("|---|---|---|---|---|---|")
    train = []
    for (shape, err), (_, _, _, us) in zip(relative_errors(props, a), H200_GEMMS, strict=True):
        m, n, k = shape
        bounded = is_training_shape(m, n, k)
        if bounded:
            train.append(err)
        print(f"| {m} x {n} x {k} | {us:,.1f} | {2 * m * n * k / (us * 1e-6) / 1e12:,.0f} | {us * (1 + err):,.1f} | "
              f"{1 + err:.2f} | {'yes' if bounded else 'no'} |")
    mean = sum(abs(e) for e in train) / len(train)
    print(f"\ntraining shapes: mean absolute relative error over {len(train)} GEMMs {mean:.1%}, "
          f"worst {max(train, key=abs):+.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
