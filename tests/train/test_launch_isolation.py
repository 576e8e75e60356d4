"""What a job exposes and what it runs: loopback-only stores, no code from the current
directory, the backend's launch environment in every rank, private fault-marker folders."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chipset.errors import ConfigError
from plugin_factory import GOOD_SPEC, make_plugin
from testenv import SideBySide, clean_env, selected

CHIPSET = str(Path(sys.executable).parent / "chipset")  # the console script a user runs


def _listening(tag: str) -> set[str]:
    """hex ``addr:port`` of the TCP sockets in LISTEN state held by processes whose command line holds ``tag``."""
    inodes = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if tag not in (proc / "cmdline").read_bytes().decode(errors="replace"):
                continue
            for fd in (proc / "fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:
                out.add(f[1])
    return out


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory):
    """This file's two-rank jobs that this session's selected tests check, side by side
    (testenv.SideBySide): {test name: what its job returned}."""
    # In the order they start: the restarted job first (it waits on the elastic agent), the one
    # that trains flat out until it is killed last.
    job_of = {test_fault_markers_live_in_a_private_job_folder_that_is_removed: _fault_markers_live_in_a_private_job_folder_that_is_removed,
              test_the_backends_launch_env_reaches_every_rank: _the_backends_launch_env_reaches_every_rank,
              test_modules_in_the_current_directory_do_not_run_in_the_job: _modules_in_the_current_directory_do_not_run_in_the_job,
              test_single_node_job_listens_on_loopback_only: _single_node_job_listens_on_loopback_only}

    tmp_path_factory.getbasetemp()  # made here: the jobs' threads would race to make it

    def start(job):
        return lambda: job(tmp_path_factory.mktemp(job.__name__[1:20]))

    started = SideBySide({test.__name__: start(job) for test, job in job_of.items() if selected(request, test)})
    yield started
    started.close()


def _single_node_job_listens_on_loopback_only(tmp_path) -> set[str]:
    """The listening sockets seen while the job started and trained (hex ``addr:port``)."""
    run_dir = tmp_path / "loopback-run"
    proc = subprocess.Popen([CHIPSET, "train", "--nproc", "2", "--set", "train.steps=100000", "--run-dir", str(run_dir)],
                            env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    seen: set[str] = set()
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (run_dir / "metrics.jsonl").exists():
            seen |= _listening(str(run_dir))
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            time.sleep(0.5)
        for _ in range(4):  # and while training
            seen |= _listening(str(run_dir))
            time.sleep(0.5)
    finally:
        left = _kill_job(proc)
    assert not left, f"processes of the killed job still running: {left}"
    return seen


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc)."""
    kids: dict[int, list[int]] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            stat = (proc / "stat").read_bytes()
            kids.setdefault(int(stat[stat.rindex(b")") + 2:].split()[1]), []).append(int(proc.name))
        except (OSError, ValueError, IndexError):
            continue
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _kill_job(proc: subprocess.Popen) -> list[int]:
    """SIGKILL ``chipset train`` and every process below it; the ones still running after 10 s.

    Its process group is not enough: chipset starts torchrun's agent in a session of its own
    (to forward signals to it), so before this the agent and its ranks outlived the test and
    trained their 100000 steps, two busy cores for the rest of the suite (~45 minutes here)."""
    below = _descendants(proc.pid)
    for pid in [proc.pid, *below]:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = []
        for pid in below:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue  # gone
            if state != "Z":
                left.append(pid)
        if not left:
            break
        time.sleep(0.1)
    return left


@pytest.mark.multirank
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads listening sockets from Linux /proc")
def test_single_node_job_listens_on_loopback_only(jobs):
    """Before: torchrun's stores listened on all interfaces (00000000:PORT / [::]:PORT) even with --standalone."""
    seen = jobs["test_single_node_job_listens_on_loopback_only"]
    assert seen, "the job's rendezvous store was not found listening"
    loopback = ("0100007F:", "00000000000000000000000001000000:")  # 127.0.0.1 and ::1 as /proc writes them
    exposed = sorted(a for a in seen if not a.startswith(loopback))
    assert not exposed, f"sockets listening beyond loopback: {exposed}"


