"""chipset-cuda on a real NVIDIA GPU: everything the CPU test suite cannot prove.

Run through ``plugins/cuda/gpu_check.sh`` (which installs the checkout without
downloading anything), or directly: ``python plugins/cuda/gpu_check.py --out DIR``.
Needs torch (CUDA build), pluggy and numpy; triton and pytest are used when present.
Every step is recorded, pass or fail, and the next one still runs; results are
rewritten to ``DIR/gpu_check.json`` (and a Markdown summary ``DIR/gpu_check.md``) after
each step, so a timeout still leaves what was measured. Budget: under 5 minutes.

Steps: environment; ``chipset backends``; ``chipset info``; fork-safety of the probe;
device/memory/OOM/streams/RNG through the chipset interfaces; a one-rank NCCL
collective; every registered kernel against the core reference (forward and backward,
conformance tolerances); kernel time vs the eager reference at training shapes; bf16/TF32
matmul and flash-attention throughput against the declared peak; tokens/s and MFU of a
~1.1B-parameter reference Transformer in bf16; ``chipset conformance --backend cuda``
when the installed chipset has it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUDGET_S = 250.0
T0 = time.monotonic()


def _ensure_importable() -> None:
    """Fall back to the checkout's sources when chipset is not installed (no entry points then)."""
    try:
        import chipset  # noqa: F401
        import chipset_cuda  # noqa: F401
    except ImportError:
        for sub in ("core", "plugins/cuda", "plugins/cpu_sim"):
            sys.path.insert(0, str(ROOT / sub))


class Report:
    def __init__(self, out: Path):
        self.out = out
        self.data: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "steps": {}}

    def step(self, name: str, fn, *args):
        left = BUDGET_S - (time.monotonic() - T0)
        if left < 5:
            self.data["steps"][name] = {"ok": False, "skipped": f"time budget spent ({BUDGET_S:.0f} s)"}
            return None
        t = time.monotonic()
        try:
            detail = fn(*args)
            entry = {"ok": True, "detail": detail}
        except Exception as exc:
            entry = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        entry["seconds"] = round(time.monotonic() - t, 2)
        self.data["steps"][name] = entry
        print(f"[{'ok' if entry['ok'] else 'FAIL'}] {name} ({entry['seconds']} s)" + ("" if entry["ok"] else f": {entry['error']}"), flush=True)
        self.write()
        return entry.get("detail")

    def write(self) -> None:
        self.data["seconds"] = round(time.monotonic() - T0, 1)
        self.data["all_ok"] = all(s.get("ok") for s in self.data["steps"].values())
        (self.out / "gpu_check.json").write_text(json.dumps(self.data, indent=2, default=str))
        (self.out / "gpu_check.md").write_text(summary(self.data))


def _cli(*args: str, timeout: float = 90, env: dict | None = None) -> subprocess.CompletedProcess:
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "chipset.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=e)


# --- steps ---------------------------------------------------------------------------
def environment() -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "host": platform.node()}
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as exc:
        info["triton"] = f"not importable: {exc!r}"
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        info["nvidia_smi"] = smi.stdout.strip().splitlines()
    return info


def backends() -> dict:
    r = _cli("backends", "--json")
    data = json.loads(r.stdout)
    cuda = next(b for b in data["backends"] if b["name"] == "cuda")
    if cuda["status"] != "ok":
        raise RuntimeError(f"cuda is {cuda['status']}: {cuda['reason']}")
    return {"selected": data["selected"], "cuda": cuda}


def info() -> dict:
    r = _cli("info", "--json", env={"CHIPSET_BACKEND": "cuda"})
    if r.returncode:
        raise RuntimeError(r.stderr.strip()[-2000:])
    data = json.loads(r.stdout)
    dev = data["devices"][0]
    return {"device": dev["name"], "estimated": dev["estimated"], "source": dev["source"],
            "peak_flops": dev["peak_flops"], "capabilities": data["capabilities"],
            "kernels": {k: [i["description"] for i in v["implementations"]] for k, v in data["kernels"].items()}}


