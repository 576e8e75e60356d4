"""Datasheet properties of NVIDIA data-centre GPUs, and a labelled estimate for the rest.

Pure data: importing this module imports no CUDA and touches no device, so the
descriptor exposes the table as named profiles (``a100-80g``, ``h100-sxm``, ``h200``,
``b200``, ...) that the planner and cpu_sim's projection read on any machine.

Conventions (so every number can be checked against its source):

- ``peak_flops`` are *dense* tensor-core rates (no 2:4 sparsity) per dtype name:
  ``float64`` (FP64 tensor core), ``float32`` (non-tensor FP32), ``tf32``,
  ``bfloat16``, ``float16``, ``float8_e4m3fn``/``float8_e5m2`` (Hopper and later).
  NVIDIA datasheets print tensor rates *with* sparsity (marked ``*``); dense is half.
  Where an architecture whitepaper prints the dense figure it is used directly.
- Memory: a datasheet "80GB" is read as 80 GiB (an H100 80GB reports 81,559 MiB to
  nvidia-smi, about 79.6 GiB usable). On real hardware the measured capacity replaces it.
- ``memory_bandwidth``: datasheet HBM bandwidth, bytes/s (decimal: 1 TB/s = 1e12).
- ``nvlink``: the datasheet's NVLink figure, bytes/s, *bidirectional total* as NVIDIA
  quotes it; ``intra_node_bandwidth`` in the properties is half of it (per direction).
  PCIe cards without a bridge get their PCIe link instead (Gen4 x16 ~32 GB/s, Gen5 x16
  ~64 GB/s per direction).
- ``inter_node_bandwidth`` and the latencies are *typical-system estimates*, not
  datasheet values: one InfiniBand NIC per GPU (HDR 200 Gb/s for A100 systems, NDR
  400 Gb/s for Hopper/Blackwell DGX/HGX), ~3 us NVLink and ~10 us network latency.

Sources:
  [A100]  NVIDIA A100 Tensor Core GPU datasheet (2021) and "NVIDIA A100 Tensor Core GPU
          Architecture" whitepaper (2020), table 1: FP64 TC 19.5, FP32 19.5, TF32 156,
          BF16/FP16 312 TFLOP/s dense; 40GB HBM2 1,555 GB/s; 80GB HBM2e 2,039 GB/s (SXM),
          1,935 GB/s (PCIe); NVLink 600 GB/s; 108 SMs.
  [H100]  NVIDIA H100 Tensor Core GPU datasheet (2023) and "NVIDIA H100 Tensor Core GPU
          Architecture" whitepaper (2022), table 3 (dense): SXM5 FP64 TC 66.9, FP32 66.9,
          TF32 494.7, BF16/FP16 989.4, FP8 1,978.9 TFLOP/s, 132 SMs, HBM3 3.35 TB/s,
          NVLink 900 GB/s; PCIe FP64 TC 51.2, FP32 51.2, TF32 378, BF16/FP16 756,
          FP8 1,513 (datasheet 1,513*/2), HBM2e 2 TB/s, 114 SMs; H100 NVL 94GB: FP32 60,
          TF32 835*, BF16 1,671*, FP8 3,341*, HBM3 3.9 TB/s, NVLink 600 GB/s.
  [H200]  NVIDIA H200 Tensor Core GPU datasheet (2024): SXM 141GB HBM3e 4.8 TB/s,
          FP64 TC 67, FP32 67, TF32 989*, BF16/FP16 1,979*, FP8 3,958*; NVLink 900 GB/s.
          Same GH100 die and clocks as H100 SXM, so the dense rates are H100 SXM's.
  [B200]  NVIDIA HGX B200 / DGX B200 datasheets (2024-2025), per-GPU = 8-GPU system / 8:
          FP64 TC 296/8 = 37, FP32 600/8 = 75, TF32 18*/8, BF16/FP16 36*/8, FP8 72*/8
          PFLOP/s; HBM3e 1,440 GB total (180 GB/GPU), 64 TB/s total (8 TB/s per GPU);
          NVLink 5 1.8 TB/s per GPU; 148 SMs. B200 SKUs differ by power limit (HGX at
          1,000 W); treat these as the datasheet's nominal figures.
Sustained efficiencies (``matmul_efficiency``, ``attention_efficiency``; per architecture,
public measurements, not datasheet values): large bf16 cuBLAS GEMMs reach about 230-260 of
312 TFLOP/s on A100 (0.75, the low end: end-to-end runs also lose time between kernels) and
about 700 of 989 on H100/H200 SXM (0.70: the part does not hold its boost clock at 700 W
under tensor-core load); FlashAttention-2 sustains about 55%
of peak over forward and backward on A100 and 35-40% on H100 (Dao 2023; Shah et al. 2024,
FlashAttention-3, Fig. 1), so 0.55 and 0.40. Blackwell rows declare none (planner default).
The curve's shape (``matmul_half_dim``: efficiency halves at a smallest GEMM dimension of
128) is declared for Hopper only, where it was measured: 23 GEMMs on an H200, fitted at
104-128 over two runs (chipset.planner.measured); other rows use the planner's default.
The ``estimated`` flag is False for every row here; :func:`estimate` sets it True.
"""

