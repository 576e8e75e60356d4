"""chipset on a real AMD (ROCm) or Intel (XPU) GPU: what the CPU test suite cannot prove.

Prepared for when such hardware is lent; never yet run on it. Run through
``plugins/accelerator/gpu_check.sh`` or directly:
``python plugins/accelerator/gpu_check.py --target rocm|xpu --out DIR``.

``rocm`` certifies chipset-cuda on a ROCm build (torch.cuda on HIP, RCCL as ``nccl``);
``xpu`` certifies chipset-accelerator on an XPU build (``torch.xpu``, ``xccl``). Every step
is recorded, pass or fail, and the next one still runs; ``DIR/gpu_check.json`` and
``DIR/gpu_check.md`` are rewritten after each step, so a timeout keeps what was measured.
Steps: environment; ``chipset backends`` (the target's backend ok, the build explained);
the probe initialises no device; device/properties/memory/OOM/streams/RNG through the
chipset interfaces, properties against the declared profile; a one-rank collective
through the backend's c10d library; a bf16 GEMM against the declared peak; ``chipset
conformance``. Budget: under 5 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUDGET_S = 250.0
T0 = time.monotonic()
TARGETS = {
    # target: (chipset backend, torch module, distributed backend, fork-safety question)
    "rocm": ("cuda", "cuda", "nccl", "torch.cuda.is_initialized()"),
    "xpu": ("accelerator", "xpu", "xccl", "torch.xpu.is_initialized()"),
}
STEPS = ("environment", "chipset_backends", "probe_fork_safe", "interfaces", "collective_world1", "gemm_bf16", "conformance")


class Report:
    def __init__(self, out: Path, target: str):
        self.out = out
        self.data: dict = {"target": target, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "steps": {}}

    def step(self, name: str, fn, *args):
        if BUDGET_S - (time.monotonic() - T0) < 5:
            self.data["steps"][name] = {"ok": False, "skipped": f"time budget spent ({BUDGET_S:.0f} s)"}
            return None
        t = time.monotonic()
        try:
            entry = {"ok": True, "detail": fn(*args)}
        except Exception as exc:
            entry = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        entry["seconds"] = round(time.monotonic() - t, 2)
        self.data["steps"][name] = entry
        print(f"[{'ok' if entry['ok'] else 'FAIL'}] {name} ({entry['seconds']} s)" + ("" if entry["ok"] else f": {entry['error']}"),
              flush=True)
        self.write()
        return entry.get("detail")

    def write(self) -> None:
        self.data["seconds"] = round(time.monotonic() - T0, 1)
        self.data["all_ok"] = all(s.get("ok") for s in self.data["steps"].values())
        (self.out / "gpu_check.json").write_text(json.dumps(self.data, indent=2, default=str))
        rows = [f"| {n} | {'ok' if s.get('ok') else s.get('error') or s.get('skipped')} |" for n, s in self.data["steps"].items()]
        (self.out / "gpu_check.md").write_text(
            f"# chipset GPU check: {self.data['target']}\n\n| step | result |\n|---|---|\n" + "\n".join(rows) + "\n")


def _cli(*args: str, timeout: float = 90, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "chipset.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, **(env or {})))


def environment() -> dict:
    import torch

    acc = torch.accelerator.current_accelerator()
    return {"python": platform.python_version(), "torch": torch.__version__, "hip": getattr(torch.version, "hip", None),
            "xpu": getattr(torch.version, "xpu", None), "accelerator": None if acc is None else acc.type,
            "host": platform.node()}


def backends(backend: str) -> dict:
    data = json.loads(_cli("backends", "--json").stdout)
    rec = next((b for b in data["backends"] if b["name"] == backend), None)
    if rec is None or rec["status"] != "ok":
        raise RuntimeError(f"{backend} is {rec['status'] if rec else 'not installed'}: {rec['reason'] if rec else ''}")
    return {"selected": data["selected"], backend: rec, "torch_build": data["torch_build"]}


def probe_is_fork_safe(backend: str, question: str) -> dict:
    pkg = {"cuda": "chipset_cuda", "accelerator": "chipset_accelerator"}[backend]
    code = f"import torch, {pkg}; ok, why = {pkg}.descriptor.probe(); print(ok, {question}, why)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    ok, initialised, *why = (r.stdout.split() or ["?", "?"])
    if ok != "True" or initialised != "False":
        raise RuntimeError(f"probe ok={ok}, device initialised by the probe={initialised}: {' '.join(why)} {r.stderr[-500:]}")
    return {"probe": " ".join(why)}


def _backend(backend: str):
    os.environ["CHIPSET_BACKEND"] = backend
    import chipset

    return chipset.backend()


def interfaces(backend: str) -> dict:
    import torch

    import chipset

    b = _backend(backend)
    dev, mem = b.device, b.memory
    props = dev.properties(0)
    dev.set_device(0)
    before = mem.stats(0).allocated
    x = torch.empty(64 << 20, dtype=torch.uint8, device=dev.torch_device(0))
    grown = mem.stats(0).allocated - before
    del x
    try:
        with mem.oom_guard(str(dev.torch_device(0))):
            torch.empty(mem.total_memory(0) * 2, dtype=torch.uint8, device=dev.torch_device(0))
        oom = "no error raised"
    except chipset.OutOfMemoryError as exc:
        oom = f"chipset.OutOfMemoryError: {str(exc)[:200]}"
    s, start, end = dev.stream(), dev.event(enable_timing=True), dev.event(enable_timing=True)
    start.record(s)
    with s.context():
        torch.ones(1 << 20, device=dev.torch_device(0)).sum()
    end.record(s)
    end.synchronize()
    dev.manual_seed(5)
    a = torch.rand(4, device=dev.torch_device(0))
    dev.manual_seed(5)
    same = torch.equal(a, torch.rand(4, device=dev.torch_device(0)))
    if grown < 64 << 20 or not oom.startswith("chipset.") or not same:
        raise RuntimeError(f"allocated grew {grown} (want >= {64 << 20}), oom: {oom}, RNG replays: {same}")
    return {"devices": dev.device_count(), "name": props.name, "estimated": props.estimated, "source": props.source,
            "peak_bf16": props.peak_flops_for("bfloat16"), "total_memory": props.total_memory,
            "elapsed_ms": start.elapsed_time(end), "oom": oom, "capabilities": b.capabilities.to_dict()}


def collective(backend: str, c10d: str) -> dict:
    import torch

    b = _backend(backend)
    if b.collective.c10d_backend != c10d:
        raise RuntimeError(f"{backend} uses c10d backend {b.collective.c10d_backend!r}, expected {c10d!r}")
    b.collective.init_process_group()
    t = torch.full((1024,), 3.0, device=b.device.torch_device(0))
    b.collective.all_reduce(t)
    b.device.synchronize()
    if not torch.all(t == 3.0):
        raise RuntimeError("a one-rank all_reduce changed the tensor")
    return {"c10d_backend": c10d}


def gemm(backend: str) -> dict:
    import torch

    b = _backend(backend)
    d, n = b.device.torch_device(0), 8192
    x, y = (torch.randn(n, n, device=d, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        x @ y
    b.device.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        x @ y
    b.device.synchronize()
    rate = 10 * 2 * n**3 / (time.perf_counter() - t)
    peak = b.device.properties(0).peak_flops_for("bfloat16")
    return {"tflops": rate / 1e12, "declared_peak_tflops": peak / 1e12, "fraction_of_peak": rate / peak if peak else None}


def conformance(backend: str, out: Path) -> dict:
    report = out / f"conformance-{backend}.json"
    left = max(10.0, BUDGET_S - (time.monotonic() - T0) - 5)
    r = _cli("conformance", "--backend", backend, "--json-report", str(report), "-q", timeout=left)
    (out / f"conformance-{backend}.log").write_text(r.stdout[-200_000:] + r.stderr[-20_000:])
    summary = json.loads(report.read_text())["summary"] if report.exists() else None
    if r.returncode:
        raise RuntimeError(f"conformance exit {r.returncode}: {summary}")
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", choices=sorted(TARGETS), required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    backend, _, c10d, question = TARGETS[args.target]
    rep = Report(args.out, args.target)
    rep.step("environment", environment)
    rep.step("chipset_backends", backends, backend)
    rest = (("probe_fork_safe", probe_is_fork_safe, backend, question), ("interfaces", interfaces, backend),
            ("collective_world1", collective, backend, c10d), ("gemm_bf16", gemm, backend),
            ("conformance", conformance, backend, args.out))
    first = rep.data["steps"]["chipset_backends"]
    for name, fn, *fn_args in rest:
        if first.get("ok"):
            rep.step(name, fn, *fn_args)
        else:  # no device to check: each step says so rather than failing at length
            rep.data["steps"][name] = {"ok": False, "skipped": f"{backend} backend unavailable: {first.get('error')}"}
    rep.write()
    return 0 if rep.data["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
