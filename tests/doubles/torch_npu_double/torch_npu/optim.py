"""TEST DOUBLE: torch_npu.optim exists; chipset does not use NpuFusedAdamW (see docs/ascend.md)."""