def probe_is_fork_safe() -> dict:
    code = ("import torch, chipset_cuda; ok, why = chipset_cuda.descriptor.probe(); "
            "print(ok, torch.cuda.is_initialized(), why)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    ok, initialised, *why = r.stdout.split()
    if ok != "True" or initialised != "False":
        raise RuntimeError(f"probe ok={ok}, CUDA initialised by the probe={initialised}: {' '.join(why)} {r.stderr[-500:]}")
    return {"probe": " ".join(why), "cuda_initialised_by_probe": False}


def interfaces() -> dict:
    import torch

    import chipset

    b = chipset.backend("cuda")
    dev, mem = b.device, b.memory
    dev.set_device(0)
    out: dict = {"device_count": dev.device_count(), "properties": dev.properties(0).to_dict()}
    before = mem.stats().allocated
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev.torch_device())
    grown = mem.stats().allocated - before
    assert grown >= 256 * 2**20, f"allocated grew by {grown} bytes for a 256 MiB tensor"
    del x
    mem.empty_cache()
    out["stats_after_free"] = mem.stats().to_dict()
    free, total = mem.mem_get_info()
    with_oom = None
    try:
        with mem.oom_guard(str(dev.torch_device())):
            torch.empty(2 * total, dtype=torch.uint8, device=dev.torch_device())
    except chipset.OutOfMemoryError as exc:
        with_oom = str(exc)
        assert "Tried to allocate" in with_oom and exc.requested_bytes and exc.requested_bytes >= total, with_oom
    assert with_oom is not None, "allocating twice the capacity did not raise"
    out["oom_message"] = with_oom[:300]
    torch.ones(1024, device=dev.torch_device()).sum().item()  # usable after OOM
    s, e0, e1 = dev.stream(), dev.event(enable_timing=True), dev.event(enable_timing=True)
    with s.context():
        e0.record(s)
        a = torch.randn(2048, 2048, device=dev.torch_device())
        (a @ a).sum()
        e1.record(s)
    s.synchronize()
    out["event_ms"] = e0.elapsed_time(e1)
    assert out["event_ms"] > 0
    dev.manual_seed(1234)
    state = dev.get_rng_state()
    r1 = torch.randn(8, device=dev.torch_device())
    dev.set_rng_state(state)
    assert torch.equal(r1, torch.randn(8, device=dev.torch_device())), "RNG state did not restore"
    out["capabilities"] = b.capabilities.to_dict()
    return out


def collective() -> dict:
    import torch

    import chipset

    b = chipset.backend("cuda")
    coll = b.collective
    assert coll.c10d_backend == "nccl"
    coll.init_process_group(rank=0, world_size=1)
    try:
        t = torch.full((1024,), 2.0, device=b.device.torch_device())
        coll.all_reduce(t)
        coll.barrier()
        assert torch.all(t == 2.0)
    finally:
        coll.destroy()
    return {"all_reduce_world_1": "ok"}


def _kernel_inputs(name, dt, dev, big: bool):
    import torch

    g = torch.Generator().manual_seed(0)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dt).to(dev)

    if name == "rms_norm":
        return ([r(8192, 4096), r(4096)] if big else [r(37, 200), r(200)]), {}, [0, 1]
    if name == "rotary_embedding":
        b, h, s, d = (8, 32, 2048, 128) if big else (2, 3, 17, 64)
        ang = torch.randn(s, d, generator=g)
        return [r(b, h, s, d), ang.cos().to(dt).to(dev), ang.sin().to(dt).to(dev)], {}, [0]
    if name == "swiglu":
        shape = (8192, 11008) if big else (37, 300)
        return [r(*shape, scale=3), r(*shape)], {}, [0, 1]
    if name == "cross_entropy":
        n, v = (8192, 32000) if big else (37, 5000)
        t = torch.randint(0, v, (n,), generator=g)
        t[::7] = -100
        return [r(n, v, scale=2), t.to(dev)], {}, [0]
    if name == "scaled_dot_product_attention":
        b, h, s, d = (4, 32, 2048, 128) if big else (2, 4, 100, 64)
        return [r(b, h, s, d), r(b, h, s, d), r(b, h, s, d)], {"causal": True}, [0, 1, 2]
    raise KeyError(name)


def _fwd_bwd(fn, args, kwargs, need):
    import torch

    args = [a.detach().requires_grad_(True) if i in need else a for i, a in enumerate(args)]
    out = fn(*args, **kwargs)
    out.backward(torch.ones_like(out) if out.dim() == 0 else torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out))
    return out.detach(), [args[i].grad for i in need]


