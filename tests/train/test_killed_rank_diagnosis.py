"""After a rank is killed, the launcher's diagnosis names the rank that died, not the survivor.

Reproduces issue 14: rank 1 killed (SIGKILL, cpu_sim fault injection) left only rank 0's
log, and the report listed rank 0 as the failing rank.
"""

from __future__ import annotations

import json
import sys

import pytest

import forked_cli
import testenv
from chipset.train.checkpoint.hangs import diagnose


def _op(seq: int, state: str = "done") -> dict:
    return {"op": "all_reduce", "group": "world", "seq": seq, "ranks": [0, 1, 2], "bytes": 4, "time": 0.0,
            "state": state}


def test_diagnose_names_the_ranks_that_wrote_no_log(tmp_path):
    d = tmp_path / "hangs"
    d.mkdir()
    for r in (0, 2):
        (d / f"rank{r}.json").write_text(json.dumps(
            {"rank": r, "timeout": False, "error": "Connection closed by peer", "recent_ops": [_op(4, "failed")]}))
    report = diagnose(tmp_path)
    assert report["died"] == [1]
    assert report["lines"][0].startswith("rank(s) 1 died without reporting an error")


@pytest.mark.multirank
def test_a_killed_rank_is_named_as_the_one_that_died(tmp_path):
    run = tmp_path / "run"
    env = testenv.clean_env()
    env.update(OMP_NUM_THREADS="1", CHIPSET_BACKEND="cpu_sim", CHIPSET_SIM_FAULTS="kill:rank=1,step=3",
               CHIPSET_SIM_FAULT_DIR=str(tmp_path / "faults"))
    r = forked_cli.run([sys.executable, "-m", "chipset.cli.main", "train", "--nproc", "2", "--set",
                        "train.steps=20", "--run-dir", str(run)], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "fault injected (kill:rank=1,step=3)" in out
    diag = out[out.index("collective diagnosis"):]
    assert "rank(s) 1 died without reporting an error" in diag, out[-3000:]
    assert json.loads((run / "hangs" / "report.json").read_text())["died"] == [1]