def _modules_in_the_current_directory_do_not_run_in_the_job(tmp_path):
    marker = tmp_path / "poisoned"
    for name in ("typing_extensions", "numpy", "chipset_cpu_sim"):
        (tmp_path / f"{name}.py").write_text(f"open({str(marker)!r}, 'a').write({name!r} + '\\n')\n"
                                            "raise SystemExit('imported from the current directory')\n")
    r = subprocess.run([CHIPSET, "train", "--nproc", "2", "--set", "train.steps=2", "--run-dir", str(tmp_path / "run")],
                       cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=600)
    return r, marker


@pytest.mark.multirank
def test_modules_in_the_current_directory_do_not_run_in_the_job(jobs):
    """Before: a typing_extensions.py in the directory `chipset train --nproc 2` ran from ran inside the agent."""
    r, marker = jobs["test_modules_in_the_current_directory_do_not_run_in_the_job"]
    assert r.returncode == 0, r.stderr[-3000:]
    assert not marker.exists(), marker.read_text()


LAUNCH_ENV = '''

import dataclasses
import os

def launch_env(local_rank, local_world_size):
    return {"ENVTEST_SEEN": f"{local_rank}/{local_world_size}"}

spec = dataclasses.replace(spec, launch_env=launch_env)


_set_device = _Device.set_device

def _record(self, index):
    out = os.environ["ENVTEST_OUT"]
    with open(f"{out}/rank{os.environ.get('RANK', '0')}", "w") as f:
        f.write(os.environ.get("ENVTEST_SEEN", "missing"))
    return _set_device(self, index)

_Device.set_device = _record
'''


def _the_backends_launch_env_reaches_every_rank(tmp_path):
    site = tmp_path / "site"
    make_plugin(site, "envtest", impl=GOOD_SPEC.format(name="envtest") + LAUNCH_ENV)
    out = tmp_path / "seen"
    out.mkdir()
    env = clean_env()
    env.update(CHIPSET_BACKEND="envtest", ENVTEST_OUT=str(out),
               PYTHONPATH=os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH", "")])))
    env.pop("CHIPSET_DISABLE_PLUGINS", None)
    r = subprocess.run([sys.executable, "-m", "chipset.cli.main", "train", "--nproc", "2", "--set", "train.steps=1",
                        "--run-dir", str(tmp_path / "run")], env=env, capture_output=True, text=True, timeout=600)
    return r, {f.name: f.read_text() for f in out.iterdir()}


@pytest.mark.multirank
def test_the_backends_launch_env_reaches_every_rank(jobs):
    """Before: the launch env hook was documented as applied to every rank but never called."""
    r, seen = jobs["test_the_backends_launch_env_reaches_every_rank"]
    assert r.returncode == 0, r.stderr[-3000:]
    assert seen == {"rank0": "0/2", "rank1": "1/2"}


def _fault_markers_live_in_a_private_job_folder_that_is_removed(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = clean_env()
    env.update(TMPDIR=str(tmp), CHIPSET_SIM_FAULTS="kill:rank=1,step=2")
    r = subprocess.run([sys.executable, "-m", "chipset.cli.main", "train", "--nproc", "2", "--max-restarts", "1",
                        "--set", "train.steps=4", "--set", "train.checkpoint_every=1", "--run-dir", str(tmp_path / "run")],
                       env=env, capture_output=True, text=True, timeout=900)
    return r, [p.name for p in tmp.iterdir() if p.name.startswith("chipset")]


@pytest.mark.multirank
def test_fault_markers_live_in_a_private_job_folder_that_is_removed(jobs):
    """Before: kill markers went to /tmp/chipset-sim-faults-<run id> (predictable) and stayed there."""
    r, leftovers = jobs["test_fault_markers_live_in_a_private_job_folder_that_is_removed"]
    assert r.returncode == 0, r.stderr[-3000:]
    assert "fault injected" in r.stderr  # it fired once, and the restarted rank did not die again
    assert leftovers == [], leftovers


def test_a_shared_fault_folder_of_another_user_or_mode_is_refused(tmp_path, monkeypatch):
    from chipset_cpu_sim.faults import _private

    d = tmp_path / "chipset-sim-faults-x"
    d.mkdir(mode=0o777)
    os.chmod(d, 0o777)
    with pytest.raises(ConfigError, match="not a private folder"):
        _private(d)
    os.chmod(d, 0o700)
    assert _private(d) == d
