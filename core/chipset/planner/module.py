"""Models outside the reference family: count a real nn.Module on meta tensors.

``package.module:factory`` names a callable returning an ``nn.Module``. It is built under
``torch.device("meta")`` (no memory, no data), run forward and backward on a meta batch
under torch's FlopCounterMode, and autograd's saved-tensor hooks add up what the backward
keeps. That answers data-parallel questions (gradient volume, step time for a batch on a
cluster) for any model; tensor, pipeline, expert and context parallelism need the
reference family's structure and are not searched here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from chipset.errors import ConfigError

__all__ = ["ModuleProfile", "evaluate_module", "load_factory", "profile_module", "search_module"]


@dataclass(frozen=True)
class ModuleProfile:
    """What one sample costs a module, counted on meta tensors."""

    name: str
    """The factory spec."""
    params: int
    """Parameters (all of them are assumed trained and data-parallel)."""
    forward_flops_per_sample: float
    """Forward FLOPs per sample from torch.utils.flop_counter."""
    train_flops_per_sample: float
    """Forward + backward FLOPs per sample (what the counter saw during backward too)."""
    activation_bytes_per_sample: float
    """Bytes of tensors autograd saves for backward per sample, parameters excluded, in the
    traced dtype (views share their base; a tensor saved by two ops counts once)."""
    traced_dtype_bytes: int
    """Bytes per element of the traced floating-point tensors (4 for float32)."""


def load_factory(spec: str):
    """Import ``package.module:factory`` and return the callable; ConfigError when it cannot."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise ConfigError(f"--module {spec!r}: expected package.module:factory (a callable returning an nn.Module)")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as exc:
        raise ConfigError(f"--module {spec!r}: cannot import {mod_name!r} ({exc}); check PYTHONPATH") from None
    obj = mod
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ConfigError(f"--module {spec!r}: {mod_name!r} has no attribute {attr!r}")
    if not callable(obj):
        raise ConfigError(f"--module {spec!r}: {attr!r} is not callable")
    return obj


