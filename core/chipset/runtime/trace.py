"""Named ranges in a profiler trace (``chipset::optimizer``, the pipeline's instructions, ...)."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["trace_range"]


def trace_range(name: str):
    """A ``torch.profiler.record_function`` range while a profiler records; else a no-op."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()
