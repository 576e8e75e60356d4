"""``chipset plan``: output shape, JSON keys, explanation, and exit 2 on bad input."""

from __future__ import annotations

import dataclasses
import json

import pytest

from chipset.cli.main import main
from chipset.interfaces.device import DeviceProperties
from conftest import run_cli

KEYS = ["dp", "tp", "pp", "ep", "cp", "zero", "micro_batch", "schedule", "recompute",
        "memory_per_device_bytes", "step_time_s", "tokens_per_s", "tflops_per_device", "mfu"]
DEV = DeviceProperties(name="plan-test", index=0, total_memory=80 * 2**30, peak_flops={"bfloat16": 300e12},
                       memory_bandwidth=2e12, intra_node_bandwidth=300e9, inter_node_bandwidth=25e9,
                       intra_node_latency=5e-6, inter_node_latency=10e-6)


@pytest.fixture(autouse=True)
def _profiles(monkeypatch):
    """A known profile whatever the installed plugins declare."""
    import chipset.planner.cluster as cluster

    declaring = dataclasses.replace(DEV, name="plan-declared", matmul_efficiency=0.7, attention_efficiency=0.4)
    monkeypatch.setattr(cluster, "all_profiles", lambda: {"plan-test": ("testbackend", DEV),
                                                          "plan-declared": ("testbackend", declaring)})


