"""Kernels: the reference set and the per-backend registry."""

from chipset.kernels.reference import REFERENCE_KERNELS
from chipset.kernels.registry import KernelImpl, KernelRegistry

__all__ = ["KernelImpl", "KernelRegistry", "REFERENCE_KERNELS"]
