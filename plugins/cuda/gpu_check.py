"""chipset-cuda on a real NVIDIA GPU: everything the CPU test suite cannot prove.

Run through ``plugins/cuda/gpu_check.sh`` (which installs the checkout without
downloading anything), or directly: ``python plugins/cuda/gpu_check.py --out DIR``.
Needs torch (CUDA build), pluggy and numpy; triton and pytest are used when present.
Every step is recorded, pass or fail, and the next one still runs; results are
rewritten to ``DIR/gpu_check.json`` (and a Markdown summary ``DIR/gpu_check.md``) after
each step, so a timeout still leaves what was measured. Budget: the core steps 250 s, everything
540 s (``--budget``), each comparison step under its own cap (CAPS).

Steps: environment; ``chipset backends``; ``chipset info``; fork-safety of the probe;
device/memory/OOM/streams/RNG through the chipset interfaces; a one-rank NCCL
collective; every registered kernel against the core reference (forward and backward,
conformance tolerances); kernel time vs the eager reference at training shapes; bf16/TF32
matmul and flash-attention throughput against the declared peak; the planner's compute model
against this GPU (a bf16 GEMM sweep fitted to its efficiency curve, flash attention
forward+backward, copy bandwidth, eager launch latency); MosaicML's MPT-7B and 13B blocks
timed beside the planner (the blocks of its published known-gap rows); tokens/s and MFU of a
~1.1B-parameter reference Transformer in bf16; ``chipset train`` (the engine, one rank, bf16)
and a plain PyTorch loop of the same shape (benchmarks/plain_torch_lm.py's model), each of
these three steps beside the planner's step time for it (chipset.planner.measured_steps);
``chipset conformance --backend cuda``
when the installed chipset has it. Then the comparison steps of gpu_check_peers.py, each under its
own time cap and all within ``--budget``: FP8 beside bf16 (``fp8_vs_bf16``), LoRA beside a full
fine-tune (``lora_memory``), and torchtitan beside ``chipset train`` (``torchtitan_peer``, only where
torchtitan imports). ``--steps`` picks steps or groups (core, fp8, lora, torchtitan); docs/benchmarks.md
has the device commands.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check_peers as peers  # noqa: E402  (next to this script; run as a file, not a package)

ROOT = Path(__file__).resolve().parents[2]
BUDGET_S = 250.0  # the core steps
TOTAL_BUDGET_S = 540.0  # everything, comparison steps included (the device call's limit is 600 s)
T0 = time.monotonic()
CAPS = {"fp8_vs_bf16": 110.0, "lora_memory": 100.0, "torchtitan_peer": 420.0}  # seconds per comparison step
GROUPS = {"fp8": ("fp8_vs_bf16",), "lora": ("lora_memory",), "torchtitan": ("torchtitan_peer",)}
_deadline = [float("inf")]  # monotonic time the running capped step must end by


class Skip(Exception):
    """A step that cannot run here, with the reason (recorded as skipped, not as an error)."""


class StepFailed(Exception):
    """A step that failed with partial results worth keeping (recorded as the entry's detail)."""

    def __init__(self, message: str, detail):
        super().__init__(message)
        self.detail = detail


def _left() -> float:
    """Seconds left to the running step (its cap, or the total budget)."""
    return min(_deadline[0], T0 + TOTAL_BUDGET_S) - time.monotonic()


def _ensure_importable() -> None:
    """Fall back to the checkout's sources when chipset is not installed (no entry points then)."""
    try:
        import chipset  # noqa: F401
        import chipset_accelerator  # noqa: F401
        import chipset_cuda  # noqa: F401
    except ImportError:
        for sub in ("core", "plugins/accelerator", "plugins/cuda", "plugins/cpu_sim"):
            sys.path.insert(0, str(ROOT / sub))


class Report:
    def __init__(self, out: Path):
        self.out = out
        self.data: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "steps": {}}

    def step(self, name: str, fn, *args, cap: float | None = None):
        """Run one step; ``cap`` (seconds) for the comparison steps, which share TOTAL_BUDGET_S
        instead of the core steps' BUDGET_S."""
        budget = TOTAL_BUDGET_S if cap is not None else BUDGET_S
        left = budget - (time.monotonic() - T0)
        if left < (30 if cap is not None else 5):
            self.data["steps"][name] = {"ok": False, "skipped": f"time budget spent ({budget:.0f} s)"}
            self.write()
            return None
        t = time.monotonic()
        _deadline[0] = t + min(cap, left) if cap is not None else float("inf")
        try:
            detail = fn(*args)
            entry = {"ok": True, "detail": detail}
        except Skip as exc:
            entry = {"ok": False, "skipped": str(exc)}
        except Exception as exc:
            entry = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
            if isinstance(exc, StepFailed):
                entry["detail"] = exc.detail
        _deadline[0] = float("inf")
        entry["seconds"] = round(time.monotonic() - t, 2)
        self.data["steps"][name] = entry
        word = "ok" if entry["ok"] else ("SKIP" if "skipped" in entry else "FAIL")
        print(f"[{word}] {name} ({entry['seconds']} s)" + ("" if entry["ok"] else f": {entry.get('error') or entry['skipped']}"), flush=True)
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
    if name == "grouped_mm":
        # MoE experts as the layer passes them: [tokens x top-k, hidden] rows sorted by expert, the
        # weights a transposed view. Big: a Qwen3-30B-A3B layer (hidden 2048, expert width 768, 128
        # experts, top-8) over 8,192 tokens, routed at random; small: groups of 5, 0, 15 and 17 rows.
        experts, hidden, width, rows = (128, 2048, 768, 8192 * 8) if big else (4, 64, 48, 37)
        if big:
            sizes = torch.bincount(torch.randint(0, experts, (rows,), generator=g), minlength=experts)
        else:
            sizes = torch.tensor([5, 0, 15, 17])
        offs = sizes.cumsum(0).to(torch.int32).to(dev)
        return [r(rows, hidden), r(experts, width, hidden, scale=hidden ** -0.5).transpose(1, 2), offs], {}, [0, 1]
    raise KeyError(name)


