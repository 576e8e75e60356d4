"""The Memory interface: statistics in bytes, peaks, caches and one OOM error."""

from __future__ import annotations

import contextlib
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch

from chipset.errors import OutOfMemoryError

__all__ = ["Memory", "MemoryStats"]

_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "bytes": 1}


@dataclass(frozen=True)
class MemoryStats:
    """Device memory of one device, in bytes.

    ``allocated``: bytes held by live tensors; ``reserved``: bytes the allocator holds
    from the device (>= allocated); ``active``: bytes in blocks in use (allocated plus
    allocator rounding). ``peak_*`` are maxima since the last ``reset_peak_stats``.
    """

    allocated: int = 0
    reserved: int = 0
    active: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    peak_active: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class Memory(ABC):
    """Memory of one backend's devices."""

    backend_name: str = ""

    @abstractmethod
    def stats(self, index: int | None = None) -> MemoryStats:
        """Statistics of device ``index`` (default: current)."""

    @abstractmethod
    def reset_peak_stats(self, index: int | None = None) -> None:
        """Set every ``peak_*`` of device ``index`` to its current value."""

    @abstractmethod
    def empty_cache(self) -> None:
        """Return cached, unused blocks to the device (``reserved`` drops toward ``allocated``)."""

    @abstractmethod
    def mem_get_info(self, index: int | None = None) -> tuple[int, int]:
        """(free, total) bytes of device ``index`` (default: current)."""

    def total_memory(self, index: int | None = None) -> int:
        """Capacity of device ``index`` in bytes."""
        return self.mem_get_info(index)[1]

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of host ``tensor`` in pinned (page-locked) host memory where the backend has it."""
        return tensor

    @contextlib.contextmanager
    def host_allocations(self) -> Iterator[None]:
        """Tensors created inside the block are host memory, not device memory.

        The engine wraps host-side work (optimizer-state offload) in this. Backends whose
        devices have their own torch device type need nothing (host tensors are on
        ``"cpu"`` and never counted); a backend whose devices *are* the host (the
        simulator) excludes allocations made inside the block from device accounting.
        Default: no-op.
        """
        yield

    # --- OOM translation (template) --------------------------------------------
    def translate_oom(self, exc: BaseException, device: str = "") -> OutOfMemoryError | None:
        """chipset's OutOfMemoryError for a backend OOM exception, or None if ``exc`` is not one."""
        if isinstance(exc, OutOfMemoryError):
            return exc
        if not self._is_oom(exc):
            return None
        text = str(exc)
        requested = self._requested_bytes(exc)
        size = f"Tried to allocate {requested} bytes" if requested is not None else "Tried to allocate an unknown number of bytes"
        msg = (
            f"{self.backend_name} device {device or '?'} is out of memory. {size}. "
            f"Reduce the micro-batch size, enable activation recompute or a higher ZeRO stage. "
            f"Backend said: {text.strip().splitlines()[0] if text.strip() else type(exc).__name__}"
        )
        return OutOfMemoryError(msg, device=device, requested_bytes=requested)

    @contextlib.contextmanager
    def oom_guard(self, device: str = "") -> Iterator[None]:
        """Re-raise a backend OOM inside the block as chipset's OutOfMemoryError."""
        try:
            yield
        except Exception as exc:
            err = self.translate_oom(exc, device)
            if err is None or err is exc:
                raise
            raise err from exc

    def _is_oom(self, exc: BaseException) -> bool:
        """True when ``exc`` is this backend's out-of-memory error."""
        return isinstance(exc, torch.OutOfMemoryError)

    def _requested_bytes(self, exc: BaseException) -> int | None:
        """Bytes the failed allocation asked for, parsed from the backend's message."""
        m = re.search(r"Tried to allocate ([0-9.]+)\s*(B|KiB|MiB|GiB|TiB|bytes)", str(exc))
        if not m:
            return None
        return int(float(m.group(1)) * _UNITS[m.group(2)])