from __future__ import annotations

from dataclasses import dataclass

from chipset.interfaces.device import DeviceProperties

__all__ = ["GpuSpec", "SPECS", "profiles", "lookup", "estimate", "describe", "hip_dtypes"]

GiB = 2**30
T = 1e12
GBps = 1e9

# Typical-system estimates (see module docstring), shared by every row.
_NVLINK_LATENCY = 3e-6
_NETWORK_LATENCY = 10e-6
_HDR_NIC = 200e9 / 8  # 200 Gb/s InfiniBand HDR per GPU (DGX A100)
_NDR_NIC = 400e9 / 8  # 400 Gb/s InfiniBand NDR per GPU (DGX H100/H200/B200)
# (matmul, attention) efficiency by compute-capability major (see module docstring).
_EFFICIENCY = {8: (0.75, 0.55), 9: (0.70, 0.40)}
# GEMM efficiency curve's half-dimension by compute-capability major, where measured.
_HALF_DIM = {9: 128.0}


@dataclass(frozen=True)
class GpuSpec:
    """One row of the datasheet table. Rates in FLOP/s and bytes/s, memory in bytes."""

    key: str
    """Profile name, e.g. ``"h100-sxm"``."""
    name: str
    memory: int
    fp64: float
    fp32: float
    tf32: float
    bf16: float
    fp16: float
    fp8: float
    """Dense FP8 rate; 0.0 on parts without FP8 tensor cores."""
    memory_bandwidth: float
    nvlink: float
    """NVLink bandwidth, bidirectional total as quoted; 0.0 without NVLink."""
    link_per_direction: float
    """Device-to-device bandwidth per direction within a node (NVLink/2 or PCIe)."""
    inter_node_bandwidth: float
    sms: int
    compute_capability: tuple[int, int]
    source: str

    def peak_flops(self) -> dict[str, float]:
        rates = {
            "float64": self.fp64,
            "float32": self.fp32,
            "tf32": self.tf32,
            "bfloat16": self.bf16,
            "float16": self.fp16,
        }
        if self.fp8:
            rates["float8_e4m3fn"] = self.fp8
            rates["float8_e5m2"] = self.fp8
        return rates

    def to_properties(self, index: int = 0) -> DeviceProperties:
        return DeviceProperties(
            name=self.name,
            index=index,
            total_memory=self.memory,
            peak_flops=self.peak_flops(),
            memory_bandwidth=self.memory_bandwidth,
            intra_node_bandwidth=self.link_per_direction,
            inter_node_bandwidth=self.inter_node_bandwidth,
            intra_node_latency=_NVLINK_LATENCY,
            inter_node_latency=_NETWORK_LATENCY,
            matmul_efficiency=_EFFICIENCY.get(self.compute_capability[0], (0.0, 0.0))[0],
            attention_efficiency=_EFFICIENCY.get(self.compute_capability[0], (0.0, 0.0))[1],
            matmul_half_dim=_HALF_DIM.get(self.compute_capability[0], 0.0),
            compute_capability=self.compute_capability,
            multiprocessor_count=self.sms,
            estimated=False,
            source=self.source,
        )


