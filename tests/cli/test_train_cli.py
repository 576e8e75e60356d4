"""``chipset train``: config errors exit 2 before anything starts; N ranks run through torchrun."""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

import forked_cli
import testenv
from chipset.cli.main import main
from chipset.train.config import load_config
from chipset.train.launch import torchrun_command

# No checkpoints: these runs test training end to end, and a save (on by default) costs seconds
# per run on a loaded machine (test_resume_defaults.py covers the default).
SMALL = ["--set", "train.steps=3", "--set", "train.global_batch=4", "--set", "train.checkpoint_every=0"]


def _cli(*args: str, cwd=None, timeout: float = 180):
    env = testenv.clean_env()
    env["OMP_NUM_THREADS"] = "1"
    return forked_cli.run([sys.executable, "-m", "chipset.cli.main", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=cwd)


def test_bad_config_exits_2_listing_every_problem_and_writes_nothing(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[parallel]\nzero = 7\n[train]\nsteps = "ten"\nwarp = 9\n')
    run_dir = tmp_path / "run"
    r = _cli("train", str(cfg), "--run-dir", str(run_dir), "--set", "model.hidden_size=30")
    assert r.returncode == 2, r.stderr
    assert "train.steps = 'ten': expected int, found str" in r.stderr
    assert "train.warp: unknown key" in r.stderr
    assert "parallel.zero = 7: expected a ZeRO stage 0, 1, 2 or 3" in r.stderr
    assert "model.num_attention_heads (4) must divide model.hidden_size (30)" in r.stderr
    assert "Traceback" not in r.stderr
    assert not run_dir.exists()


@pytest.mark.parametrize("args, expect", [
    (["--set", "parallel.zero=4"], "parallel.zero = 4: expected a ZeRO stage"),
    (["--set", "parallel.dp=3", "--nproc", "2"], "dp*tp*pp*cp (3) must equal world size (2)"),
    (["--set", "train.recompute=some"], "train.recompute = 'some': expected one of none, selective, full"),
    (["--set", "nosection"], "expected section.key=value"),
    (["missing.toml"], "cannot read config file 'missing.toml'"),
])
def test_invalid_runs_are_refused_in_process(tmp_path, capsys, args, expect):
    run_dir = tmp_path / "run"
    rc = main(["train", *args, "--run-dir", str(run_dir)])
    assert rc == 2
    assert expect in capsys.readouterr().err
    assert not run_dir.exists()


def test_torchrun_command_uses_torchs_launcher_and_the_worker(tmp_path):
    cmd = torchrun_command(tmp_path / "c.toml", tmp_path, nproc=4)
    # torch's own launcher (chipset.train.agent runs torch.distributed.run) on a loopback rendezvous
    assert cmd[1:3] == ["-m", "chipset.train.agent"] and "--nproc-per-node=4" in cmd
    assert {"--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", "--nnodes=1"} <= set(cmd)
    assert cmd[cmd.index("-m", 3) + 1] == "chipset.train.worker"
    multi = torchrun_command(tmp_path / "c.toml", tmp_path, nproc=2, nnodes=2, node_rank=1, rdzv_endpoint="h:1234")
    assert {"--nnodes=2", "--node-rank=1", "--rdzv-endpoint=h:1234"} <= set(multi)


def test_launch_pins_the_resolved_backend_for_every_rank(monkeypatch):
    from chipset.train.launch import launch

    monkeypatch.setenv("CHIPSET_BACKEND", "a,b,c")  # a preference list in the user's shell
    check = "import os, sys; sys.exit(0 if os.environ['CHIPSET_BACKEND'] == 'resolved_name' else 3)"
    assert launch([sys.executable, "-c", check], "resolved_name") == 0


def test_train_nproc_2_end_to_end_through_torchrun(tmp_path):
    run_dir, one, four = tmp_path / "run", tmp_path / "one", tmp_path / "four"
    # Four independent commands, side by side: each spends seconds importing on one core.
    with ThreadPoolExecutor(4) as pool:
        r, info, r1, r4 = pool.map(lambda args: _cli(*args), [
            ("train", "--nproc", "2", "--run-dir", str(run_dir), "--set", "parallel.zero=2", *SMALL),
            ("info", "--json"),
            ("train", "--run-dir", str(one), *SMALL),
            ("train", "--nproc", "4", "--run-dir", str(four), "--set", "parallel.zero=3", *SMALL),
        ])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "step    3/3" in r.stdout and "params digest" in r.stdout
    assert r.stdout.count("step    1/3") == 1  # progress only from rank 0
    cfg = load_config(run_dir / "config.toml")
    assert cfg.parallel.zero == 2 and cfg.parallel.dp == 2 and cfg.train.steps == 3
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert {"loss", "grad_norm", "lr", "loss_scale", "tokens_per_s", "peak_memory_bytes"} <= lines[0].keys()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["layout"]["dp"] == 2 and summary["layout"]["zero"] == 2
    assert len(summary["peak_memory_bytes"]) == 2 and all(x > 0 for x in summary["peak_memory_bytes"])
    assert summary["final_loss"] == lines[-1]["loss"]
    # The launcher resolved the backend once and every rank used it.
    assert summary["backend"] == json.loads(info.stdout)["backend"]

    # One process on the same global batch lands on the same losses.
    assert r1.returncode == 0, r1.stdout + r1.stderr
    single = [json.loads(x)["loss"] for x in (one / "metrics.jsonl").read_text().splitlines()]
    assert single == pytest.approx([m["loss"] for m in lines], rel=1e-5)

    # Four ranks at ZeRO-3 (one sequence each) too.
    assert r4.returncode == 0, r4.stdout + r4.stderr
    s4 = json.loads((four / "summary.json").read_text())
    assert s4["layout"]["dp"] == 4 and len(s4["peak_memory_bytes"]) == 4
    got = [json.loads(x)["loss"] for x in (four / "metrics.jsonl").read_text().splitlines()]
    assert got == pytest.approx(single, rel=1e-5)


def test_a_one_rank_run_leaves_the_callers_process_as_it_found_it(tmp_path, capsys):
    """``chipset train`` with one rank trains inside the calling process (a notebook, a test):
    afterwards its environment, its Ctrl-C handler and torch's dispatch-mode stack are the
    caller's again (cpu_sim's memory accounting is a process-wide dispatch mode; left on, it slows
    every later op and breaks torch's own tensor subclasses such as causal_lower_right)."""
    import os
    import signal

    import torch
    from torch.nn.attention.bias import causal_lower_right

    env, handler = dict(os.environ), signal.getsignal(signal.SIGINT)
    modes = torch._C._len_torch_dispatch_stack()
    assert main(["train", *SMALL, "--run-dir", str(tmp_path / "run")]) == 0, capsys.readouterr().err
    assert dict(os.environ) == env
    assert signal.getsignal(signal.SIGINT) is handler
    assert torch._C._len_torch_dispatch_stack() == modes
    causal_lower_right(3, 7)  # raises under a leftover dispatch mode
