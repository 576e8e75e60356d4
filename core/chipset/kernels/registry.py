"""The kernel registry: named kernels, a reference for each, faster ones per backend.

A backend registers an implementation with an availability predicate (called with the
kernel's arguments) and a priority; dispatch picks the highest-priority available
implementation and falls back to the reference.

``registry.rms_norm(x, w)`` is the hot path (every layer call): the first read of a kernel's
name builds its dispatcher (:meth:`KernelRegistry.resolve`) and keeps it on the registry, so
later calls cost the predicates and the implementation, no lookup; :meth:`KernelRegistry.register`
drops the kept dispatcher of the name it registers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from chipset.errors import KernelNotFoundError
from chipset.kernels.reference import REFERENCE_KERNELS

__all__ = ["KernelRegistry", "KernelImpl"]


def _always(*args, **kwargs) -> bool:
    return True


@dataclass(frozen=True)
class KernelImpl:
    name: str
    fn: Callable
    backend: str
    priority: int = 0
    available: Callable[..., bool] = _always
    description: str = ""


class KernelRegistry:
    """Kernels of one backend (plus the core references)."""

    def __init__(self, backend: str, known_elsewhere: Callable[[str], list[str]] | None = None):
        self.backend = backend
        self._impls: dict[str, list[KernelImpl]] = {}
        self._known_elsewhere = known_elsewhere or (lambda name: [])

    def register(
        self,
        name: str,
        fn: Callable,
        *,
        priority: int = 0,
        available: Callable[..., bool] = _always,
        description: str = "",
    ) -> None:
        """Register ``fn`` as an implementation of kernel ``name`` for this backend."""
        impl = KernelImpl(name, fn, self.backend, priority, available, description)
        lst = self._impls.setdefault(name, [])
        lst.append(impl)
        lst.sort(key=lambda i: -i.priority)
        self.__dict__.pop(name, None)  # the dispatcher __getattr__ kept, if any, is out of date

    def has_kernel(self, name: str) -> bool:
        """True when ``name`` has a reference or a registered implementation."""
        return name in REFERENCE_KERNELS or name in self._impls

    def reference(self, name: str) -> Callable:
        """The core's pure-torch reference for ``name``."""
        try:
            return REFERENCE_KERNELS[name]
        except KeyError:
            raise self._missing(name) from None

    def implementations(self, name: str) -> list[KernelImpl]:
        """This backend's registered implementations of ``name``, best first."""
        return list(self._impls.get(name, []))

    def select(self, name: str, *args, **kwargs) -> Callable:
        """The implementation dispatch would call for these arguments."""
        for impl in self._impls.get(name, []):
            if impl.available(*args, **kwargs):
                return impl.fn
        return self.reference(name)

    def resolve(self, name: str) -> Callable:
        """``name`` resolved once, for a caller on the hot path (a layer binds it when it is built):
        the reference when this backend registers nothing for ``name``, its best implementation
        when that one is always available, else a function that runs :meth:`select`'s choice on
        each call (the predicates need the arguments). Calling the result costs what calling the
        implementation costs; registrations made after resolving are not seen."""
        impls = list(self._impls.get(name, []))
        if not impls:
            return self.reference(name)
        if impls[0].available is _always:
            return impls[0].fn
        # The same choice as select(), without its method and dictionary lookups per call.
        pairs = tuple((i.available, i.fn) for i in impls)
        ref = REFERENCE_KERNELS.get(name)

        def dispatch(*args, **kwargs):
            for available, fn in pairs:
                if available(*args, **kwargs):
                    return fn(*args, **kwargs)
            if ref is None:
                raise self._missing(name)
            return ref(*args, **kwargs)

        dispatch.__name__ = dispatch.__qualname__ = f"{name}_dispatch"
        return dispatch

    def __call__(self, name: str, *args, **kwargs):
        """Run kernel ``name`` with the best available implementation."""
        return self.select(name, *args, **kwargs)(*args, **kwargs)

    def __getattr__(self, name: str):
        # ``registry.rms_norm(x, w)`` reads like a function call at the use site. Called only
        # for a name not yet read: the dispatcher is kept in the instance dictionary, where
        # attribute lookup finds it first (register() removes it again).
        if name.startswith("_"):
            raise AttributeError(name)
        if not self.has_kernel(name):
            raise self._missing(name)
        fn = self.__dict__[name] = self.resolve(name)
        return fn

    def names(self) -> list[str]:
        return sorted(set(REFERENCE_KERNELS) | set(self._impls))

    def matrix(self) -> dict[str, dict]:
        """Machine-readable listing: kernel -> {reference, implementations}."""
        return {
            n: {
                "reference": n in REFERENCE_KERNELS,
                "implementations": [
                    {"backend": i.backend, "priority": i.priority, "description": i.description}
                    for i in self._impls.get(n, [])
                ],
            }
            for n in self.names()
        }

    def _missing(self, name: str) -> KernelNotFoundError:
        others = self._known_elsewhere(name)
        where = (
            f"backends that implement it: {', '.join(others)}"
            if others
            else "no installed backend declares it"
        )
        return KernelNotFoundError(
            f"kernel {name!r} is not available on backend {self.backend!r} ({where}). "
            f"Available kernels: {', '.join(self.names())}."
        )
