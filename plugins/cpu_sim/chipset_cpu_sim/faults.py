"""Fault injection for the simulator: ``CHIPSET_SIM_FAULTS``.

Grammar: ``;``-separated entries ``kind:key=value,key=value``::

    kill:rank=1,step=7          rank 1 dies (SIGKILL) when the engine starts step 7 (0-based)
    kill:rank=1,collective=12   rank 1 dies instead of issuing its collective #12 (0-based)
    kill:rank=0,step=9,island=1 in an islands job (docs/islands.md), rank 0 of island 1 only
    kill_node:step=7            the node dies for good when its ranks start step 7: the torchrun
                                agent of this process and all its ranks (SIGKILL). Give the
                                variable to one node only, or add rank=R for the node of rank R
    delay:rank=0,ms=200         every collective of rank 0 starts 200 ms late
    hang:rank=2,collective=5    rank 2 never issues its collective #5: the other ranks get
                                chipset.CollectiveTimeoutError after CHIPSET_COLLECTIVE_TIMEOUT
    slow:rank=1,ms=300          a slow device: rank 1 spends 300 ms more computing in every step
                                (slept before its first collective of the step, so it counts as
                                compute time, not communication)
    slow_link:rank=1,ms=50      a slow link: every collective rank 1 issues takes 50 ms longer,
                                timed as communication (its peers wait inside the same collective)
    host_delay:ms=150           host-side overhead: in every step each rank (or only rank R, with
                                rank=R) spends 150 ms on the host just before its forward
                                (``Collective.notify_compute``), outside every operator and
                                collective: timed as compute, a gap between kernels in a trace
    leak:rank=1,mib=4,step=3    rank 1 holds 4 MiB more device memory per step from step 3 on
                                (step optional, default 0), as a loop that keeps tensors alive
    slow_loader:rank=1,ms=200   a slow input pipeline: rank 1's batches arrive 200 ms late in every
                                step (slept in ``Collective.notify_batch``, inside the time the loop
                                records as the rank's wait for its data, ``data_wait_s``)
    loss_spike:step=4,factor=10 a bad batch: the loss of step 4 is multiplied by 10 before backward
                                (``Collective.loss_factor``), so the recorded loss and the gradients
                                both carry it; factor optional, default 10, at least 2; every rank
    corrupt:rank=1,step=2       silent data corruption: in step 2 every floating-point all_reduce
                                result rank 1 receives has its first element off by one part in
                                1024 (applied when the op completes); its peers keep the true
                                result, so rank 1's parameters leave its data-parallel replicas'

Counting: ``step`` is what the engine passes to ``Collective.notify_step`` (0-based);
``collective`` counts every collective op this process issues, from 0, in call order
(barriers and point-to-point ops included; process-group creation excluded).

Kills happen once per job. A restarted rank must not die again, so a kill is skipped
when ``TORCHELASTIC_RESTART_COUNT`` is above 0, and when its marker file exists in the
fault directory: ``CHIPSET_SIM_FAULT_DIR`` if set; else, in a job started by ``chipset
train``, ``sim-faults`` inside the job's private scratch folder (``CHIPSET_JOB_TMPDIR``,
mode 0700, removed when the job ends); else, under a plain torchrun that gave a run id
other than its default ``none``, ``<tmp>/chipset-sim-faults-<uid>-<run id>``, made mode
0700 and refused if another user owns it. Without any of these, no marker is written.

The withholding rank of a ``hang`` sleeps for the collective timeout plus 10 s (so its
peers time out first) and then raises CollectiveError saying the hang was injected:
no process waits forever.
"""

from __future__ import annotations

import os
import signal
import stat
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from chipset.errors import CollectiveError, ConfigError

__all__ = ["FAULTS_ENV", "FAULT_DIR_ENV", "Fault", "FaultPlan", "parse_faults"]

FAULTS_ENV = "CHIPSET_SIM_FAULTS"
FAULT_DIR_ENV = "CHIPSET_SIM_FAULT_DIR"
ISLAND_ENV = "CHIPSET_ISLAND"
"""Set by chipset train on every rank of island ``i`` of an islands job (chipset.train.islands.link)."""
HANG_GRACE_S = 10.0

