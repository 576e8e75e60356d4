"""Collectives over gloo, the CPU process-group backend of torch.distributed.

Two gloo gaps are closed here (torch 2.13): ``avg`` of integer tensors, done as a sum
then an integer division rounding toward zero (what a float average cast back gives for
non-negative values); and async reduce-scatter work that never reports completion even
after ``wait()`` (a handle waited on successfully is complete).
"""

from __future__ import annotations

from collections.abc import Callable

from chipset.interfaces import Collective, Handle


class _WaitedHandle(Handle):
    _waited = False

    def wait(self) -> None:
        super().wait()
        self._waited = True

    def is_completed(self) -> bool:
        return self._waited or super().is_completed()


class _ThenHandle(Handle):
    """Runs ``then`` (the emulated average's division) once, after the op completed."""

    def __init__(self, inner: Handle, then: Callable[[], object]):
        self._inner = inner
        self._then = then
        self._done = False

    def wait(self) -> None:
        self._inner.wait()
        if not self._done:
            self._done = True
            self._then()

    def is_completed(self) -> bool:
        return self._inner.is_completed()


def _int_avg(t, op: str) -> bool:
    return op == "avg" and not (t.is_floating_point() or t.is_complex())


class CpuCollective(Collective):
    backend_name = "cpu"
    c10d_backend = "gloo"

    def _run(self, op, group, tensors, fn, async_op, raw=False):
        h = super()._run(op, group, tensors, fn, async_op, raw)
        if isinstance(h, Handle) and not isinstance(h, _WaitedHandle):
            h = _WaitedHandle(h._work, h._describe, h._translate, account=h._account)
        return h

    def all_reduce(self, tensor, op="sum", group=None, async_op=False):
        if not _int_avg(tensor, op):
            return super().all_reduce(tensor, op, group, async_op)
        n = (group or self.world).size
        h = super().all_reduce(tensor, "sum", group, async_op)
        return self._finish(h, lambda: tensor.div_(n, rounding_mode="trunc"))

    def reduce_scatter(self, output, input, op="sum", group=None, async_op=False):
        if not _int_avg(input, op):
            return super().reduce_scatter(output, input, op, group, async_op)
        n = (group or self.world).size
        h = super().reduce_scatter(output, input, "sum", group, async_op)
        return self._finish(h, lambda: output.div_(n, rounding_mode="trunc"))

    @staticmethod
    def _finish(handle, then):
        if handle is None:
            then()
            return None
        return _ThenHandle(handle, then)
