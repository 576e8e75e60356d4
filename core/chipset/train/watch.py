"""Live warnings during a run (rank 0): a straggler rank or a leaking rank, from the numbers
StepMetrics already gathered, printed once each. The same rules, over the whole run, are
``chipset diagnose`` (docs/diagnose.md); these use a short streak so they fire while it runs."""

from __future__ import annotations

STREAK = 3
"""Consecutive steps a pattern must hold before the console says so."""
RATIO = 1.25
"""A straggler's compute time over its slowest peer's (as chipset diagnose)."""
LEAK_BYTES = 512 * 1024
"""Growth per step that counts towards a leak (as chipset diagnose: 0.5 MiB/step)."""


def _excess(values: list, r: int, peers: list[int]) -> float:
    """Rank ``r``'s value over the largest of its ``peers``' (0 when the record lacks the field)."""
    return values[r] - max(values[i] for i in peers) if len(values) > max(r, *peers) else 0.0


class LiveWatch:
    """Fed one gathered record per step on rank 0; returns the console lines to print (each once).

    Neither compute times nor memory are read from the first record (the warm-up step, which
    chipset diagnose leaves out too) or from the ``profiled`` steps (the profiler's own start and
    buffers cost each rank differently and grow host memory): such a step neither extends nor
    breaks a streak. Memory growth is read between two consecutive read steps only, so the first
    growth counted is from step 2 to step 3, as chipset diagnose's leak rule reads it."""

    def __init__(self, stages: list[int] | None = None, profiled: tuple[int, int] | None = None) -> None:
        self.stages = stages
        """Each rank's pipeline stage: a rank is compared with the ranks of its own stage (None: all)."""
        self.profiled = profiled
        """``(first, last)`` steps under the profiler (``train.profile_steps``), or None."""
        self._fed = 0
        self._slow: dict[int, int] = {}
        self._grow: dict[int, int] = {}
        self._mem: list[int] | None = None
        self._said: set[tuple[str, int]] = set()

    def step(self, rec: dict) -> list[str]:
        out = []
        compute, mem, step = rec.get("compute_s") or [], rec.get("memory_bytes") or [], rec.get("step")
        wait = rec.get("data_wait_s") or []
        cpu_wait = rec.get("cpu_wait_s") or []
        self._fed += 1
        read = self._fed > 1 and not (self.profiled is not None and isinstance(step, int)
                                      and self.profiled[0] <= step <= self.profiled[1])
        if not read:
            compute = []  # not read (class docstring)
        for r, c in enumerate(compute):
            same = [i for i in range(len(compute)) if i != r
                    and (self.stages is None or len(self.stages) != len(compute) or self.stages[i] == self.stages[r])]
            peers = [compute[i] for i in same]
            slow = bool(peers) and c > RATIO * max(peers)
            self._slow[r] = self._slow.get(r, 0) + 1 if slow else 0
            if self._slow[r] >= STREAK and ("straggler", r) not in self._said:
                self._said.add(("straggler", r))
                # As chipset diagnose: its input pipeline when its wait for batches explains most of it,
                # else the host when its thread's wait for a CPU does.
                extra = c - max(peers)
                cause = (f", {wait[r]:.3g} s of it waiting for its batches (its input pipeline)"
                         if _excess(wait, r, same) > 0.5 * extra else
                         f", {cpu_wait[r]:.3g} s of it waiting for a host CPU (other processes on its cores)"
                         if _excess(cpu_wait, r, same) > 0.5 * extra else "")
                out.append(f"chipset: warning: rank {r} is a straggler: compute {c:.3g} s vs at most "
                           f"{max(peers):.3g} s on its peers for {STREAK} steps (step {step}){cause}; "
                           "run 'chipset diagnose RUN_DIR' after the run")
        if read and self._mem is not None and len(self._mem) == len(mem):
            for r, (a, b) in enumerate(zip(self._mem, mem, strict=True)):
                self._grow[r] = self._grow.get(r, 0) + 1 if b - a >= LEAK_BYTES else 0
                if self._grow[r] >= STREAK and ("leak", r) not in self._said:
                    self._said.add(("leak", r))
                    skipped = " (the profiled steps not counted)" if self.profiled is not None else ""
                    out.append(f"chipset: warning: rank {r}'s memory grew in each of {STREAK} steps in a row{skipped} "
                               f"(+{(b - a) / 2**20:.2f} MiB at step {step}): a leak? "
                               "run 'chipset diagnose RUN_DIR' after the run")
        self._mem = list(mem) if read else None  # the next step's growth is read from a read step only
        return out
