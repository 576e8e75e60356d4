"""The conformance suites tox certifies on a machine without accelerators, side by side.

``python tests/conformance_envs.py OUT_DIR [SUITE ...]`` runs ``chipset conformance`` for each
suite below (all of them by default) at the same time, each in its own process with its own
environment, writes ``OUT_DIR/conformance-SUITE.json`` and ``OUT_DIR/conformance-SUITE.log``,
prints a line as each one ends, then every suite's output in order. Exit status: 0 when every
suite passed, else the first failing suite's.

Why side by side: a suite spends most of its time waiting (on its ranks, on deliberate
collective timeouts, on watchdogs), not computing; on 2 cores four suites at once take about
as long as the slowest one, where one after another they took the sum (tox.ini, env
``conformance``). The suites:

- ``cpu_sim``: the reference backend (chipset-cpu_sim).
- ``cpu``: the real host backend (chipset-cpu).
- ``ascend-double``: chipset-ascend against the torch_npu TEST DOUBLE (tests/doubles/torch_npu_double;
  docs/ascend.md, "Layer 1"): fake /dev/davinciN files made under OUT_DIR, tensors placed on the
  host and charged to the double's NPU allocator. Proves the plugin's plumbing, not NPU numerics.
- ``privateuse1-double``: chipset-accelerator (the generic torch.accelerator backend) on the
  PrivateUse1 TEST DOUBLE (tests/doubles/privateuse1_double; docs/accelerator.md): a device type
  torch does not ship, whose tensors live on the host. Proves the generic path, not a device's numerics.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

DOUBLES = Path(__file__).resolve().parent / "doubles"
GIB = str(1 << 30)


def _ascend_double(out: Path) -> dict[str, str]:
    (out / "cann").mkdir(parents=True, exist_ok=True)
    (out / "dev").mkdir(exist_ok=True)
    for i in range(8):
        (out / "dev" / f"davinci{i}").touch()
    return {"PYTHONPATH": str(DOUBLES / "torch_npu_double"), "ASCEND_HOME_PATH": str(out / "cann"),
            "TORCH_NPU_DOUBLE_DEVICE_FILES": str(out / "dev" / "davinci[0-9]*"),
            "TORCH_NPU_DOUBLE_PLACE_ON_HOST": "1", "TORCH_NPU_DOUBLE_CAPACITY": GIB}


def _privateuse1_double(out: Path) -> dict[str, str]:
    return {"PYTHONPATH": str(DOUBLES / "privateuse1_double"), "TOY_ACCEL_DOUBLE": "1",
            "TOY_ACCEL_DOUBLE_CAPACITY": GIB}


# suite name: (backend, the environment it adds, made under OUT_DIR)
SUITES = {
    "cpu_sim": ("cpu_sim", lambda out: {}),
    "cpu": ("cpu", lambda out: {}),
    "ascend-double": ("ascend", _ascend_double),
    "privateuse1-double": ("accelerator", _privateuse1_double),
}


def start_suite(name: str, out: Path, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, object]:
    """Start suite ``name`` writing ``OUT/conformance-NAME.json`` and ``.log``: (process, open log).
    ``env``: the environment to add the suite's own to (default: this process's)."""
    backend, extra = SUITES[name]
    env = {**(os.environ if env is None else env), **extra(out / name)}
    log = open(out / f"conformance-{name}.log", "w")  # noqa: SIM115 (closed when the suite ends)
    cmd = [sys.executable, "-m", "chipset.cli.main", "conformance", "--backend", backend,
           "--json-report", str(out / f"conformance-{name}.json")]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=out), log


def run_suite(name: str, out: Path, env: dict[str, str] | None = None) -> tuple[int, Path, str]:
    """Run suite ``name`` to its end: (exit status, JSON report path, its output)."""
    out.mkdir(parents=True, exist_ok=True)
    proc, log = start_suite(name, out, env)
    try:
        code = proc.wait(timeout=1800)
    finally:
        log.close()
    return code, out / f"conformance-{name}.json", (out / f"conformance-{name}.log").read_text()


def main(argv: list[str]) -> int:
    if not argv or any(name not in SUITES for name in argv[1:]):
        print(f"usage: python {Path(__file__).name} OUT_DIR [SUITE ...]; suites: {', '.join(SUITES)}",
              file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    names = argv[1:] or list(SUITES)
    started = time.monotonic()
    running = {name: start_suite(name, out) for name in names}
    print(f"conformance: {len(names)} suites side by side ({', '.join(names)}); logs in {out}", flush=True)
    codes = {}
    while len(codes) < len(running):
        for name, (proc, log) in running.items():
            if name not in codes and proc.poll() is not None:
                log.close()
                codes[name] = proc.returncode
                verdict = "passed" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
                print(f"conformance: {name} {verdict} after {time.monotonic() - started:.0f} s", flush=True)
        time.sleep(0.2)
    for name in names:
        print(f"\n===== conformance {name} (exit {codes[name]}) =====", flush=True)
        print((out / f"conformance-{name}.log").read_text(), end="", flush=True)
    failed = [name for name in names if codes[name] != 0]
    print(f"\nconformance: {len(names) - len(failed)} of {len(names)} suites passed"
          + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
    return codes[failed[0]] if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
