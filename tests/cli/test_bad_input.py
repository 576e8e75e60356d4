"""Bad input exits 2 with a message naming what was expected and found, and writes nothing.

Every case runs the real ``chipset`` entry point (in-process ``main`` where the backend can be
shared, a subprocess where an environment variable must be read at start-up). Each asserts the
exit status, the message and that no run directory, report or plugin folder was left behind.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from chipset.cli.main import main
from chipset.errors import UsageError
from chipset.train.config import RunConfig, resolve_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "report"))
from test_report import _write_run  # noqa: E402

import forked_cli

BINARY = b"\x7fELF\x02\x01\x01\x00\xd0\xff" + bytes(range(256))
"""The head of an executable: a NUL byte and bytes that are not UTF-8."""
UNWRITABLE = "/proc/chipset-no-such-dir/run"
"""A folder nobody can create, root included: /proc accepts no new entries (permission bits would
not stop root, so a chmod-ed folder cannot stand in for "read-only" when tests run as root)."""


@pytest.fixture(autouse=True)
def _simulator(monkeypatch):
    """The simulator (8 devices of 16 GiB), whatever hardware this machine has."""
    monkeypatch.setenv("CHIPSET_BACKEND", "cpu_sim")
    for var in ("CHIPSET_SIM_DEVICES", "CHIPSET_SIM_VISIBLE_DEVICES", "CHIPSET_SIM_PROFILE",
                "CHIPSET_COLLECTIVE_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)


def _train(tmp_path, capsys, *args: str) -> tuple[int, str, Path]:
    run_dir = tmp_path / "run"
    rc = main(["train", "--run-dir", str(run_dir), "--set", "train.steps=1", *args])
    return rc, capsys.readouterr().err, run_dir


def _keys(typ: type) -> list[str]:
    cfg = RunConfig()
    return [f"{s.name}.{f.name}" for s in dataclasses.fields(cfg)
            for f in dataclasses.fields(getattr(cfg, s.name)) if f.type in (typ, typ.__name__)]


FLOAT_KEYS = _keys(float)
INT_KEYS = _keys(int)
STR_KEYS = _keys(str)


def test_the_key_lists_cover_the_keys_the_issue_names():
    for key in ("train.lr", "train.eps", "model.rms_norm_eps", "model.init_std", "model.rope_theta",
                "train.initial_loss_scale", "parallel.bucket_mb"):
        assert key in FLOAT_KEYS, key
    assert "model.hidden_size" in INT_KEYS and "data.path" in STR_KEYS


# --- config files and values ------------------------------------------------------------------


@pytest.mark.parametrize("command", ["train", "plan"])
def test_binary_config_file_exits_2_naming_the_byte(tmp_path, capsys, command):
    cfg = tmp_path / "model.toml"
    cfg.write_bytes(BINARY)
    run_dir = tmp_path / "run"
    argv = (["train", str(cfg), "--run-dir", str(run_dir)] if command == "train"
            else ["plan", "--model", str(cfg), "--cluster", "1x8:a100-80g"])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"'{cfg}' is not a text file: byte 0x00 at offset 7" in err
    assert "expected a TOML" in err and "Traceback" not in err
    assert not run_dir.exists()


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_every_float_key_refuses_non_finite_values(tmp_path, capsys, key, value):
    rc, err, run_dir = _train(tmp_path, capsys, "--set", f"{key}={value}")
    assert rc == 2
    assert f"{key} = {value}: expected a finite number" in err
    assert err.count(f"- {key} ") == 1, err  # one message per key, not one per rule it breaks
    assert not run_dir.exists()


@pytest.mark.parametrize("key", INT_KEYS)
def test_every_int_key_refuses_values_beyond_int64(tmp_path, capsys, key):
    rc, err, run_dir = _train(tmp_path, capsys, "--set", f"{key}={10**30}")
    assert rc == 2
    assert f"{key} = 1.000e+30: far too large; expected an integer of at most 9223372036854775807" in err
    assert not run_dir.exists()


@pytest.mark.parametrize("char", ["\\n", "\\r", "\\u001b", "\\u2028"])
@pytest.mark.parametrize("key", STR_KEYS)
def test_every_string_key_refuses_control_characters(tmp_path, capsys, key, char):
    cfg = tmp_path / "c.toml"
    section, name = key.split(".")
    cfg.write_text(f'[{section}]\n{name} = "a{char}b"\n')
    rc = main(["train", str(cfg), "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"{key} = 'a" in err and "expected one line of printable text" in err
    assert not (tmp_path / "run").exists()


# --- run directory, data, environment -----------------------------------------------------------


@pytest.mark.parametrize("case", ["file", "under-file", "proc", "read-only"])
def test_run_dir_that_cannot_be_written_exits_2_before_launch(tmp_path, capsys, case):
    afile = tmp_path / "afile"
    afile.write_text("x")
    if case == "read-only":
        if os.geteuid() == 0:
            pytest.skip("root writes into a mode 0555 folder; the 'proc' case covers a place root cannot write")
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
    run_dir = {"file": afile, "under-file": afile / "run", "proc": Path(UNWRITABLE),
               "read-only": tmp_path / "ro" / "run"}[case]
    expect = {"file": "is a file, not a folder", "under-file": "which is a file, not a folder",
              "proc": "cannot be written", "read-only": "cannot be written"}[case]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["train", "--run-dir", str(run_dir), "--set", "train.steps=1"]) == 2
    err = capsys.readouterr().err
    assert f"run directory '{run_dir}'" in err and expect in err and "--run-dir" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before and afile.read_text() == "x"


@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("case", ["data-path", "timeout-word", "timeout-nan", "timeout-inf", "timeout-zero"])
def test_missing_data_and_bad_timeout_exit_2_before_any_rank_starts(tmp_path, capsys, monkeypatch, nproc, case):
    args = ["--nproc", str(nproc)]
    if case == "data-path":
        args += ["--set", 'data.source="text"', "--set", "model.vocab_size=256",
                 "--set", f'data.path="{tmp_path / "no-such-corpus"}"']
        expect = "no-such-corpus': no such file or directory"
    else:
        value = {"timeout-word": "ten", "timeout-nan": "nan", "timeout-inf": "inf", "timeout-zero": "0"}[case]
        monkeypatch.setenv("CHIPSET_COLLECTIVE_TIMEOUT", value)
        expect = f"CHIPSET_COLLECTIVE_TIMEOUT must be a positive, finite number of seconds (below 1e9), found '{value}'"
    rc, err, run_dir = _train(tmp_path, capsys, *args)
    assert rc == 2 and expect in err, err
    assert not run_dir.exists()


# --- absurd sizes -------------------------------------------------------------------------------


@pytest.mark.parametrize("sets", [
    ["train.global_batch=1000000"],
    ["train.seq_len=1000000", "model.max_position_embeddings=1000000"],
    ["model.hidden_size=1099511627776"],
    ["model.max_position_embeddings=1000000000000"],
    ["model.num_hidden_layers=1000000000"],
    ["model.vocab_size=1000000000000"],
])
def test_sizes_no_device_can_hold_are_refused_with_the_estimate(tmp_path, capsys, sets):
    args = [a for s in sets for a in ("--set", s)]
    rc, err, run_dir = _train(tmp_path, capsys, *args)
    assert rc == 2, err
    assert "this job needs about" in err and "GiB per rank" in err and "each device holds" in err
    assert "lower model.hidden_size" in err  # what to change
    assert not run_dir.exists()


@pytest.mark.parametrize("sets, expect", [
    (["parallel.pp=1000000"], "tp*pp*cp (1000000) must divide world size (1)"),
    (["parallel.pp=2", "parallel.micro_batches=1000000000"], "must be divisible by dp*micro_batches"),
    (["parallel.pp=2", "parallel.schedule=interleaved_1f1b", "parallel.virtual_stages=1000000000"],
     "pp*virtual_stages (2000000000) exceeds the model's 4 pipeline units"),
])
def test_huge_pipeline_degrees_are_refused_without_building_the_schedule(tmp_path, capsys, sets, expect):
    nproc = "1" if sets == ["parallel.pp=1000000"] else "2"
    rc, err, run_dir = _train(tmp_path, capsys, "--nproc", nproc, *[a for s in sets for a in ("--set", s)])
    assert rc == 2 and expect in err, err
    assert not run_dir.exists()


def test_seq_len_beyond_the_rotary_tables_is_refused_by_config(tmp_path, capsys):
    rc, err, _ = _train(tmp_path, capsys, "--set", "train.seq_len=1000000")
    assert rc == 2 and "train.seq_len (1000000) must be <= model.max_position_embeddings" in err


def test_host_memory_bounds_the_ranks_of_a_node():
    from chipset.planner.run import check_job_memory

    cfg = resolve_config(None, ["train.global_batch=4096"], world_size=2)
    per_rank = check_job_memory(cfg, 2, 2, device_memory=None, device_is_host=True, available=(2**62, "plenty"))
    assert per_rank > 2**20
    # Two ranks on a host that can back one and a half of them: refused, naming both numbers.
    with pytest.raises(UsageError) as info:
        check_job_memory(cfg, 2, 2, device_memory=None, device_is_host=True,
                         available=(int(1.5 * per_rank), "MemAvailable in /proc/meminfo"))
    msg = str(info.value)
    assert "of host memory on this node (2 rank(s) x" in msg and "MemAvailable in /proc/meminfo" in msg
    assert "fewer ranks per node" in msg
    # Devices with their own memory: the host's is not the limit.
    check_job_memory(cfg, 2, 2, device_memory=None, device_is_host=False, available=(1, "tiny host"))


def _limited(*args: str, env: dict[str, str], limit: int) -> subprocess.CompletedProcess:
    """``chipset ARGS`` with at most ``limit`` bytes of address space: a command that allocated what it
    was asked for would die of MemoryError (exit 1), not exit 2."""
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    cap_at = limit if hard == resource.RLIM_INFINITY else min(limit, hard)

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (cap_at, hard))

    e = {k: v for k, v in os.environ.items() if not k.startswith("CHIPSET_")}
    e.update(OMP_NUM_THREADS="1", CHIPSET_BACKEND="cpu_sim", **env)
    return forked_cli.run([sys.executable, "-m", "chipset.cli.main", *args], capture_output=True, text=True,
                          env=e, timeout=300, preexec_fn=cap)


@pytest.mark.parametrize("case", ["sim-devices", "global-batch"])
def test_absurd_sizes_are_refused_before_host_memory_is_allocated(tmp_path, case):
    run_dir = tmp_path / "run"
    env = {"CHIPSET_SIM_DEVICES": "99999999"} if case == "sim-devices" else {}
    sets = ["--set", "train.global_batch=1000000"] if case == "global-batch" else []
    r = _limited("train", "--run-dir", str(run_dir), *sets, env=env, limit=8 * 2**30)
    assert r.returncode == 2, r.stderr[-2000:]
    expect = ("CHIPSET_SIM_DEVICES=99999999: at most 4096 simulated devices" if case == "sim-devices"
              else "this job needs about")
    assert expect in r.stderr and "Traceback" not in r.stderr
    assert not run_dir.exists()


def test_sim_device_count_has_a_ceiling(monkeypatch):
    from chipset_cpu_sim.device import MAX_DEVICES, physical_count

    monkeypatch.setenv("CHIPSET_SIM_DEVICES", str(MAX_DEVICES))
    assert physical_count() == MAX_DEVICES
    monkeypatch.setenv("CHIPSET_SIM_DEVICES", str(MAX_DEVICES + 1))
    with pytest.raises(UsageError, match=f"set CHIPSET_SIM_DEVICES to {MAX_DEVICES} or fewer"):
        physical_count()


def test_plan_refuses_an_absurd_cluster_at_once(capsys):
    assert main(["plan", "--preset", "llama2-7b", "--cluster", "1000000000x1000000000:a100-80g"]) == 2
    err = capsys.readouterr().err
    assert "has 1,000,000,000,000,000,000 devices" in err and "at most 1,048,576" in err


def test_plan_refuses_a_model_beyond_int64(capsys):
    assert main(["plan", "--preset", "tiny", "--set", f"model.hidden={10**30}", "--cluster", "1x8:a100-80g"]) == 2
    assert "model.hidden must be a positive integer of at most 2**63-1" in capsys.readouterr().err


# --- chipset report -----------------------------------------------------------------------------


def _break(run: Path, case: str) -> str:
    """Damage one file of a good run directory; return the message expected."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    text = (run / "summary.json").read_text()
    if case == "summary-truncated":
        (run / "summary.json").write_text(text[: len(text) // 2])
        return "summary.json is not valid JSON"
    if case == "summary-empty":
        (run / "summary.json").write_text("")
        return "summary.json is empty"
    if case == "summary-list":
        (run / "summary.json").write_text("[1, 2]")
        return "summary.json: expected a JSON object, found a list"
    if case == "summary-string-value":
        (run / "summary.json").write_text(json.dumps({**json.loads(text), "tokens_per_s": "fast"}))
        return "'tokens_per_s' = \"fast\": expected a number, found a string"
    if case == "metrics-list-line":
        (run / "metrics.jsonl").write_text("\n".join([lines[0], "[1, 2]", *lines[1:]]) + "\n")
        return "metrics.jsonl line 2: expected a JSON object (one step's metrics), found a list"
    if case == "metrics-string-line":
        (run / "metrics.jsonl").write_text("\n".join(['"step 1"', *lines]) + "\n")
        return "metrics.jsonl line 1: expected a JSON object (one step's metrics), found a string"
    if case == "metrics-string-value":
        rec = {**json.loads(lines[1]), "loss": "low"}
        (run / "metrics.jsonl").write_text("\n".join([lines[0], json.dumps(rec), *lines[2:]]) + "\n")
        return "metrics.jsonl line 2: 'loss' = \"low\": expected a number, found a string"
    if case == "metrics-binary":
        (run / "metrics.jsonl").write_bytes(BINARY)
        return "is not a text file"
    if case == "config-binary":
        (run / "config.toml").write_bytes(BINARY)
        return "run config '" + str(run / "config.toml") + "' is not a text file"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["summary-truncated", "summary-empty", "summary-list", "summary-string-value",
                                  "metrics-list-line", "metrics-string-line", "metrics-string-value",
                                  "metrics-binary", "config-binary"])
def test_report_on_damaged_files_exits_2_and_writes_nothing(tmp_path, capsys, case):
    run = _write_run(tmp_path / "run")
    expect = _break(run, case)
    before = sorted(p.name for p in run.iterdir())
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert expect in err, err
    assert "Traceback" not in err
    assert sorted(p.name for p in run.iterdir()) == before  # no report.html, no PNG folder


def test_report_tolerates_a_torn_last_metrics_line(tmp_path, capsys):
    run = _write_run(tmp_path / "run")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')
    assert main(["report", str(run), "--no-png"]) == 0
    assert "line 5 is not JSON" in (run / "report.html").read_text()


@pytest.mark.parametrize("case", ["missing-dir", "under-file", "proc", "is-dir"])
def test_report_out_where_it_cannot_go_exits_2(tmp_path, capsys, case):
    run = _write_run(tmp_path / "run")
    afile = tmp_path / "afile"
    afile.write_text("x")
    out = {"missing-dir": tmp_path / "missing" / "r.html", "under-file": afile / "r.html",
           "proc": Path("/proc/chipset-no-such-dir/r.html"), "is-dir": tmp_path}[case]
    expect = {"missing-dir": "does not exist; create it first", "under-file": "which is a file, not a folder",
              "proc": "does not exist; create it first", "is-dir": "is a folder; expected a file name"}[case]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["report", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert expect in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before and not (run / "report.html").exists()


# --- chipset plugin new -------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["file", "under-file", "proc"])
def test_plugin_new_into_a_place_it_cannot_write_exits_2(tmp_path, capsys, case):
    afile = tmp_path / "afile"
    afile.write_text("x")
    target = {"file": afile, "under-file": afile / "plugin", "proc": Path(UNWRITABLE)}[case]
    expect = {"file": "is a file; expected a new or empty folder", "under-file": "which is a file, not a folder",
              "proc": "cannot be written"}[case]
    assert main(["plugin", "new", "acme_npu", "--dir", str(target)]) == 2
    assert expect in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"] and afile.read_text() == "x"


def test_plugin_new_refuses_the_name_of_an_installed_backend(tmp_path, capsys):
    target = tmp_path / "p"
    assert main(["plugin", "new", "cpu_sim", "--dir", str(target)]) == 2
    err = capsys.readouterr().err
    assert "plugin name 'cpu_sim' is taken: backend 'cpu_sim' is installed" in err and "choose another name" in err
    assert not target.exists()