# kind -> (required keys, alternative "when" keys (exactly one), optional keys)
_SCHEMA: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "kill": (("rank",), ("step", "collective"), ("island",)),
    "kill_node": ((), ("step",), ("rank",)),
    "delay": (("rank", "ms"), (), ()),
    "hang": (("rank",), ("collective",), ()),
    "slow": (("rank", "ms"), (), ()),
    "slow_link": (("rank", "ms"), (), ()),
    "host_delay": (("ms",), (), ("rank",)),
    "leak": (("rank", "mib"), (), ("step",)),
    "slow_loader": (("rank", "ms"), (), ()),
    "loss_spike": ((), ("step",), ("factor",)),
    "corrupt": (("rank", "step"), (), ()),
}
SPIKE_FACTOR = 10
"""``loss_spike``'s factor when the entry gives none: a spike the doctor calls an error (>= 3x)."""
_EXAMPLE = "kill:rank=1,step=7;delay:rank=0,ms=200;hang:rank=2,collective=5"
ANY_RANK = -1


@dataclass(frozen=True)
class Fault:
    """One parsed entry of CHIPSET_SIM_FAULTS."""

    kind: str
    rank: int
    """The rank it concerns; ANY_RANK (kill_node without rank=) for every rank that has the variable."""
    step: int | None = None
    collective: int | None = None
    ms: int = 0
    spec: str = ""
    mib: int = 0
    island: int | None = None
    """The island it concerns in an islands job (``CHIPSET_ISLAND``); None: every island."""
    factor: int = SPIKE_FACTOR
    """``loss_spike``: what the step's loss is multiplied by."""

    def here(self) -> bool:
        """Whether this process is in the fault's island (always, for a fault without one)."""
        return self.island is None or os.environ.get(ISLAND_ENV, "").strip() == str(self.island)

    @property
    def marker_name(self) -> str:
        when = f"step{self.step}" if self.step is not None else f"collective{self.collective}"
        who = ("" if self.rank == ANY_RANK else f"-rank{self.rank}") + ("" if self.island is None else f"-island{self.island}")
        return f"{self.kind}{who}-{when}.done"


def _bad(entry: str, why: str) -> ConfigError:
    return ConfigError(
        f"{FAULTS_ENV}: entry {entry!r} is invalid: {why}. Expected ';'-separated entries "
        f"'kind:key=value,...' with kind kill (rank, step|collective, optional island), kill_node (step, optional rank), "
        f"delay (rank, ms), hang (rank, collective), slow (rank, ms), slow_link (rank, ms), host_delay (ms, optional rank), leak (rank, mib, "
        f"optional step), slow_loader (rank, ms), loss_spike (step, optional factor) or corrupt (rank, step), e.g. {_EXAMPLE!r}."
    )


def parse_faults(text: str | None) -> list[Fault]:
    """Parse CHIPSET_SIM_FAULTS; ConfigError quoting the offending entry on any mistake."""
    faults: list[Fault] = []
    for raw in (text or "").split(";"):
        entry = raw.strip()
        if not entry:
            continue
        kind, sep, rest = entry.partition(":")
        kind = kind.strip()
        if not sep:
            raise _bad(entry, "missing ':' after the kind")
        if kind not in _SCHEMA:
            raise _bad(entry, f"unknown kind {kind!r}")
        required, when, optional = _SCHEMA[kind]
        values: dict[str, int] = {}
        for item in rest.split(","):
            item = item.strip()
            if not item:
                continue
            key, eq, val = item.partition("=")
            key = key.strip()
            if not eq:
                raise _bad(entry, f"{item!r} is not key=value")
            if key not in required + when + optional:
                raise _bad(entry, f"unknown key {key!r} for {kind} (allowed: {', '.join(required + when + optional)})")
            if key in values:
                raise _bad(entry, f"key {key!r} given twice")
            try:
                num = int(val.strip())
            except ValueError:
                raise _bad(entry, f"{key}={val.strip()!r} is not an integer") from None
            if num < 0:
                raise _bad(entry, f"{key}={num} must not be negative")
            values[key] = num
        missing = [k for k in required if k not in values]
        if missing:
            raise _bad(entry, f"missing {', '.join(missing)}")
        chosen = [k for k in when if k in values]
        if when and len(chosen) != 1:
            raise _bad(entry, f"give exactly one of {' or '.join(when)}")
        if values.get("factor", SPIKE_FACTOR) < 2:
            raise _bad(entry, f"factor={values['factor']} would not raise the loss: give 2 or more")
        faults.append(Fault(kind, values.get("rank", ANY_RANK), values.get("step"), values.get("collective"),
                            values.get("ms", 0), entry, values.get("mib", 0), values.get("island"),
                            values.get("factor", SPIKE_FACTOR)))
    return faults