KERNELS = ("rms_norm", "rotary_embedding", "swiglu", "cross_entropy", "scaled_dot_product_attention")


def kernels_vs_reference() -> dict:
    import torch

    import chipset
    from chipset.conformance import tolerance

    b = chipset.backend("cuda")
    dev = b.device.torch_device()
    results, failures = {}, []
    for name in KERNELS:
        for dtype in ("float32", "bfloat16", "float16"):
            if not b.capabilities.has_dtype(dtype):
                continue
            dt = getattr(torch, dtype)
            args, kwargs, need = _kernel_inputs(name, dt, dev, big=False)
            impl = b.kernels.select(name, *args, **kwargs)
            got = _fwd_bwd(impl, args, kwargs, need)
            want = _fwd_bwd(b.kernels.reference(name), args, kwargs, need)
            rtol, atol = tolerance(dtype, name, b.capabilities.tolerances)
            row = {"impl": getattr(impl, "__module__", "?") + "." + impl.__name__, "rtol": rtol, "atol": atol}
            for what, x, y in [("forward", got[0], want[0])] + [(f"grad{i}", x, y) for i, (x, y) in enumerate(zip(got[1], want[1], strict=True))]:
                err = (x.float() - y.float()).abs()
                row[what] = float(err.max())
                if not torch.allclose(x.float(), y.float(), rtol=rtol, atol=atol):
                    failures.append(f"{name}/{dtype} {what}: max abs err {float(err.max()):.3g}")
            results[f"{name}/{dtype}"] = row
    # Semantics the CPU tests could only check on torch's CPU kernels.
    q = torch.randn(1, 4, 3, 64, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(1, 2, 9, 64, device=dev, dtype=torch.bfloat16)
    mask = torch.ones(3, 9, dtype=torch.bool, device=dev)
    mask[1] = False
    for causal, m in ((True, None), (False, mask), (True, mask)):
        impl = b.kernels.select("scaled_dot_product_attention", q, kv, kv, mask=m, causal=causal)
        got = impl(q, kv, kv, mask=m, causal=causal)
        want = b.kernels.reference("scaled_dot_product_attention")(q, kv, kv, mask=m, causal=causal)
        if not torch.allclose(got.float(), want.float(), rtol=1.6e-2, atol=2**-7) or got.isnan().any():
            failures.append(f"sdpa gqa/bottom-right causal={causal} mask={m is not None}: max err {float((got.float() - want.float()).abs().max()):.3g}")
    p0 = [torch.randn(1000, device=dev) for _ in range(4)]
    g0 = [torch.randn_like(t) * 0.1 for t in p0]

    def adam(fn):
        p, m, v = [t.clone() for t in p0], [torch.zeros_like(t) for t in p0], [torch.zeros_like(t) for t in p0]
        for step in (1, 2, 3):
            fn(p, g0, m, v, step, lr=1e-3, weight_decay=0.1)
        return p

    impl = b.kernels.select("fused_adamw", p0, g0, p0, p0, 1)
    adam_err = max(float((x - y).abs().max()) for x, y in zip(adam(impl), adam(b.kernels.reference("fused_adamw")), strict=True))
    results["fused_adamw/float32"] = {"impl": impl.__module__ + "." + impl.__name__, "forward": adam_err}
    if adam_err > 1e-5:
        failures.append(f"fused_adamw max err {adam_err:.3g}")
    if failures:
        raise AssertionError("; ".join(failures) + f" | all: {json.dumps(results)}")
    return results


def _time_ms(fn, iters: int = 10) -> float:
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def kernel_speed() -> dict:
    """Time of forward+backward, eager reference / registered implementation (>1 = faster)."""
    import torch

    import chipset

    b = chipset.backend("cuda")
    dev = b.device.torch_device()
    out = {}
    for name in KERNELS:
        args, kwargs, need = _kernel_inputs(name, torch.bfloat16, dev, big=True)
        impl = b.kernels.select(name, *args, **kwargs)
        ref = b.kernels.reference(name)
        if impl is ref:
            out[name] = {"impl": "reference (predicate declined these shapes)"}
            continue
        t_impl = _time_ms(functools.partial(_fwd_bwd, impl, args, kwargs, need))
        t_ref = _time_ms(functools.partial(_fwd_bwd, ref, args, kwargs, need))
        out[name] = {"shape": [list(a.shape) for a in args if hasattr(a, "shape")], "impl_ms": round(t_impl, 3),
                     "reference_ms": round(t_ref, 3), "speedup": round(t_ref / t_impl, 2)}
        torch.cuda.empty_cache()
    params = [torch.randn(4096, 4096, device=dev) for _ in range(12)]  # 201M parameters
    grads = [torch.randn_like(p) for p in params]
    m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    fused = b.kernels.select("fused_adamw", params, grads, m, v, 1)
    t_f = _time_ms(lambda: fused(params, grads, m, v, 1, lr=1e-4), iters=5)
    t_r = _time_ms(lambda: b.kernels.reference("fused_adamw")(params, grads, m, v, 1, lr=1e-4), iters=5)
    out["fused_adamw"] = {"params": 12 * 4096 * 4096, "impl_ms": round(t_f, 3), "reference_ms": round(t_r, 3),
                          "speedup": round(t_r / t_f, 2)}
    return out


def throughput() -> dict:
    """Dense matmul and flash attention against the declared peak (the number MFU divides by)."""
    import torch
    import torch.nn.functional as F

    import chipset

    b = chipset.backend("cuda")
    props = b.device.properties(0)
    dev = b.device.torch_device()
    out = {"device": props.name, "estimated_peak": props.estimated}
    n = 8192
    for label, dtype, peak_key in (("bf16_matmul", torch.bfloat16, "bfloat16"), ("tf32_matmul", torch.float32, "tf32")):
        torch.backends.cuda.matmul.allow_tf32 = dtype == torch.float32
        a, c = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
        ms = _time_ms(lambda a=a, c=c: a @ c, iters=20)
        achieved = 2 * n**3 / (ms / 1e3)
        peak = props.peak_flops.get(peak_key, 0.0)
        out[label] = {"n": n, "ms": round(ms, 3), "tflops": round(achieved / 1e12, 1),
                      "declared_peak_tflops": round(peak / 1e12, 1), "fraction_of_peak": round(achieved / peak, 3) if peak else None}
    torch.backends.cuda.matmul.allow_tf32 = False
    bsz, h, s, d = 4, 32, 4096, 128
    q, k, v = (torch.randn(bsz, h, s, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
    ms = _time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), iters=10)
    flops = 4 * bsz * h * s * s * d / 2  # two matmuls, half the scores under the causal mask
    peak = props.peak_flops.get("bfloat16", 0.0)
    out["sdpa_causal_bf16_fwd"] = {"shape": [bsz, h, s, d], "ms": round(ms, 3), "tflops": round(flops / (ms / 1e3) / 1e12, 1),
                                   "fraction_of_peak": round(flops / (ms / 1e3) / peak, 3) if peak else None}
    return out


def train_gpt() -> dict:
    """~1.1B-parameter reference Transformer (TinyLlama shape), bf16, on the registry's kernels.

    A fixed batch is trained for a few steps (the loss must fall: gradients flow through
    the kernels); tokens/s and MFU (PaLM: tokens/s x (6N + 12 L H Q T) / peak, N without
    the input embedding) come from the timed steps after warm-up.
    """
    import torch

    import chipset
    from chipset.config import ModelConfig
    from chipset.models import Transformer

    b = chipset.backend("cuda")
    dev = b.device.torch_device()
    cfg = ModelConfig(vocab_size=32000, hidden_size=2048, num_hidden_layers=22, num_attention_heads=32,
                      num_key_value_heads=4, intermediate_size=5632, max_position_embeddings=2048)
    model = Transformer(cfg, b.kernels).to(device=dev, dtype=torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    n_flop_params = n_params - model.embed_tokens.weight.numel()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    batch, seq = 8, 2048
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g).to(dev)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step() -> float:
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    losses = [float(step()) for _ in range(3)]  # warm-up: Triton compiles, allocator settles
    b.memory.reset_peak_stats()
    timed = 10
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    last = [step() for _ in range(timed)]
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    losses += [float(v) for v in last]
    tokens_per_s = batch * seq * timed / seconds
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    flops_per_token = 6 * n_flop_params + 12 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * seq
    peak = b.device.properties().peak_flops.get("bfloat16", 0.0)
    assert all(v == v for v in losses) and losses[-1] < losses[0], f"loss did not fall: {losses}"
    return {"params": n_params, "batch": batch, "seq_len": seq, "steps_timed": timed,
            "step_ms": round(1e3 * seconds / timed, 1), "tokens_per_s": round(tokens_per_s),
            "mfu": round(tokens_per_s * flops_per_token / peak, 4) if peak else None,
            "peak_memory_gib": round(b.memory.stats().peak_allocated / 2**30, 1),
            "loss_first_last": [round(losses[0], 3), round(losses[-1], 3)],
            "note": "bf16 parameters and AdamW states (torch fused AdamW), no recompute, one GPU"}


def conformance(out_dir: Path) -> dict:
    help_text = _cli("conformance", "--help", timeout=60)
    if help_text.returncode != 0:
        return {"absent": "this chipset has no `conformance` command yet", "stderr": help_text.stderr[-500:]}
    left = max(30.0, BUDGET_S - (time.monotonic() - T0) - 10)
    report = out_dir / "conformance-cuda.json"
    try:
        r = _cli("conformance", "--backend", "cuda", "--json-report", str(report), "-q", timeout=left)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"conformance did not finish within the {left:.0f} s left") from None
    (out_dir / "conformance-cuda.log").write_text(r.stdout + "\n" + r.stderr)
    summary_ = json.loads(report.read_text()).get("summary") if report.exists() else None
    if r.returncode != 0:
        raise RuntimeError(f"exit {r.returncode}; summary {summary_}; tail: {(r.stdout + r.stderr)[-1500:]}")
    return {"summary": summary_}


