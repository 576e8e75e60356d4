"""Regional compilation: ``train.compile = true`` compiles each transformer block on its own.

Compiling per block rather than the whole model keeps compile time to one block's graph
(the blocks share code, so the later ones reuse the first one's generated kernels), and
leaves everything between blocks eager: the engine's hooks (ZeRO-3 gathers, pipeline
stage boundaries, recompute's checkpoint) run as before. Only ``forward`` is compiled, so
parameters, their names and the state dict are unchanged.

The compile backend comes from the backend plugin's descriptor (``compile_backend``); a
plugin that declares none (a simulator whose accounting must see every eager op, or a
plugin that has not been validated under ``torch.compile``) is refused before launch.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from chipset.errors import ConfigError

__all__ = ["apply_compile", "check_compile", "compile_backend_of", "compiled_frames"]

log = logging.getLogger(__name__)


def compiled_frames() -> int:
    """Frames torch.compile has compiled in this process so far: dynamo's ``frames.ok`` counter, which
    counts a frame's first compile and every recompile (a guard failed: a new shape, dtype, a changed
    Python value); 0 when torch._dynamo was never imported."""
    import sys

    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


def compile_backend_of(descriptor) -> str | None:
    """The descriptor's ``compile_backend`` (None for descriptors that predate the field)."""
    return getattr(descriptor, "compile_backend", None)


def check_compile(enabled: bool, backend_name: str, descriptor) -> str | None:
    """The compile backend to use, None when ``enabled`` is false; ConfigError (exit 2) when the backend has none."""
    if not enabled:
        return None
    cb = compile_backend_of(descriptor)
    if cb is None:
        raise ConfigError(
            f"train.compile = true: backend {backend_name!r} declares no torch.compile backend "
            "(its descriptor's compile_backend is None), so its blocks cannot be compiled; set "
            "train.compile = false, or select a backend that declares one (cpu and cuda use inductor)"
        )
    return cb


def apply_compile(blocks: list[nn.Module], compile_backend: str) -> int:
    """Compile the ``forward`` of every block (the family's ``blocks(model)``); returns how many."""
    if not blocks:
        raise ConfigError("train.compile = true: the model family lists no blocks to compile (ModelFamily.blocks)")
    for block in blocks:
        block.forward = torch.compile(block.forward, backend=compile_backend)
    log.info("train.compile: %d blocks compiled with torch.compile backend %r", len(blocks), compile_backend)
    return len(blocks)
