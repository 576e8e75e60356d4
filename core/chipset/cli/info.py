"""``chipset info``: the selected backend's devices, memory and capabilities."""

from __future__ import annotations

import json


def add_parser(sub) -> None:
    p = sub.add_parser("info", help="show the selected backend's devices, memory and capabilities")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=run)


def collect() -> dict:
    from chipset.loader import backend

    b = backend()
    devices = []
    for i in range(b.device.device_count()):
        props = b.device.properties(i).to_dict()
        free, total = b.memory.mem_get_info(i)
        props["memory"] = {"free": free, "total": total}
        devices.append(props)
    return {
        "backend": b.name,
        "selection_reason": b.selection_reason,
        "distribution": b.record.distribution,
        "version": b.record.version,
        "device_type": b.device.device_type,
        "visible_devices_env": b.device.visible_devices_env,
        "device_count": b.device.device_count(),
        "c10d_backend": b.collective.c10d_backend,
        "devices": devices,
        "capabilities": b.capabilities.to_dict(),
        "kernels": b.kernels.matrix(),
    }


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def run(args) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"backend: {info['backend']} ({info['distribution']} {info['version']}) - {info['selection_reason']}")
    print(f"torch device type: {info['device_type']}; collectives: {info['c10d_backend']}; "
          f"visible devices: {info['visible_devices_env']}")
    print(f"devices: {info['device_count']}")
    for d in info["devices"]:
        flops = ", ".join(f"{k} {v / 1e12:g} TFLOP/s" for k, v in d["peak_flops"].items())
        est = " (estimate)" if d["estimated"] else ""
        parts = [_gib(d["total_memory"]), flops or "peak FLOP/s unknown",
                 f"memory {d['memory_bandwidth'] / 1e9:g} GB/s" if d["memory_bandwidth"] else "memory bandwidth unknown"]
        print(f"  [{d['index']}] {d['name']}: {', '.join(parts)}{est}")
    caps = info["capabilities"]
    print(f"dtypes: {', '.join(caps['dtypes'])}")
    print(f"amp dtypes: {', '.join(caps['amp_dtypes']) or '-'}; train.dtype = \"auto\" trains in {caps['default_dtype']}")
    print(f"collectives: {', '.join(caps['collectives'])}")
    print(f"streams: {caps['streams']}, event timing: {caps['event_timing']}, graph capture: {caps['graph_capture']}")
    print(f"fp8 GEMM scalings (train.fp8): {', '.join(caps['fp8']) or '-'}")
    own = caps["kernels"]
    print(f"kernels: {len(info['kernels'])} ({', '.join(own) + ' native, ' if own else ''}rest by core reference)")
    return 0