def _upstream(out):
    """The gradient fed to backward: ones for a scalar, else seeded normals in the output's dtype."""
    import torch

    if out.dim() == 0:
        return torch.ones_like(out)
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out)


def _fwd_bwd(fn, args, kwargs, need, upstream=None):
    """(output, input gradients); ``upstream`` made once by the caller where it is timed
    (drawing it on the host each call would be timed too)."""
    args = [a.detach().requires_grad_(True) if i in need else a for i, a in enumerate(args)]
    out = fn(*args, **kwargs)
    out.backward(_upstream(out) if upstream is None else upstream)
    return out.detach(), [args[i].grad for i in need]


KERNELS = ("rms_norm", "rotary_embedding", "swiglu", "cross_entropy", "scaled_dot_product_attention", "grouped_mm")


def kernels_vs_reference() -> dict:
    import torch

    import chipset
    from chipset.conformance import assert_close_to_exact, exact, tolerance

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
            ref = b.kernels.reference(name)
            up = _upstream(ref(*args, **kwargs))
            got = _fwd_bwd(impl, args, kwargs, need, up)
            want = _fwd_bwd(ref, args, kwargs, need, up)
            # the exact answer: the reference in float64 on the CPU, from the same rounded inputs
            truth = _fwd_bwd(ref, [exact(a) for a in args], {k: exact(v) for k, v in kwargs.items()}, need, exact(up))
            rtol, atol = tolerance(dtype, name, b.capabilities.tolerances)
            row = {"impl": getattr(impl, "__module__", "?") + "." + impl.__name__, "rtol": rtol, "atol": atol}
            pairs = [("forward", got[0], want[0], truth[0])]
            pairs += [(f"grad{i}", x, y, z) for i, (x, y, z) in enumerate(zip(got[1], want[1], truth[1], strict=True))]
            for what, x, y, z in pairs:
                row[what] = {"max_err_vs_reference": float((x.double().cpu() - y.double().cpu()).abs().max()),
                             "max_err_vs_exact": float((x.double().cpu() - z).abs().max()),
                             "reference_max_err_vs_exact": float((y.double().cpu() - z).abs().max())}
                try:
                    assert_close_to_exact(x, y, z, rtol, atol, f"{name}/{dtype} {what}")
                except AssertionError as exc:
                    failures.append(str(exc))
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
        up = _upstream(ref(*args, **kwargs)).to(dev)
        t_impl = _time_ms(functools.partial(_fwd_bwd, impl, args, kwargs, need, up))
        t_ref = _time_ms(functools.partial(_fwd_bwd, ref, args, kwargs, need, up))
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
    from chipset.models import Transformer
    from chipset.models.config import ModelConfig

    b = chipset.backend("cuda")
    dev = b.device.torch_device()
    t = TRAIN_GPT_SHAPE
    cfg = ModelConfig(vocab_size=t["vocab"], hidden_size=t["hidden"], num_hidden_layers=t["layers"],
                      num_attention_heads=t["heads"], num_key_value_heads=t["kv_heads"], intermediate_size=t["ffn"],
                      max_position_embeddings=t["seq"])
    model = Transformer(cfg, b.kernels).to(device=dev, dtype=torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    n_flop_params = n_params - model.embed_tokens.weight.numel()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    batch, seq = t["batch"], t["seq"]
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
            "note": "bf16 parameters and AdamW states (torch fused AdamW), no recompute, one GPU",
            **planner_step("train_gpt_1b", seconds / timed)}


TRAIN_GPT_SHAPE = {"hidden": 2048, "layers": 22, "heads": 32, "kv_heads": 4, "ffn": 5632, "vocab": 32000, "seq": 2048,
                   "batch": 8}


def planner_step(step: str, measured_s: float) -> dict:
    """The planner's step time for this step's work on this GPU (its row in
    chipset.planner.measured_steps, costed with this device's properties) beside the
    measured one; error > 0 means the planner predicted it too fast."""
    import chipset
    from chipset.planner.measured_steps import H200_STEPS, predict

    row = next(r for r in H200_STEPS if r.step == step)
    predicted = predict(row, chipset.backend("cuda").device.properties(0)).step_time_s
    return {"measured_step_ms": round(measured_s * 1e3, 1), "planner_step_ms": round(predicted * 1e3, 1),
            "planner_error": round(measured_s / predicted - 1, 4)}