_A100 = "NVIDIA A100 datasheet (2021) / A100 architecture whitepaper (2020), dense rates"
_H100 = "NVIDIA H100 datasheet (2023) / H100 architecture whitepaper (2022), dense rates"
_H200 = "NVIDIA H200 datasheet (2024); dense rates of the same GH100 die as H100 SXM"
_B200 = "NVIDIA HGX/DGX B200 datasheets (2024-2025), per GPU = system/8, dense = sparse/2"

SPECS: dict[str, GpuSpec] = {
    s.key: s
    for s in (
        GpuSpec("a100-40g", "NVIDIA A100-SXM4-40GB", 40 * GiB, 19.5 * T, 19.5 * T, 156 * T, 312 * T, 312 * T, 0.0,
                1555 * GBps, 600 * GBps, 300 * GBps, _HDR_NIC, 108, (8, 0), _A100),
        GpuSpec("a100-80g", "NVIDIA A100-SXM4-80GB", 80 * GiB, 19.5 * T, 19.5 * T, 156 * T, 312 * T, 312 * T, 0.0,
                2039 * GBps, 600 * GBps, 300 * GBps, _HDR_NIC, 108, (8, 0), _A100),
        GpuSpec("a100-80g-pcie", "NVIDIA A100 80GB PCIe", 80 * GiB, 19.5 * T, 19.5 * T, 156 * T, 312 * T, 312 * T, 0.0,
                1935 * GBps, 0.0, 32 * GBps, _HDR_NIC, 108, (8, 0), _A100 + "; PCIe Gen4 link, no NVLink bridge assumed"),
        GpuSpec("h100-sxm", "NVIDIA H100 80GB HBM3", 80 * GiB, 66.9 * T, 66.9 * T, 494.7 * T, 989.4 * T, 989.4 * T, 1978.9 * T,
                3350 * GBps, 900 * GBps, 450 * GBps, _NDR_NIC, 132, (9, 0), _H100),
        GpuSpec("h100-pcie", "NVIDIA H100 PCIe", 80 * GiB, 51.2 * T, 51.2 * T, 378 * T, 756 * T, 756 * T, 1513 * T,
                2000 * GBps, 0.0, 64 * GBps, _NDR_NIC, 114, (9, 0), _H100 + "; PCIe Gen5 link, no NVLink bridge assumed"),
        GpuSpec("h100-nvl", "NVIDIA H100 NVL", 94 * GiB, 60 * T, 60 * T, 417.5 * T, 835.5 * T, 835.5 * T, 1670.5 * T,
                3900 * GBps, 600 * GBps, 300 * GBps, _NDR_NIC, 132, (9, 0), _H100 + " (H100 NVL column, sparse/2)"),
        GpuSpec("h200", "NVIDIA H200", 141 * GiB, 66.9 * T, 66.9 * T, 494.7 * T, 989.4 * T, 989.4 * T, 1978.9 * T,
                4800 * GBps, 900 * GBps, 450 * GBps, _NDR_NIC, 132, (9, 0), _H200),
        GpuSpec("b200", "NVIDIA B200", 180 * GiB, 37 * T, 75 * T, 1125 * T, 2250 * T, 2250 * T, 4500 * T,
                8000 * GBps, 1800 * GBps, 900 * GBps, _NDR_NIC, 148, (10, 0), _B200),
    )
}


def profiles() -> dict[str, DeviceProperties]:
    """Every table row as a named profile (for ``BackendDescriptor.profiles``), NVIDIA's and
    AMD's (``chipset_cuda.amd_properties``: ROCm builds of torch serve them through torch.cuda)."""
    return {**{key: spec.to_properties() for key, spec in SPECS.items()}, **amd_profiles()}


