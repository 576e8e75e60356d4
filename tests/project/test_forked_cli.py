"""The suite's forked runs (tests/forked_cli.py) report each run's own exit code, also when runs
start and end side by side in threads, as testenv.SideBySide runs them."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import forked_cli


def test_side_by_side_runs_each_get_their_own_exit_code(tmp_path):
    # A script that exits at once, so runs end while other threads start theirs: the moment
    # where multiprocessing polls other threads' children.
    script = tmp_path / "exit3.py"
    script.write_text("raise SystemExit(3)\n")
    env = forked_cli._state.get("env") or None

    def runs(thread):
        codes = []
        for i in range(80):
            proc = forked_cli.Forked([sys.executable, str(script)], ("script", str(script)), [], env=env,
                                     cwd=tmp_path, out=str(tmp_path / f"out-{thread}-{i}"))
            codes.append(proc.wait(60))
        return codes

    with ThreadPoolExecutor(4) as pool:
        codes = [c for batch in pool.map(runs, range(4)) for c in batch]
    wrong = [c for c in codes if c != 3]
    # Without forked_cli's lock, 4 threads of 40 runs each got some 255s in 2 tries of 3 (2026-12-07).
    assert not wrong, f"{len(wrong)} of {len(codes)} runs reported another exit code: {sorted(set(wrong))}"
    # The same script in a new interpreter: what a forked run stands for.
    assert subprocess.run([sys.executable, str(script)]).returncode == 3