def _graph_ms(fn, reps: int = 20) -> float:
    """GPU time of one ``fn()``, from a CUDA graph of ``reps`` calls (no launch overhead)."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (3 * reps)


# (M, N, K) of the sweep: squares, then the training GEMMs of a 7B-class block (hidden 4096,
# SwiGLU 11008) at 512 to 16384 tokens, then skinny ones (few tokens, as under deep pp/tp).
GEMM_SHAPES = ([(d, d, d) for d in (256, 512, 1024, 2048, 4096, 8192)]
               + [(t, n, k) for t in (512, 2048, 8192, 16384) for n, k in ((4096, 4096), (11008, 4096), (4096, 11008))]
               + [(t, 4096, 4096) for t in (64, 128, 256)] + [(8192, 1024, 4096), (8192, 4096, 1024)])


def _fit_curve(points: list[tuple[float, float]]) -> tuple[float, float, float]:
    """Least-squares fit of eff = e_max · d / (d + half) over (d, eff): (e_max, half, mean |rel err|)."""
    best = None
    for half in range(0, 4097, 8):
        x = [d / (d + half) if d + half else 1.0 for d, _ in points]
        # relative-error least squares: minimise sum((e_max x_i - y_i) / y_i)^2
        num = sum(xi / y for xi, (_, y) in zip(x, points, strict=True))
        den = sum((xi / y) ** 2 for xi, (_, y) in zip(x, points, strict=True))
        e_max = num / den
        err = sum(abs(e_max * xi - y) / y for xi, (_, y) in zip(x, points, strict=True)) / len(points)
        if best is None or err < best[2]:
            best = (e_max, float(half), err)
    return best


def gemm_curve() -> dict:
    """The planner's compute model against this GPU: the bf16 GEMM efficiency curve (fitted to
    eff = e_max · d / (d + d_half), d the smallest dimension, as chipset.planner.kernels costs
    every GEMM), flash attention forward+backward, copy bandwidth and eager launch latency,
    each beside the value the planner uses for this device."""
    import torch
    import torch.nn.functional as F

    import chipset
    from chipset.planner.assumptions import Assumptions
    from chipset.planner.kernels import gemm_curve
    from chipset.planner.measured import is_training_shape, relative_errors

    b = chipset.backend("cuda")
    props = b.device.properties(0)
    dev = b.device.torch_device()
    peak = props.peak_flops.get("bfloat16", 0.0)
    a = Assumptions()
    declared_e, declared_half = gemm_curve(props, a)
    rows, points, planner_errs = [], [], []
    for M, N, K in GEMM_SHAPES:
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        w = torch.randn(K, N, device=dev, dtype=torch.bfloat16)
        out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
        ms = _graph_ms(lambda x=x, w=w, out=out: torch.matmul(x, w, out=out))
        eff = 2 * M * N * K / (ms / 1e3) / peak
        d = min(M, N, K)
        (_, rel), = relative_errors(props, a, rows=[(M, N, K, ms * 1e3)])  # the planner's own gemm_time
        if is_training_shape(M, N, K):
            points.append((d, eff))
            planner_errs.append(rel)
        rows.append({"mnk": [M, N, K], "us": round(ms * 1e3, 1), "tflops": round(eff * peak / 1e12, 1), "eff": round(eff, 3),
                     "planner_eff": round(declared_e * d / (d + declared_half), 3),
                     "planner_us": round(ms * 1e3 * (1 + rel), 1), "training_shape": is_training_shape(M, N, K)})
        del x, w, out
    # fitted over the training shapes (chipset.planner.measured): small squares and a few
    # tokens are latency- and wave-bound, which the curve does not describe
    e_max, half, err = _fit_curve(points)
    declared_err = sum(abs(e) for e in planner_errs) / len(planner_errs)
    attn = []
    for bsz, h, s, hd in ((8, 32, 2048, 128), (2, 32, 8192, 128)):
        q, k, v = (torch.randn(bsz, h, s, hd, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        g = torch.randn(bsz, h, s, hd, device=dev, dtype=torch.bfloat16)

        def fb(q=q, k=k, v=v, g=g):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.grad(o, (q, k, v), g)

        ms = _time_ms(fb, iters=10)
        flops = 4 * bsz * h * s * s * hd / 2 * (1 + 2.5)  # causal half, backward 2.5x forward (planner's count)
        attn.append({"shape": [bsz, h, s, hd], "ms": round(ms, 3), "eff": round(flops / (ms / 1e3) / peak, 3)})
        del q, k, v, g
    src = torch.empty(2**30, device=dev, dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy_ms = _time_ms(lambda src=src, dst=dst: dst.copy_(src), iters=10)
    bw = 2 * 2**30 / (copy_ms / 1e3)
    tiny = torch.zeros(16, device=dev)
    torch.cuda.synchronize()
    n, t = 2000, time.perf_counter()
    for _ in range(n):
        tiny.add_(1.0)
    torch.cuda.synchronize()
    launch = (time.perf_counter() - t) / n
    torch.cuda.empty_cache()
    return {"peak_bf16_tflops": round(peak / 1e12, 1), "gemms": rows,
            "fit": {"e_max": round(e_max, 3), "d_half": half, "mean_rel_err": round(err, 3)},
            "planner": {"e_max": declared_e, "d_half": declared_half, "training_shapes_mean_rel_err": round(declared_err, 3),
                        "training_shapes_worst_rel_err": round(max(planner_errs, key=abs), 3),
                        "attention_efficiency": props.attention_efficiency or a.attention_efficiency,
                        "memory_efficiency": a.memory_efficiency, "kernel_launch_latency_s": props.kernel_launch_latency
                        or a.kernel_launch_latency},
            "attention_fwd_bwd": attn,
            "copy": {"bytes_per_s": round(bw / 1e9, 1), "fraction_of_declared": round(bw / props.memory_bandwidth, 3)
                     if props.memory_bandwidth else None},
            "eager_launch_s": round(launch, 7)}


# MosaicML's MPT-7B and MPT-13B blocks at the micro-batches of their H100 rows in the planner's
# published table (6 and 2 x 2048 tokens, no recompute): a few blocks are enough to time.
MPT_BLOCKS = ({"name": "mpt-7b", "hidden": 4096, "heads": 32, "layers": 32, "micro_batch": 6},
              {"name": "mpt-13b", "hidden": 5120, "heads": 40, "layers": 40, "micro_batch": 2})
MPT_TIMED_BLOCKS = 4


def mpt_block_stack(hidden: int, heads: int, n: int):
    """``n`` MPT blocks as llm-foundry builds them for the published rows (no biases, no
    dropout, attention as one causal SDPA call), from stock torch parts."""
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(hidden, bias=False), nn.LayerNorm(hidden, bias=False)
            self.wqkv, self.out = nn.Linear(hidden, 3 * hidden, bias=False), nn.Linear(hidden, hidden, bias=False)
            self.up, self.down = nn.Linear(hidden, 4 * hidden, bias=False), nn.Linear(4 * hidden, hidden, bias=False)

        def forward(self, x):
            bsz, s, h = x.shape
            q, k, v = self.wqkv(self.norm1(x)).view(bsz, s, 3, heads, h // heads).permute(2, 0, 3, 1, 4)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(bsz, s, h)
            x = x + self.out(att)
            return x + self.down(F.gelu(self.up(self.norm2(x))))

    return nn.Sequential(*(Block() for _ in range(n)))


def mpt_blocks() -> dict:
    """The blocks of the planner's known-gap rows on this GPU: MPT-7B and MPT-13B blocks (LayerNorm
    without bias, fused QKV, causal flash SDPA, GELU MLP of 4x width, bf16 parameters as FSDP
    gathers them) timed forward+backward in plain torch at the published micro-batch, beside
    chipset.planner.measured_steps.blocks_time for the same blocks on this device. Planner
    error near 0 here and +20-29% on MosaicML's 2023 H100 rows puts the gap in that run's
    software or clocks; an error near theirs puts it in the cost model."""
    import torch

    import chipset
    from chipset.planner.measured_steps import blocks_time
    from chipset.planner.published import _mpt

    b = chipset.backend("cuda")
    props = b.device.properties(0)
    dev = b.device.torch_device()
    out = []
    for cfg in MPT_BLOCKS:
        spec = _mpt(cfg["hidden"], cfg["heads"], cfg["layers"])
        with torch.device(dev):  # initialised on the GPU: a billion parameters take seconds on the host
            stack = mpt_block_stack(cfg["hidden"], cfg["heads"], MPT_TIMED_BLOCKS).to(dtype=torch.bfloat16)
        x = torch.randn(cfg["micro_batch"], spec.seq_len, cfg["hidden"], device=dev, dtype=torch.bfloat16,
                        requires_grad=True)
        g = torch.randn_like(x)

        def fb(stack=stack, x=x, g=g):
            stack.zero_grad(set_to_none=True)  # each backward writes fresh gradients, none accumulated
            x.grad = None
            stack(x).backward(g)

        ms = _time_ms(fb, iters=10)
        planner_ms = blocks_time(spec, cfg["micro_batch"], MPT_TIMED_BLOCKS, props) * 1e3
        out.append({"model": cfg["name"], "blocks": MPT_TIMED_BLOCKS, "micro_batch": cfg["micro_batch"],
                    "seq_len": spec.seq_len, "measured_ms": round(ms, 2), "planner_ms": round(planner_ms, 2),
                    "planner_error": round(ms / planner_ms - 1, 4)})
        del stack, x, g
        torch.cuda.empty_cache()
    return {"rows": out, "note": "forward+backward of the blocks alone (no logits, optimizer or communication); "
                                 "planner_error > 0: the planner predicted them too fast"}


def engine_train(out_dir: Path) -> dict:
    """``chipset train`` itself on this GPU: the engine (one rank), bf16, the registry's kernels,
    a ~0.4B-parameter transformer; tokens/s, MFU and loss read back from metrics.jsonl."""
    import chipset

    chipset.backend("cuda")  # the reason, where cuda is unavailable
    run_dir = out_dir / "engine_run"
    shutil.rmtree(run_dir, ignore_errors=True)
    e = ENGINE_SHAPE
    sets = [f"model.hidden_size={e['hidden']}", f"model.num_hidden_layers={e['layers']}",
            f"model.num_attention_heads={e['heads']}", f"model.num_key_value_heads={e['kv_heads']}",
            f"model.intermediate_size={e['ffn']}", f"model.vocab_size={e['vocab']}",
            f"model.max_position_embeddings={e['seq']}", f"train.seq_len={e['seq']}",
            f"train.global_batch={e['batch']}", "train.steps=25",
            "train.dtype=\"bfloat16\"", "train.lr=3e-4", "train.log_every=5", "train.checkpoint_every=0"]
    args = ["train", "--run-dir", str(run_dir)]
    for s_ in sets:
        args += ["--set", s_]
    r = _cli(*args, timeout=150, env={"CHIPSET_BACKEND": "cuda"})
    (out_dir / "engine_train.log").write_text(r.stdout + "\n" + r.stderr)
    if r.returncode != 0:
        raise RuntimeError(f"chipset train exit {r.returncode}: {(r.stdout + r.stderr)[-1500:]}")
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steady = [x for x in recs if x.get("step", 0) > 5]
    tps = sorted(x["tokens_per_s"] for x in steady)
    mfus = sorted(x["mfu"] for x in steady if x.get("mfu") is not None)
    losses = [x["loss"] for x in recs]
    assert losses[-1] < losses[0], f"loss did not fall: {losses}"
    return {"steps": len(recs), "median_tokens_per_s": round(tps[len(tps) // 2]) if tps else None,
            "median_mfu": round(mfus[len(mfus) // 2], 4) if mfus else None,
            "loss_first_last": [round(losses[0], 3), round(losses[-1], 3)],
            "peak_memory_gib": round(recs[-1]["peak_memory_bytes"] / 2**30, 1) if recs[-1].get("peak_memory_bytes") else None,
            "config": sets,
            **(planner_step("engine_train", e["batch"] * e["seq"] / tps[len(tps) // 2]) if tps else {})}


ENGINE_SHAPE = {"hidden": 2048, "layers": 8, "heads": 16, "kv_heads": 4, "ffn": 5632, "vocab": 32000, "seq": 2048,
                "batch": 8}


def plain_torch_gpu() -> dict:
    """The honest peer of ``engine_train``: the same architecture and batch in plain PyTorch
    (benchmarks/plain_torch_lm.py's model: nn.Linear, nn.RMSNorm, SDPA, no chipset), the
    usual bf16 recipe (fp32 parameters under torch.autocast, fused AdamW, gradient clipping)."""
    import importlib.util
    import types

    import torch

    import chipset

    chipset.backend("cuda")  # the reason, where cuda is unavailable
    spec = importlib.util.spec_from_file_location("plain_torch_lm", ROOT / "benchmarks" / "plain_torch_lm.py")
    plain = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plain)
    a = types.SimpleNamespace(**ENGINE_SHAPE)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = plain.Stage(a, 0, a.layers, True, True).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), fused=True)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), device=dev)
    x, y = tokens[:, :-1], tokens[:, 1:]
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for _ in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = plain.loss_fn(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
        losses.append(float(loss.detach()))
    steady = sorted(times[5:])
    out = {"median_tokens_per_s": round(a.batch * a.seq / steady[len(steady) // 2]),
           "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1),
           "loss_first_last": [round(losses[0], 3), round(losses[-1], 3)], "shape": ENGINE_SHAPE,
           "recipe": "fp32 parameters, torch.autocast(bfloat16), fused AdamW, clip_grad_norm_",
           **planner_step("plain_torch_gpu", steady[len(steady) // 2])}
    del model, opt
    torch.cuda.empty_cache()
    return out


def conformance(out_dir: Path) -> dict:
    help_text = _cli("conformance", "--help", timeout=60)
    if help_text.returncode != 0:
        if "invalid choice" not in help_text.stderr:  # chipset itself failed, not a missing command
            raise RuntimeError(f"`chipset conformance --help` exit {help_text.returncode}: {help_text.stderr[-1500:]}")
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


# --- comparison steps (gpu_check_peers.py: shapes, configs, parsing) -------------------------------
def _train_run(out_dir: Path, name: str, sets: list[str], timeout: float) -> dict:
    """One `chipset train` run on cuda; its summary from metrics.jsonl (gpu_check_peers.run_summary)."""
    run_dir = out_dir / name
    shutil.rmtree(run_dir, ignore_errors=True)
    args = ["train", "--run-dir", str(run_dir)]
    for s_ in sets:
        args += ["--set", s_]
    try:
        r = _cli(*args, timeout=timeout, env={"CHIPSET_BACKEND": "cuda"})
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{name}: chipset train did not finish within its {timeout:.0f} s") from None
    (out_dir / f"{name}.log").write_text(r.stdout + "\n" + r.stderr)
    if r.returncode != 0:
        raise RuntimeError(f"{name}: chipset train exit {r.returncode}: {(r.stdout + r.stderr)[-1500:]}")
    return {**peers.run_summary(peers.parse_chipset_metrics((run_dir / "metrics.jsonl").read_text())), "config": sets}


def fp8_vs_bf16(out_dir: Path) -> dict:
    """`chipset train` of ENGINE_SHAPE (~0.4B) with train.fp8 = tensorwise beside bf16: tokens/s ratio
    (goal >= 1.25), loss after the same steps on the same data."""
    import chipset

    b = chipset.backend("cuda")  # the reason, where cuda is unavailable
    if "tensorwise" not in b.capabilities.fp8:
        raise Skip(f"this GPU's cuda backend declares no tensorwise FP8 GEMM (Capabilities.fp8: {b.capabilities.fp8})")
    runs = peers.fp8_runs(ENGINE_SHAPE)
    bf16 = _train_run(out_dir, "fp8_bf16_run", runs["bf16"], timeout=_left() / 2)
    fp8 = _train_run(out_dir, "fp8_fp8_run", runs["fp8"], timeout=_left())
    return peers.fp8_result(bf16, fp8)


def lora_memory(out_dir: Path) -> dict:
    """`chipset train` of ENGINE_SHAPE, full fine-tune beside model.lora_rank = 8: peak memory of
    both; training state (AdamW moments, masters, gradients) counted by benchmarks/lora_memory.py
    on the cuda backend for the same model."""
    import chipset

    chipset.backend("cuda")  # the reason, where cuda is unavailable
    runs = peers.lora_runs(ENGINE_SHAPE)
    full = _train_run(out_dir, "lora_full_run", runs["full"], timeout=_left() * 0.4)
    lora = _train_run(out_dir, "lora_lora_run", runs["lora"], timeout=_left() * 0.6)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "lora_memory.py"), "--rank", str(peers.LORA_RANK)]
    for s_ in peers.shape_sets(ENGINE_SHAPE):
        cmd += ["--set", s_]
    env = dict(os.environ, CHIPSET_BACKEND="cuda")  # one process, no launcher: a private world of one
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=max(10.0, _left()), env=env)
    if r.returncode != 0:
        raise RuntimeError(f"benchmarks/lora_memory.py exit {r.returncode}: {(r.stdout + r.stderr)[-1500:]}")
    return peers.lora_result(full, lora, peers.parse_lora_memory(r.stdout))


def torchtitan_peer(out_dir: Path, only: tuple[str, ...] = ()) -> dict:
    """torchtitan as the GPU peer: each TITAN_SHAPES row trained by `chipset train` and by torchtitan
    (torchrun, one GPU), eager and compiled, same data and recipe; tokens/s, MFU, peak memory, loss
    side by side. ``only``: rows as "shape:eager" / "shape:compile" (empty = all, in table order)."""
    standins = out_dir / "titan_standins"
    stood_in = peers.write_standins(standins, peers.missing_modules())
    reason = peers.titan_importable(timeout=min(120.0, _left()), path=str(standins))
    if reason:
        raise Skip(f"torchtitan not importable: {reason}")
    import chipset

    b = chipset.backend("cuda")  # the reason, where cuda is unavailable
    memory = b.device.properties(0).total_memory
    data = peers.write_token_file(out_dir / "titan_tokens.bin", 600_000)
    rows = {}
    for shape_name, shape in peers.TITAN_SHAPES.items():
        for mode in ("eager", "compile"):
            key = f"{shape_name}:{mode}"
            if only and key not in only:
                continue
            if _left() < 60:
                rows[key] = {"skipped": "the step's time cap is spent"}
                continue
            state = peers.TRAINING_STATE_BYTES_PER_PARAM * peers.titan_params(shape)
            if state > 0.8 * memory:  # the table is sized for an H200; an 80 GB GPU cannot hold the 8B row
                rows[key] = {"skipped": f"weights, gradients and AdamW state alone are {state / 1e9:.0f} GB, "
                                        f"over 80% of this GPU's {memory / 1e9:.0f} GB"}
                continue
            row_dir = out_dir / f"titan_{shape_name}_{mode}"
            row_dir.mkdir(parents=True, exist_ok=True)
            compile_ = mode == "compile"
            sets = peers.chipset_sets(shape, steps=peers.TITAN_STEPS, compile_=compile_, data_path=str(data))
            try:
                ours = _train_run(out_dir, f"titan_chipset_{shape_name}_{mode}", sets, timeout=_left() / 2)
            except RuntimeError as exc:
                ours = {"error": str(exc)[-1500:]}
            run = peers.titan_run(shape, steps=peers.TITAN_STEPS, compile_=compile_, data_path=str(data),
                                  dump_folder=str(row_dir / "dump"))
            (row_dir / "chipset_titan_peer.py").write_text(peers.titan_module(run))
            cmd, env = peers.titan_command(str(row_dir))
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                x for x in (env["PYTHONPATH"], str(standins), os.environ.get("PYTHONPATH")) if x))
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=max(10.0, _left()), env=env, cwd=row_dir)
                log = r.stdout + "\n" + r.stderr
                (row_dir / "torchtitan.log").write_text(log)
                theirs = peers.run_summary(peers.parse_titan_log(log)) if r.returncode == 0 else {
                    "error": f"torchtitan exit {r.returncode}: {log[-1500:]}"}
            except subprocess.TimeoutExpired:
                theirs = {"error": "torchtitan did not finish within the step's time left"}
            except ValueError as exc:
                theirs = {"error": str(exc)}
            ok = "error" not in ours and "error" not in theirs
            rows[key] = {**(peers.side_by_side(ours, theirs) if ok else {"chipset": ours, "torchtitan": theirs}),
                         "shape": shape, "torchtitan_run": run}
    failed = [k for k, v in rows.items() if "error" in (v.get("chipset") or {}) or "error" in (v.get("torchtitan") or {})]
    detail = {"rows": rows, "notes": peers.TITAN_NOTES, "stand_ins": stood_in}
    if failed:
        raise StepFailed(f"rows failed: {', '.join(failed)} (their errors are in the rows)", detail)
    return detail


def _comparison_lines(data: dict) -> list[str]:
    """The FP8, LoRA and torchtitan tables of the summary."""
    lines: list[str] = []
    fp8 = (data["steps"].get("fp8_vs_bf16") or {}).get("detail") or {}
    if fp8:
        lines += ["", "| ~0.4B, chipset train | tokens/s | MFU | peak GiB | loss first -> last |", "|---|---|---|---|---|"]
        lines += [f"| {k} | {fp8[k]['median_tokens_per_s']} | {fp8[k]['median_mfu']} | {fp8[k]['peak_memory_gib']} | "
                  f"{fp8[k]['loss_first_last'][0]} -> {fp8[k]['loss_first_last'][1]} |" for k in ("bf16", "fp8")]
        lines.append(f"FP8/bf16 tokens/s {fp8['tokens_per_s_ratio']} (goal >= {fp8['goal']}: "
                     f"{'met' if fp8['meets_goal'] else 'not met'}); final loss FP8 - bf16 {fp8['final_loss_gap']:+}")
    lora = (data["steps"].get("lora_memory") or {}).get("detail") or {}
    if lora:
        opt = lora["optimizer_state_gib"]
        lines += ["", "| ~0.4B, chipset train | peak GiB | AdamW state GiB | tokens/s |", "|---|---|---|---|",
                  f"| full fine-tune | {lora['full']['peak_memory_gib']} | {opt['full']} | {lora['full']['median_tokens_per_s']} |",
                  f"| LoRA rank {peers.LORA_RANK} | {lora['lora']['peak_memory_gib']} | {opt['lora']} | "
                  f"{lora['lora']['median_tokens_per_s']} |", f"LoRA/full peak memory {lora['peak_memory_ratio']}"]
    rows = ((data["steps"].get("torchtitan_peer") or {}).get("detail") or {}).get("rows") or {}
    if rows:
        lines += ["", "| shape:mode | side | tokens/s | MFU | peak GiB | loss first -> last | chipset/torchtitan tokens/s |",
                  "|---|---|---|---|---|---|---|"]
        for key, row in rows.items():
            for side in ("chipset", "torchtitan"):
                r = row.get(side) or {}
                if "median_tokens_per_s" in r:
                    lines.append(f"| {key} | {side} | {r['median_tokens_per_s']} | {r['median_mfu']} | {r['peak_memory_gib']} | "
                                 f"{r['loss_first_last'][0]} -> {r['loss_first_last'][1]} | "
                                 f"{row.get('tokens_per_s_ratio', '') if side == 'torchtitan' else ''} |")
    return lines


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
    eng = (data["steps"].get("engine_train") or {}).get("detail") or {}
    if eng:
        lines += ["", f"chipset train (engine, 1 rank, bf16, ~0.4B): {eng['median_tokens_per_s']} tokens/s, "
                  f"MFU {eng['median_mfu']}, peak {eng['peak_memory_gib']} GiB, loss {eng['loss_first_last']}"]
    peer = (data["steps"].get("plain_torch_gpu") or {}).get("detail") or {}
    if peer:
        ratio = f"; chipset/plain {eng['median_tokens_per_s'] / peer['median_tokens_per_s']:.3f}" if eng else ""
        lines += [f"plain PyTorch, same shape ({peer['recipe']}): {peer['median_tokens_per_s']} tokens/s, "
                  f"peak {peer['peak_memory_gib']} GiB{ratio}"]
    mpt = ((data["steps"].get("mpt_blocks") or {}).get("detail") or {}).get("rows") or []
    if mpt:
        lines += ["", "| MPT blocks (fwd+bwd) | micro-batch | measured ms | planner ms | planner error |", "|---|---|---|---|---|"]
        lines += [f"| {r['blocks']} x {r['model']} | {r['micro_batch']} x {r['seq_len']} | {r['measured_ms']} | "
                  f"{r['planner_ms']} | {r['planner_error']:+.1%} |" for r in mpt]
    steps = [(n, (data["steps"].get(n) or {}).get("detail") or {}) for n in ("train_gpt_1b", "engine_train", "plain_torch_gpu")]
    steps = [(n, d) for n, d in steps if "planner_step_ms" in d]
    if steps:
        lines += ["", "| step | measured ms/step | planner ms/step | planner error |", "|---|---|---|---|"]
        lines += [f"| {n} | {d['measured_step_ms']} | {d['planner_step_ms']} | {d['planner_error']:+.1%} |" for n, d in steps]
    curve = (data["steps"].get("gemm_curve") or {}).get("detail") or {}
    if curve:
        f, pl = curve["fit"], curve["planner"]
        lines += ["", f"bf16 GEMM curve fitted over the training shapes: e_max {f['e_max']}, d_half {f['d_half']} "
                  f"(mean rel. err {f['mean_rel_err']}); the planner's time (e_max {pl['e_max']}, d_half {pl['d_half']}) "
                  f"on those: mean rel. err {pl['training_shapes_mean_rel_err']}, worst {pl['training_shapes_worst_rel_err']}",
                  "", "| M x N x K | us | TFLOP/s | efficiency | planner's us | training shape |", "|---|---|---|---|---|---|"]
        for r in curve["gemms"]:
            lines.append(f"| {' x '.join(map(str, r['mnk']))} | {r['us']} | {r['tflops']} | {r['eff']} | {r['planner_us']} | "
                         f"{'yes' if r['training_shape'] else 'no'} |")
        lines += ["", f"flash attention fwd+bwd efficiency: {[(a['shape'], a['eff']) for a in curve['attention_fwd_bwd']]} "
                  f"(planner {pl['attention_efficiency']}); copy {curve['copy']}; eager launch {curve['eager_launch_s']} s "
                  f"(planner {pl['kernel_launch_latency_s']})"]
    tp = (data["steps"].get("throughput") or {}).get("detail") or {}
    if tp:
        lines += ["", "| throughput | TFLOP/s | fraction of declared peak |", "|---|---|---|"]
        for k, r in tp.items():
            if isinstance(r, dict):
                lines.append(f"| {k} | {r.get('tflops')} | {r.get('fraction_of_peak')} |")
    lines += _comparison_lines(data)
    if data.get("not_selected"):
        lines += ["", f"Not selected (--steps): {', '.join(data['not_selected'])}."]
    lines += ["", f"Total {data.get('seconds')} s; all ok: {data.get('all_ok')}.",
              "Command: `bash plugins/cuda/gpu_check.sh` (results in $OUT/gpu_check.json)."]
    return "\n".join(lines) + "\n"


def selected_steps(spec: str, names: list[str]) -> set[str]:
    """The step names ``--steps`` picks: names or groups (all, core, fp8, lora, torchtitan)."""
    extra = {n for g in GROUPS.values() for n in g}
    groups = {"all": set(names), "core": {n for n in names if n not in extra}, **{k: set(v) for k, v in GROUPS.items()}}
    out: set[str] = set()
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        if part in groups:
            out |= groups[part]
        elif part in names:
            out.add(part)
        else:
            raise SystemExit(f"--steps: unknown step or group {part!r}; expected one of {', '.join(list(groups) + names)}")
    return out


def main() -> int:
    global TOTAL_BUDGET_S
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"), help="directory for gpu_check.json/.md")
    ap.add_argument("--steps", default="all",
                    help="comma-separated step names or groups: all, core, fp8, lora, torchtitan (default all)")
    ap.add_argument("--titan", default="", help="torchtitan_peer rows, e.g. llama3_1b:eager,llama3_1b:compile (default all)")
    ap.add_argument("--budget", type=float, default=TOTAL_BUDGET_S, help="seconds for everything (default 540)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _ensure_importable()
    TOTAL_BUDGET_S = args.budget
    plan = [("environment", environment, ()), ("chipset_backends", backends, ()), ("chipset_info", info, ()),
            ("probe_fork_safe", probe_is_fork_safe, ()), ("interfaces", interfaces, ()),
            ("collective_nccl_world1", collective, ()), ("kernels_vs_reference", kernels_vs_reference, ()),
            ("kernel_speed", kernel_speed, ()), ("throughput", throughput, ()), ("gemm_curve", gemm_curve, ()),
            ("mpt_blocks", mpt_blocks, ()), ("train_gpt_1b", train_gpt, ()), ("engine_train", engine_train, (out,)),
            ("plain_torch_gpu", plain_torch_gpu, ()), ("conformance", conformance, (out,)),
            ("fp8_vs_bf16", fp8_vs_bf16, (out,)), ("lora_memory", lora_memory, (out,)),
            ("torchtitan_peer", torchtitan_peer, (out, tuple(x for x in args.titan.split(",") if x)))]
    chosen = selected_steps(args.steps, [n for n, _, _ in plan])
    rep = Report(out)
    rep.data["not_selected"] = [n for n, _, _ in plan if n not in chosen]
    for name, fn, fn_args in plan:
        if name in chosen:
            rep.step(name, fn, *fn_args, cap=CAPS.get(name))
    rep.write()
    print(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'} in {time.monotonic() - T0:.0f} s")
    return 0 if rep.data["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