def _plan(capsys, *args):
    rc = main(["plan", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_json_is_a_list_of_candidates_with_exactly_the_documented_keys(capsys):
    rc, out, _ = _plan(capsys, "--preset", "llama2-7b", "--cluster", "2x8:plan-test", "--global-batch", "64",
                       "--fix", "parallel.micro_batch=1", "--top", "3", "--json")
    assert rc == 0
    data = json.loads(out)
    assert len(data) == 3
    for c in data:
        assert list(c) == KEYS
        assert c["dp"] * c["tp"] * c["pp"] * c["cp"] == 16
        assert 0 < c["mfu"] < 1 and c["memory_per_device_bytes"] <= 80 * 2**30
    assert [c["step_time_s"] for c in data] == sorted(c["step_time_s"] for c in data)


def test_table_reports_discards_and_explains_the_winner(capsys):
    rc, out, _ = _plan(capsys, "--preset", "tiny", "--cluster", "1x8:plan-test", "--global-batch", "16", "--top", "2")
    assert rc == 0
    assert "discarded" in out and "tp does not divide heads and kv_heads" in out
    assert "The fastest layout" in out and "runner-up" in out
    assert out.count("\n 1 ") == 1 and "\n 2 " in out


def test_model_file_set_and_seq_len_are_applied(tmp_path, capsys):
    f = tmp_path / "m.toml"
    f.write_text('[model]\npreset = "tiny"\nlayers = 4\n')
    rc, out, _ = _plan(capsys, "--model", str(f), "--set", "model.hidden=128", "--seq-len", "64",
                       "--cluster", "1x4:plan-test", "--global-batch", "8", "--fix", "parallel.pp=4", "--json")
    assert rc == 0 and all(c["pp"] == 4 for c in json.loads(out))


def test_bandwidth_overrides_change_the_prediction(capsys):
    args = ["--preset", "llama2-7b", "--cluster", "4x8:plan-test", "--global-batch", "64", "--json",
            "--fix", "parallel.dp=32,parallel.tp=1,parallel.pp=1,parallel.cp=1,parallel.zero=0,"
                     "parallel.micro_batch=1,parallel.schedule=1f1b,parallel.recompute=full"]
    base = json.loads(_plan(capsys, *args)[1])
    slow = json.loads(_plan(capsys, *args, "--inter-node-bw", "1")[1])
    fast = json.loads(_plan(capsys, *args, "--inter-node-bw", "400", "--intra-node-bw", "900")[1])
    assert len(base) == 1
    assert slow[0]["step_time_s"] > base[0]["step_time_s"] >= fast[0]["step_time_s"]


@pytest.mark.parametrize("profile", ["plan-test", "plan-declared"])
def test_efficiency_and_optimizer_overrides_change_the_prediction(capsys, profile):
    """--efficiency and --attention-efficiency apply whether or not the profile declares its own
    (a profile's value used to win over --efficiency); --update-bytes slows the update."""
    args = ["--preset", "llama2-7b", "--cluster", f"1x8:{profile}", "--global-batch", "8", "--json",
            "--fix", "parallel.dp=8,parallel.tp=1,parallel.pp=1,parallel.cp=1,parallel.zero=1,"
                     "parallel.micro_batch=1,parallel.schedule=1f1b,parallel.recompute=none"]
    step = {}
    for name, extra in (("base", []), ("gemm", ["--efficiency", "0.35"]),
                        ("attention", ["--attention-efficiency", "0.1"]), ("update", ["--update-bytes", "320"]),
                        ("loss", ["--loss-bytes", "360"])):
        rc, out, _ = _plan(capsys, *args, *extra)
        assert rc == 0
        step[name] = json.loads(out)[0]["step_time_s"]
    assert step["gemm"] > 1.5 * step["base"], step
    assert step["attention"] > step["base"] and step["update"] > step["base"], step
    assert step["loss"] > step["base"], step


def test_whole_forward_recompute_costs_more_than_torchs_early_stop(capsys):
    """--whole-forward-recompute reruns the MLP output projection too: slower under full
    recompute, the same without it."""
    step = {}
    for rc in ("none", "full"):
        for extra in ([], ["--whole-forward-recompute"]):
            rc_code, out, _ = _plan(capsys, "--preset", "llama2-7b", "--cluster", "1x8:plan-test", "--global-batch",
                                    "8", "--json", "--fix", "parallel.dp=8,parallel.tp=1,parallel.pp=1,parallel.cp=1,"
                                    f"parallel.zero=1,parallel.micro_batch=1,parallel.schedule=1f1b,parallel.recompute={rc}",
                                    *extra)
            assert rc_code == 0
            step[rc, bool(extra)] = json.loads(out)[0]["step_time_s"]
    assert step["full", True] > step["full", False] > step["none", False] == step["none", True], step


@pytest.mark.parametrize(("args", "message"), [
    (["--preset", "tiny", "--cluster", "1x8:plan-test", "--efficiency", "1.5"], r"--efficiency must be .*\(0, 1\]"),
    (["--preset", "tiny", "--cluster", "1x8:plan-test", "--attention-efficiency", "0"], "--attention-efficiency must be"),
    (["--preset", "tiny", "--cluster", "1x8:plan-test", "--update-bytes", "-1"], "--update-bytes must be positive"),
    (["--preset", "tiny", "--cluster", "1x8:plan-test", "--loss-bytes", "0"], "--loss-bytes must be positive bytes per logit"),
    (["--preset", "tiny", "--cluster", "eight:plan-test"], "cannot parse cluster spec 'eight:plan-test'"),
    (["--validation"], "need the device profiles a100-80g, h100-sxm, which are not installed.*pip install -e plugins/cuda"),
    (["--preset", "tiny", "--cluster", "1x8:nosuch"], "unknown device profile 'nosuch'.*known profiles: plan-declared, plan-test"),
    (["--preset", "tiny", "--cluster", "1x8:plan-test", "--fix", "parallel.tp=8"], r"tp \(8\) must divide heads"),
    (["--preset", "tiny", "--cluster", "1x8:plan-test", "--global-batch", "12", "--fix", "parallel.dp=8"],
     r"global batch \(12\) is not divisible by dp x micro-batch"),
    (["--preset", "nosuch", "--cluster", "1x8:plan-test"], "unknown model preset 'nosuch'"),
    (["--cluster", "1x8:plan-test"], "no model given"),
    (["--preset", "tiny"], "--cluster NODESxDEVICES:PROFILE is required"),
    (["--preset", "llama2-70b", "--cluster", "1x1:plan-test"], "no layout of llama2-70b fits"),
])
def test_bad_input_exits_2_with_a_clear_message(capsys, args, message):
    import re

    rc, _, err = _plan(capsys, *args)
    assert rc == 2
    assert re.search(message, err), err
    assert "Traceback" not in err


def test_list_profiles_lists_declared_profiles(capsys):
    rc, out, _ = _plan(capsys, "--list-profiles")
    assert rc == 0 and "plan-test" in out and "testbackend" in out


def test_plan_is_a_registered_command_and_exits_2_for_a_bad_spec_in_a_subprocess():
    r = run_cli("plan", "--preset", "tiny", "--cluster", "8:sim-generic")
    assert r.returncode == 2 and "cannot parse cluster spec" in r.stderr