def fault_dir() -> Path | None:
    """Where kill markers live (see the module docstring); None when there is no job identity."""
    explicit = os.environ.get(FAULT_DIR_ENV, "").strip()
    if explicit:
        return Path(explicit)
    job = os.environ.get("CHIPSET_JOB_TMPDIR", "").strip()  # chipset train's private, cleaned folder
    if job:
        return Path(job) / "sim-faults"
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "").strip()
    if run_id and run_id != "none":
        return Path(tempfile.gettempdir()) / f"chipset-sim-faults-{os.getuid()}-{run_id}"
    return None


def _private(path: Path) -> Path:
    """``path`` as a folder only this user can use: made 0700, refused if someone else owns it
    or it is a link (a predictable name under a shared /tmp could be planted by another user)."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ConfigError(f"fault marker folder {path} is not a private folder of this user "
                          f"(mode {oct(st.st_mode & 0o777)}, owner uid {st.st_uid}); set {FAULT_DIR_ENV} to one")
    return path


class FaultPlan:
    """The faults that concern one process, applied at steps and before collectives."""

    def __init__(self, faults: list[Fault]):
        self.faults = faults
        self._slow_due = 0.0  # seconds of injected compute still to spend in this step (``slow``)
        self._held: list = []  # the tensors a ``leak`` keeps alive
        self._step = -1  # the step notify_step last gave (``corrupt``)

    @classmethod
    def from_env(cls) -> FaultPlan:
        return cls(parse_faults(os.environ.get(FAULTS_ENV)))

    def __bool__(self) -> bool:
        return bool(self.faults)

    def on_step(self, rank: int, step: int) -> None:
        self._step = step
        self._slow_due = 0.0  # what a step without a collective did not spend is not carried over
        for f in self.faults:
            if f.kind == "slow" and f.rank == rank:
                self._slow_due += f.ms / 1000.0
            elif f.kind == "leak" and f.rank == rank and step >= (f.step or 0):
                import torch  # charged by the simulator's memory accounting like any tensor of the run

                self._held.append(torch.empty(f.mib * 1024 * 1024, dtype=torch.uint8))
            if f.kind == "kill" and f.rank == rank and f.step == step and f.here():
                self._kill(f)
            elif f.kind == "kill_node" and f.rank in (rank, ANY_RANK) and f.step == step:
                self._kill(f, node=True)

    def before_collective(self, rank: int, index: int, describe: str, timeout_s: float) -> None:
        """Apply slow/delay/kill/hang faults before this rank's collective number ``index``."""
        if self._slow_due:
            time.sleep(self._slow_due)
            self._slow_due = 0.0
        for f in self.faults:
            if f.rank != rank:
                continue
            if f.kind == "delay":
                time.sleep(f.ms / 1000.0)
            elif f.kind == "kill" and f.collective == index and f.here():
                self._kill(f)
            elif f.kind == "hang" and f.collective == index:
                time.sleep(timeout_s + HANG_GRACE_S)
                raise CollectiveError(
                    f"{describe}: this rank withheld collective #{index} on purpose ({FAULTS_ENV} "
                    f"entry {f.spec!r}); its peers were left waiting and time out."
                )

    def on_batch(self, rank: int) -> None:
        """While the loop fetches a step's batches on ``rank``: ``slow_loader`` sleeps there."""
        delay = sum(f.ms for f in self.faults if f.kind == "slow_loader" and f.rank == rank)
        if delay:
            time.sleep(delay / 1000.0)

    def on_compute(self, rank: int) -> None:
        """Before the step's forward on ``rank``, on the host: ``host_delay`` sleeps there."""
        delay = self.host_delay_s(rank)
        if delay:
            time.sleep(delay)

    def host_delay_s(self, rank: int) -> float:
        """Seconds ``rank`` spends on the host before each step's forward (``host_delay``)."""
        return sum(f.ms for f in self.faults if f.kind == "host_delay" and f.rank in (rank, ANY_RANK)) / 1000.0

    def loss_factor(self, step: int) -> float:
        """What step ``step``'s loss is multiplied by (``loss_spike``; 1.0 at every other step)."""
        factor = 1.0
        for f in self.faults:
            if f.kind == "loss_spike" and f.step == step:
                factor *= f.factor
        return factor

    def corrupts(self, rank: int, op: str, tensors: list) -> bool:
        """Whether this op's result on ``rank`` is to be corrupted (``corrupt``: a floating all_reduce in its step)."""
        return op == "all_reduce" and len(tensors) == 1 and tensors[0].is_floating_point() and any(
            f.kind == "corrupt" and f.rank == rank and f.step == self._step for f in self.faults)

    def link_delay_s(self, rank: int) -> float:
        """Extra seconds inside each collective of ``rank`` (``slow_link``), timed as communication."""
        return sum(f.ms for f in self.faults if f.kind == "slow_link" and f.rank == rank) / 1000.0

    def _kill(self, f: Fault, node: bool = False) -> None:
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
            return  # the job was already restarted: the kill happened once
        d = fault_dir()
        if d is not None:
            marker = d / f.marker_name
            if marker.exists():
                return
            if d.parent == Path(tempfile.gettempdir()):
                _private(d)
            else:
                d.mkdir(parents=True, exist_ok=True)
            marker.write_text(f"{f.spec} fired in pid {os.getpid()} at {time.time():.3f}\n")
        if node:
            agent = _torchrun_agent()
            print(f"chipset cpu_sim: fault injected ({f.spec}): this node dies now (torchrun agent pid {agent} "
                  "and its ranks)", file=sys.stderr, flush=True)
            # The agent first, so that it cannot restart anything; then everything below it (its other
            # ranks, and the fork server they may have started from).
            below = _children(agent)
            os.kill(agent, signal.SIGKILL)
            while below:
                pid = below.pop()
                if pid != os.getpid():
                    below += _children(pid)
                    _kill_quietly(pid)
        else:
            print(f"chipset cpu_sim: fault injected ({f.spec}): rank {f.rank} dies now", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


AGENTS = ("torch.distributed.run", "torchrun", "chipset.train.agent")
"""How a torchrun agent's command line reads where it was started as a new interpreter; chipset
train forks it from the launcher instead (its command line the launcher's), and torch's agent
names its process ``pt_elastic``."""
AGENT_NAME = "pt_elastic"


def _torchrun_agent() -> int:
    """The pid of the torchrun agent that started this rank (its parent, or its grandparent where the
    rank is a fork of the agent's multiprocessing fork server); ConfigError when there is none."""
    agent = os.getppid()
    cmdline = name = ""
    for _ in range(2):
        try:
            cmdline = Path(f"/proc/{agent}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            name = Path(f"/proc/{agent}/comm").read_text().strip()
        except OSError:
            cmdline = name = ""
        if "multiprocessing.forkserver" not in cmdline:
            break
        try:
            agent = int(Path(f"/proc/{agent}/stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            break
    if "GROUP_RANK" not in os.environ or not (name == AGENT_NAME or any(a in cmdline for a in AGENTS)):
        raise ConfigError(
            f"{FAULTS_ENV}: kill_node needs ranks started by torchrun (chipset train --nnodes, --max-restarts "
            f"or --nproc > 1); this process's parent is pid {agent} ({cmdline.strip()[:80] or 'unknown'})"
        )
    return agent


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (read from /proc: Linux only, like the simulator's users)."""
    out = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat_file.read_text()
        except OSError:
            continue
        # Field 4 is the parent pid; the command name (field 2) may hold spaces, so split after ')'.
        fields = text.rpartition(")")[2].split()
        if len(fields) > 1 and fields[1] == str(pid):
            out.append(int(stat_file.parent.name))
    return out


def _kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