def hip_dtypes(gcn_arch: str) -> tuple:
    """Tensor dtypes an AMD GPU of this architecture (``"gfx942"``) supports natively: bf16 on
    every CDNA part ROCm torch supports (gfx90a on); FP8 in AMD's "fnuz" formats on gfx942
    (MI300X/MI325X) and the OCP formats from gfx950 on (AMD's CDNA3/CDNA4 ISA guides)."""
    import torch

    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16,
              torch.int32, torch.int64, torch.uint8, torch.bool]
    if gcn_arch == "gfx942":
        dtypes += [torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
    elif gcn_arch >= "gfx950" and gcn_arch.startswith("gfx9"):
        dtypes += [torch.float8_e4m3fn, torch.float8_e5m2]
    return tuple(dtypes)


def lookup(device_name: str, total_memory: int = 0) -> GpuSpec | None:
    """The table row for a device name as CUDA reports it, or None when the part is unknown.

    ``total_memory`` (bytes) separates the A100 40 GB and 80 GB parts.
    """
    n = device_name.upper().replace("-", " ")
    if "GH200" in n or "GB200" in n:
        return None  # Grace superchips: different memory system, not in the table
    if "B200" in n:
        return SPECS["b200"]
    if "H200" in n:
        return SPECS["h200"]
    if "H100" in n:
        if "NVL" in n:
            return SPECS["h100-nvl"]
        if "PCIE" in n:
            return SPECS["h100-pcie"]
        return SPECS["h100-sxm"]
    if "A100" in n:
        big = "80GB" in n.replace(" ", "") or total_memory > 48 * GiB
        if not big:
            return SPECS["a100-40g"]
        return SPECS["a100-80g-pcie"] if "PCIE" in n else SPECS["a100-80g"]
    return None


# Dense tensor-core FLOP per clock per SM by architecture, derived from the table's parts
# (e.g. H100 SXM: 989.4e12 / (132 SMs x 1.83 GHz) = 4096 for BF16) and, for families
# not in the table, NVIDIA's architecture whitepapers. Columns: fp32, tf32, bf16/fp16, fp8.
_PER_SM_CLOCK = {
    (7, 0): (128, 0, 1024, 0),  # Volta: FP16 tensor cores only (no bf16/tf32)
    (7, 5): (128, 0, 512, 0),  # Turing
    (8, 0): (128, 1024, 2048, 0),  # GA100
    (8, 6): (256, 512, 1024, 0),  # GA10x professional parts (A10, A40)
    (8, 9): (256, 512, 1024, 2048),  # Ada (L4, L40S)
    (9, 0): (256, 2048, 4096, 8192),  # Hopper
    (10, 0): (256, 4096, 8192, 16384),  # Blackwell data-centre
    (12, 0): (256, 512, 1024, 2048),  # Blackwell workstation/consumer
}
_ASSUMED_CLOCK_HZ = 1.5e9
_ASSUMED_BYTES_PER_FLOP = 3350e9 / 989.4e12  # H100 SXM's HBM:bf16 balance


def estimate(
    name: str,
    index: int,
    total_memory: int,
    compute_capability: tuple[int, int],
    sms: int,
    clock_hz: float | None = None,
) -> DeviceProperties:
    """Properties of a part not in the table: clearly labelled estimates (``estimated=True``).

    FLOP/s = SMs x clock x dense FLOP/clock/SM of the nearest known architecture at or
    below ``compute_capability``; memory bandwidth from H100's bytes-per-FLOP balance.
    """
    known = sorted(cc for cc in _PER_SM_CLOCK if cc <= tuple(compute_capability)) or [min(_PER_SM_CLOCK)]
    family = known[-1]
    fp32, tf32, half, fp8 = _PER_SM_CLOCK[family]
    clock = clock_hz or _ASSUMED_CLOCK_HZ
    scale = sms * clock
    rates = {"float32": fp32 * scale, "float16": half * scale}
    if tf32:
        rates["tf32"] = tf32 * scale
        rates["bfloat16"] = half * scale
    if fp8:
        rates["float8_e4m3fn"] = rates["float8_e5m2"] = fp8 * scale
    clock_note = f"{clock / 1e9:.2f} GHz" + ("" if clock_hz else " (assumed)")
    return DeviceProperties(
        name=name,
        index=index,
        total_memory=total_memory,
        peak_flops=rates,
        memory_bandwidth=rates["float16"] * _ASSUMED_BYTES_PER_FLOP,
        intra_node_bandwidth=32 * GBps,  # assume PCIe Gen4 x16, no NVLink
        inter_node_bandwidth=_HDR_NIC,
        intra_node_latency=_NVLINK_LATENCY,
        inter_node_latency=_NETWORK_LATENCY,
        compute_capability=tuple(compute_capability),
        multiprocessor_count=sms,
        estimated=True,
        source=(
            f"ESTIMATE: {name!r} is not in chipset_cuda's datasheet table; rates = {sms} SMs x "
            f"{clock_note} x per-SM rate of compute capability {family[0]}.{family[1]}; "
            "bandwidth from H100's bytes/FLOP. Measure before trusting MFU."
        ),
    )


def describe(
    name: str,
    index: int,
    total_memory: int,
    compute_capability: tuple[int, int],
    sms: int,
    clock_hz: float | None = None,
    amd: bool = False,
) -> DeviceProperties:
    """Properties of a real device: the table row with measured memory/SMs, else an estimate.
    ``amd``: a GPU of a ROCm build (the AMD rows below)."""
    if amd:
        return amd_describe(name, index, total_memory, compute_capability, sms)
    spec = lookup(name, total_memory)
    if spec is None:
        return estimate(name, index, total_memory, compute_capability, sms, clock_hz)
    props = spec.to_properties(index)
    return DeviceProperties(
        **{
            **props.to_dict(),
            "name": name,
            "total_memory": total_memory,
            "compute_capability": tuple(compute_capability),
            "multiprocessor_count": sms,
            "peak_flops": props.peak_flops,
            "source": f"{spec.source} (table row {spec.key!r})",
        }
    )


# --- AMD Instinct (ROCm builds of torch serve them through torch.cuda) ------------------
# AMD Instinct datasheet rows, for ROCm builds of torch (torch.cuda on HIP). Pure data: the descriptor exposes the rows as
# named profiles (``mi250x-gcd``, ``mi210``, ``mi300x``, ``mi325x``) on any machine.
#
# Conventions are chipset_cuda.properties' (dense rates per dtype name, decimal bandwidth,
# datasheet "GB" read as GiB, intra-node bandwidth per direction = the quoted bidirectional
# Infinity Fabric aggregate / 2). ``float32`` is the vector (non-matrix) FP32 rate,
# ``float64`` the FP64 matrix rate. Sources (AMD product pages and data sheets, amd.com):
#
#   [MI250X] AMD Instinct MI250X data sheet (2021): 220 CUs, 128 GB HBM2e at 3.2768 TB/s,
#            FP64 vector 47.9 / matrix 95.7, FP32 vector 47.9, FP16/BF16 383 TFLOP/s; 8
#            Infinity Fabric links, up to 800 GB/s. One MI250X is two GCDs and torch sees
#            each as a device, so the profile is one GCD: half of every figure (110 CUs,
#            64 GB, 1.6384 TB/s, BF16 191.5 TFLOP/s).
#   [MI210]  AMD Instinct MI210 data sheet (2022): 104 CUs, 64 GB HBM2e at 1.6384 TB/s, FP64
#            matrix 45.3, FP32 vector 22.6, FP16/BF16 181.0 TFLOP/s; 3 Infinity Fabric links,
#            up to 300 GB/s.
#   [MI300X] AMD Instinct MI300X data sheet (2023): 304 CUs, 192 GB HBM3 at 5.3 TB/s, FP64
#            matrix 163.4, FP32 vector 163.4, TF32 653.7, FP16/BF16 1,307.4, FP8 2,614.9
#            TFLOP/s dense (the sheet's sparsity figures are twice these); 7 Infinity Fabric
#            links, 896 GB/s aggregate.
#   [MI325X] AMD Instinct MI325X data sheet (2024): the MI300X compute die (same CUs and
#            rates), 256 GB HBM3E at 6 TB/s, the same 896 GB/s Infinity Fabric.
#
# ``inter_node_bandwidth`` (one 400 Gb/s NIC per GPU on MI300-class platforms, 200 Gb/s on
# MI200) and the latencies are typical-system estimates, as in the NVIDIA table.
# Compute capabilities are what HIP reports (gfx90a -> 9.0, gfx942 -> 9.4).


_AMD_IF_LATENCY = 3e-6

# key: (name, match, memory, fp64, fp32, tf32, bf16, fp8, bandwidth, fabric, nic, CUs, cc, source)
_AMD_ROWS = {
    "mi250x-gcd": ("AMD Instinct MI250X (one GCD)", "MI250X", 64 * GiB, 47.85 * T, 23.95 * T, 0.0, 191.5 * T, 0.0,
                   1638.4 * GBps, 400 * GBps, 200e9 / 8, 110, (9, 0), "AMD Instinct MI250X data sheet (2021), per GCD = half"),
    "mi210": ("AMD Instinct MI210", "MI210", 64 * GiB, 45.3 * T, 22.6 * T, 0.0, 181.0 * T, 0.0,
              1638.4 * GBps, 300 * GBps, 200e9 / 8, 104, (9, 0), "AMD Instinct MI210 data sheet (2022)"),
    "mi300x": ("AMD Instinct MI300X", "MI300X", 192 * GiB, 163.4 * T, 163.4 * T, 653.7 * T, 1307.4 * T, 2614.9 * T,
               5300 * GBps, 896 * GBps, 400e9 / 8, 304, (9, 4), "AMD Instinct MI300X data sheet (2023), dense rates"),
    "mi325x": ("AMD Instinct MI325X", "MI325X", 256 * GiB, 163.4 * T, 163.4 * T, 653.7 * T, 1307.4 * T, 2614.9 * T,
               6000 * GBps, 896 * GBps, 400e9 / 8, 304, (9, 4), "AMD Instinct MI325X data sheet (2024), dense rates"),
}


def _amd_props(key: str, index: int = 0) -> DeviceProperties:
    name, _, memory, fp64, fp32, tf32, bf16, fp8, bandwidth, fabric, nic, cus, cc, source = _AMD_ROWS[key]
    rates = {"float64": fp64, "float32": fp32, "bfloat16": bf16, "float16": bf16}
    if tf32:
        rates["tf32"] = tf32
    if fp8:  # gfx942's FP8 formats are the "fnuz" variants
        rates["float8_e4m3fnuz"] = rates["float8_e5m2fnuz"] = fp8
    return DeviceProperties(
        name=name, index=index, total_memory=memory, peak_flops=rates, memory_bandwidth=bandwidth,
        intra_node_bandwidth=fabric / 2, inter_node_bandwidth=nic, intra_node_latency=_AMD_IF_LATENCY,
        inter_node_latency=_NETWORK_LATENCY, compute_capability=cc, multiprocessor_count=cus,
        estimated=False, source=source,
    )


def amd_profiles() -> dict[str, DeviceProperties]:
    """The AMD rows as named profiles."""
    return {key: _amd_props(key) for key in _AMD_ROWS}


def amd_lookup(device_name: str) -> str | None:
    """The profile key for a device name as ROCm reports it (``"AMD Instinct MI300X"``), or None."""
    n = device_name.upper().replace(" ", "")
    return next((key for key, row in _AMD_ROWS.items() if row[1] in n), None)


def amd_describe(name: str, index: int, total_memory: int, compute_capability: tuple[int, int], cus: int) -> DeviceProperties:
    """Properties of a real AMD GPU: the table row with measured memory and CUs; for a part not in
    the table, its name and memory without rates, labelled estimated (NVIDIA's per-SM rates do
    not describe AMD compute units)."""
    key = amd_lookup(name)
    if key is None:
        return DeviceProperties(
            name=name, index=index, total_memory=total_memory, compute_capability=tuple(compute_capability),
            multiprocessor_count=cus, estimated=True,
            source=f"no chipset profile for AMD part {name!r}: no peak rates (add a row to chipset_cuda.properties)",
        )
    props = _amd_props(key, index)
    return DeviceProperties(**{**props.to_dict(), "name": name, "total_memory": total_memory,
                               "compute_capability": tuple(compute_capability), "multiprocessor_count": cus,
                               "peak_flops": props.peak_flops, "source": f"{props.source} (table row {key!r})"})