def summary(data: dict) -> str:
    lines = [f"# chipset-cuda GPU check ({data['started']})", ""]
    env = data["steps"].get("environment", {}).get("detail") or {}
    lines.append(f"GPU: {env.get('nvidia_smi', '?')}; torch {env.get('torch')}, CUDA {env.get('cuda')}, triton {env.get('triton')}")
    lines += ["", "| step | result | seconds |", "|---|---|---|"]
    for name, s in data["steps"].items():
        res = "ok" if s.get("ok") else (s.get("skipped") or s.get("error", "failed"))[:160].replace("|", "/")
        lines.append(f"| {name} | {res} | {s.get('seconds', '')} |")
    speed = (data["steps"].get("kernel_speed") or {}).get("detail") or {}
    if speed:
        lines += ["", "| kernel (bf16 fwd+bwd) | impl ms | eager reference ms | speedup |", "|---|---|---|---|"]
        for k, r in speed.items():
            lines.append(f"| {k} | {r.get('impl_ms', r.get('impl'))} | {r.get('reference_ms', '')} | {r.get('speedup', '')} |")
    gpt = (data["steps"].get("train_gpt_1b") or {}).get("detail") or {}
    if gpt:
        lines += ["", f"GPT {gpt['params'] / 1e9:.2f}B bf16: {gpt['tokens_per_s']} tokens/s, MFU {gpt['mfu']}, "
                  f"step {gpt['step_ms']} ms, peak {gpt['peak_memory_gib']} GiB, loss {gpt['loss_first_last']}"]
    tp = (data["steps"].get("throughput") or {}).get("detail") or {}
    if tp:
        lines += ["", "| throughput | TFLOP/s | fraction of declared peak |", "|---|---|---|"]
        for k, r in tp.items():
            if isinstance(r, dict):
                lines.append(f"| {k} | {r.get('tflops')} | {r.get('fraction_of_peak')} |")
    lines += ["", f"Total {data.get('seconds')} s; all ok: {data.get('all_ok')}.",
              "Command: `bash plugins/cuda/gpu_check.sh` (results in $OUT/gpu_check.json)."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"), help="directory for gpu_check.json/.md")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _ensure_importable()
    rep = Report(out)
    rep.step("environment", environment)
    rep.step("chipset_backends", backends)
    rep.step("chipset_info", info)
    rep.step("probe_fork_safe", probe_is_fork_safe)
    rep.step("interfaces", interfaces)
    rep.step("collective_nccl_world1", collective)
    rep.step("kernels_vs_reference", kernels_vs_reference)
    rep.step("kernel_speed", kernel_speed)
    rep.step("throughput", throughput)
    rep.step("train_gpt_1b", train_gpt)
    rep.step("conformance", conformance, out)
    rep.write()
    print(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'} in {time.monotonic() - T0:.0f} s")
    return 0 if rep.data["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