def profile_module(spec: str, input_shape: tuple[int, ...], input_dtype: str = "float32",
                   batch: int = 2) -> ModuleProfile:
    """Count parameters, training FLOPs and saved activations per sample of the module ``spec`` builds."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from chipset.parallel.meta import on_meta

    factory = load_factory(spec)
    dtype = getattr(torch, input_dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"--input-dtype {input_dtype!r} is not a torch dtype (for example float32 or int64)")
    with on_meta():
        module = factory()
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"--module {spec!r}: the factory returned {type(module).__name__}, expected an nn.Module")
    module = module.to("meta")
    if dtype.is_floating_point:
        x = torch.empty((batch, *input_shape), device="meta", dtype=dtype)
    else:
        x = torch.zeros((batch, *input_shape), device="meta", dtype=dtype)
    kept: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if not (base.is_leaf and base.requires_grad):  # parameters are model state, not activations
            kept[id(base)] = base
        return t

    with FlopCounterMode(display=False) as counter:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = module(x)
        fwd = counter.get_total_flops()
        if isinstance(out, (tuple, list)):
            out = out[0]
        if not isinstance(out, torch.Tensor):
            raise ConfigError(f"--module {spec!r}: forward returned {type(out).__name__}; expected a tensor")
        out.float().sum().backward()
    total = counter.get_total_flops()
    act = sum(t.numel() * t.element_size() for t in kept.values())
    params = sum(p.numel() for p in module.parameters())
    return ModuleProfile(name=spec, params=params, forward_flops_per_sample=fwd / batch,
                         train_flops_per_sample=total / batch, activation_bytes_per_sample=act / batch,
                         traced_dtype_bytes=x.element_size() if dtype.is_floating_point else 4)


def evaluate_module(prof: ModuleProfile, lay, train, cl, assumptions=None):
    """Predict a data-parallel layout (dp = all devices, ZeRO stage, micro-batch) of a profiled module.

    Compute is the counted FLOPs at gemm_efficiency of peak (the counter sees matmuls,
    convolutions and attention; memory-bound ops are not modelled); activations are scaled
    from the traced dtype to the compute dtype; ``tokens_per_s`` counts samples.
    """
    from chipset.planner.assumptions import Assumptions
    from chipset.planner.comm import data_parallel_items
    from chipset.planner.memory import MemoryBreakdown, zero_model_state_bytes
    from chipset.planner.time import Prediction, dp_exposed_time, optimizer_time

    a = assumptions or Assumptions()
    peak = cl.device.peak_flops_for(train.dtype)
    if peak <= 0:
        raise ConfigError(f"device profile {cl.profile!r} declares no peak FLOP/s for {train.dtype}")
    mb = max(1, train.global_batch // (lay.dp * lay.micro_batch))
    p, g, o = zero_model_state_bytes(prof.params, lay.dp, lay.zero, train)
    act = prof.activation_bytes_per_sample * lay.micro_batch * train.param_bytes / prof.traced_dtype_bytes
    buf = 0.0
    mem = MemoryBreakdown(params=p, grads=g, optimizer=o, zero3_buffer=buf, activations=act)
    t_mb = prof.train_flops_per_sample * lay.micro_batch / (peak * a.gemm_efficiency)
    fwd_share = prof.forward_flops_per_sample / prof.train_flops_per_sample if prof.train_flops_per_sample else 1 / 3
    items = data_parallel_items(lay, train, cl, float(prof.params), 0.0, mb)
    exposed = dp_exposed_time(items, t_mb * fwd_share, t_mb * (1 - fwd_share), mb, a)
    shard = prof.params / lay.dp if lay.zero >= 1 else prof.params
    t_opt = optimizer_time(train, shard, cl.device.memory_bandwidth, a)
    step = t_mb * mb + exposed + t_opt
    n = lay.dp
    flops = prof.train_flops_per_sample * train.global_batch
    return Prediction(
        layout=lay, micro_batches=mb, memory=mem, memory_limit_bytes=cl.device.total_memory * a.memory_usable_fraction,
        step_time_s=step, tokens_per_s=train.global_batch / step, tflops_per_device=flops / step / n / 1e12,
        mfu=flops / step / n / peak,
        breakdown={"compute": t_mb * mb, "gemm_efficiency": a.gemm_efficiency, "tp": 0.0, "ep": 0.0,
                   "cp_exposed": 0.0, "pp": 0.0, "bubble": 0.0, "dp_total": sum(i.time_s for i in items),
                   "dp_exposed": exposed, "step_comm": 0.0, "optimizer": t_opt},
        comm=tuple(items),
    )


def search_module(prof: ModuleProfile, train, cl, fix=None, assumptions=None):
    """Data-parallel layouts of a profiled module (dp = every device), fastest fitting first."""
    from chipset.errors import UsageError
    from chipset.planner.assumptions import Assumptions
    from chipset.planner.layout import Layout
    from chipset.planner.search import SearchResult

    a = assumptions or Assumptions()
    fix = dict(fix or {})
    n = cl.world_size
    for k in ("tp", "pp", "ep", "cp"):
        if fix.get(k, 1) != 1:
            raise ConfigError(f"--fix parallel.{k}={fix[k]}: a --module model is planned data-parallel only "
                              f"(tp, pp, ep and cp need the reference transformer's structure)")
    if fix.get("dp", n) != n:
        raise ConfigError(f"--fix parallel.dp={fix['dp']}: with --module, dp is every device ({n})")
    if train.global_batch % n:
        raise ConfigError(f"global batch ({train.global_batch}) is not divisible by dp ({n}); "
                          f"choose a multiple of {n}")
    local = train.global_batch // n
    b_fixed = fix.get("micro_batch")
    if b_fixed and local % b_fixed:
        raise ConfigError(f"global batch ({train.global_batch}) is not divisible by dp x micro-batch "
                          f"({n} x {b_fixed} = {n * b_fixed})")
    mbs = [b_fixed] if b_fixed else [b for b in range(1, min(local, a.max_micro_batch) + 1) if local % b == 0]
    zeros = [fix["zero"]] if "zero" in fix else ([0, 1, 2, 3] if n > 1 else [0])
    res = SearchResult(candidates=[], layouts_enumerated=1)
    for b in mbs:
        for z in zeros:
            pred = evaluate_module(prof, Layout(dp=n, zero=z, micro_batch=b), train, cl, a)
            res.configurations_evaluated += 1
            if pred.fits:
                res.candidates.append(pred)
            else:
                res.out_of_memory += 1
                res.discarded["does not fit in device memory"] += 1
                if res.smallest_oom is None or pred.memory.total < res.smallest_oom.memory.total:
                    res.smallest_oom = pred
    if not res.candidates:
        need = res.smallest_oom.memory.total / 2**30 if res.smallest_oom else 0
        raise UsageError(f"no data-parallel layout of {prof.name} fits in device memory on {n} devices "
                         f"(the smallest needs {need:.1f} GiB per device). Use fewer samples per micro-batch "
                         "or a device with more memory.")
    res.candidates.sort(key=lambda p: (p.step_time_s, p.layout.zero, p.memory.total))
    return res
