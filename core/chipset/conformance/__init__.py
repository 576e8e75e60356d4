"""chipset.conformance: the suite every backend is certified with.

Shipped inside core as a pytest plugin (:mod:`chipset.conformance.plugin`) plus test
modules (:mod:`chipset.conformance.tests`), one module per group: ``test_<group>.py``.
A new group (as checkpoint round-trip and engine parity were) is one more module here
and one more name in :data:`GROUPS`.

Run it with ``chipset conformance --backend NAME`` or, equivalently::

    pytest -p chipset.conformance.plugin --pyargs chipset.conformance.tests --chipset-backend NAME

Skips are keyed on the backend's declared :class:`chipset.Capabilities`, never on its name.
"""

from __future__ import annotations

__all__ = ["GROUPS", "TOLERANCES", "assert_close_to_exact", "exact", "pytest_args", "tolerance"]

GROUPS: tuple[str, ...] = (
    "discovery",
    "device",
    "streams",
    "memory",
    "rng",
    "dtypes",
    "collectives",
    "kernels",
    "amp",
    "checkpoint",
    "engine",
)
"""Groups in report order. A test's group is the name of its module without ``test_``."""

TOLERANCES: dict[str, tuple[float, float]] = {
    "float32": (1.3e-6, 1e-5),
    "float16": (1e-3, 1e-5),
    "bfloat16": (1.6e-2, 1e-5),
    "float64": (1e-7, 1e-7),
}
"""(rtol, atol) per dtype against the reference: PyTorch's defaults (docs/formulas.md). Integers are exact."""


def tolerance(dtype: str, kernel: str = "", overrides=None) -> tuple[float, float]:
    """(rtol, atol) for ``kernel`` at ``dtype``: ``Capabilities.tolerances["kernel/dtype"]``,
    then ``["dtype"]``, then :data:`TOLERANCES`; (0, 0) for integer dtypes."""
    overrides = overrides or {}
    for key in (f"{kernel}/{dtype}", dtype):
        if key in overrides:
            rtol, atol = overrides[key]
            return float(rtol), float(atol)
    return TOLERANCES.get(dtype, (0.0, 0.0))


def exact(x):
    """``x`` as the exact computation of :func:`assert_close_to_exact` takes it: float
    tensors in float64 on the CPU, other tensors on the CPU, anything else as it is."""
    import torch

    if isinstance(x, torch.Tensor):
        return x.detach().cpu().double() if x.is_floating_point() else x.cpu()
    return x


def assert_close_to_exact(got, want, exact, rtol: float, atol: float, label: str, summation=None) -> None:
    """Raise AssertionError unless every element of ``got`` is within the tolerance of
    ``exact``, widened by the largest error the reference ``want`` itself makes:
    ``|got - exact| <= atol + rtol * |exact| + max|want - exact|`` (NaN fails).

    ``exact`` is the reference computed in float64 from the same rounded inputs. In a low
    precision dtype the eager reference rounds every intermediate, and where rounded terms
    cancel (rotary's x1*cos - x2*sin, swiglu's gate gradient) its error is far larger than
    the dtype's tolerance of the result. A correct kernel makes errors of the same size at
    other elements (it rounds, or fuses, differently), so a direct comparison with the
    reference fails it: an NVIDIA H200 showed exactly that. The bound lets a kernel be as
    wrong as the reference is, and no more.

    ``summation``: an elementwise allowance added to the bound, for a kernel free to order its
    sums (a GEMM's ``K * eps * sum|a b|``, in float64 on the CPU, shaped like ``exact``).
    """
    a, b, x = got.double().cpu(), want.double().cpu(), exact.double().cpu()
    if a.shape != x.shape:
        raise AssertionError(f"{label}: shape {tuple(a.shape)}, expected {tuple(x.shape)}")
    err = (a - x).abs()
    ref_err = float((b - x).abs().max()) if b.numel() else 0.0
    allowed = atol + rtol * x.abs() + ref_err
    if summation is not None:
        allowed = allowed + summation.double().cpu()
    bad = ~(err <= allowed)
    if bad.any():
        j = int((err - allowed).nan_to_num(float("inf")).flatten().argmax())
        raise AssertionError(
            f"{label}: {int(bad.sum())} of {a.numel()} elements further from the exact answer than the tolerance "
            f"(rtol={rtol}, atol={atol}) plus the reference's largest error ({ref_err:.3g})"
            + ("" if summation is None else f" and the summation bound (at most {float(summation.max()):.3g})")
            + f"; worst at flat index {j}: "
            f"got {a.flatten()[j].item():.6g}, reference {b.flatten()[j].item():.6g}, exact {x.flatten()[j].item():.6g}")


def pytest_args(
    backend: str,
    *,
    json_report: str | None = None,
    junit_xml: str | None = None,
    keyword: str | None = None,
    keep_going: bool = False,
    extra: list[str] | None = None,
) -> list[str]:
    """The pytest command-line arguments that run the suite against ``backend``."""
    # No conftest.py of the project the command is run from (pytest would load
    # ./test*/conftest.py) may change the verdict; the suite's own hooks come from its plugin.
    args = [
        "--noconftest",
        "-p", "chipset.conformance.plugin",
        "-p", "no:cacheprovider",
        "--pyargs", "chipset.conformance.tests",
        "--chipset-backend", backend,
        "-o", "addopts=",
        "-o", "testpaths=",
        "-rfE",
    ]
    if json_report:
        args += ["--chipset-json-report", json_report]
    if junit_xml:
        args += ["--junit-xml", junit_xml, "-o", "junit_family=xunit2"]
    if keyword:
        args += ["-k", keyword]
    if keep_going:
        args.append("--chipset-keep-going")
    return args + list(extra or [])
