"""Elastic node ranges without a job: the world fit, the refusals before launch, the torchrun command.

The two-node run in network namespaces is tests/train/test_elastic_nodes.py.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import forked_cli
import testenv
from chipset.errors import ConfigError
from chipset.train.config import resolve_config
from chipset.train.elastic import check_node_range, fit_world
from chipset.train.launch import rendezvous_conf, torchrun_command
from chipset_cpu_sim.faults import ANY_RANK, Fault, FaultPlan, parse_faults


def _cfg(world: int, *sets: str):
    return resolve_config(None, ["train.global_batch=24", *sets], world_size=world)


def test_a_smaller_world_keeps_the_global_batch_with_more_micro_batches():
    cfg = _cfg(4, "parallel.micro_batches=2")  # dp 4 x 2 micro-batches of 3 sequences
    change = fit_world(cfg, 2, local_world_size=2)
    assert (cfg.parallel.dp, cfg.parallel.micro_batches) == (2, 4)
    assert change.to_dict() == {
        "planned_world_size": 4, "world_size": 2, "planned_nodes": 2, "nodes": 1, "planned_dp": 4, "dp": 2,
        "planned_micro_batches": 2, "micro_batches": 4, "global_batch": 24, "micro_batch_size": 3}
    assert cfg.parallel.dp * cfg.parallel.micro_batches * change.micro_batch_size == cfg.train.global_batch
    assert "world 4 -> 2, dp 4 -> 2, micro_batches 2 -> 4 (train.global_batch 24 kept" in change.line()
    cfg.validate(world_size=2)


def test_the_planned_world_is_left_alone():
    cfg = _cfg(2)
    assert fit_world(cfg, 2) is None and cfg.parallel.micro_batches == 1


def test_tp_stays_and_dp_shrinks():
    cfg = resolve_config(None, ["train.global_batch=8", "parallel.tp=2", "model.num_key_value_heads=2"],
                         world_size=4)
    change = fit_world(cfg, 2, local_world_size=2)
    assert (cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.micro_batches) == (1, 2, 2)
    assert change.micro_batch_size == 4


def test_a_global_batch_that_cannot_be_kept_is_a_config_error():
    cfg = _cfg(4)  # dp 4 x micro-batches of 6: 3 ranks would need 18 per step, not 24
    with pytest.raises(ConfigError) as e:
        fit_world(cfg, 3)
    msg = str(e.value)
    assert "train.global_batch (24) cannot be kept on a world of 3 rank(s)" in msg and "divisible by 18" in msg
    assert e.value.exit_code == 2


def test_a_world_that_tp_does_not_divide_is_a_config_error():
    cfg = resolve_config(None, ["train.global_batch=8", "parallel.tp=2", "model.num_key_value_heads=2"],
                         world_size=4)
    with pytest.raises(ConfigError, match=r"re-formed with 3 rank\(s\), which tp\*pp\*cp \(2\) does not divide"):
        fit_world(cfg, 3)


def test_the_node_range_is_checked_for_every_node_count():
    cfg = _cfg(3)  # 3 nodes x 1 rank: micro-batches of 8; 2 nodes would need 16 per step
    with pytest.raises(ConfigError, match=r"--nnodes 1:3: on 2 node\(s\) train.global_batch \(24\) cannot be kept"):
        check_node_range(cfg, 1, 1, 3)
    assert cfg.parallel.dp == 3  # the check does not change the config it is given
    check_node_range(_cfg(2), 1, 1, 2)  # 2 nodes -> 1 keeps 24 as 2 micro-batches of 12


def test_train_refuses_a_node_range_before_writing_anything(tmp_path):
    run = tmp_path / "run"
    env = testenv.clean_env()
    env["CHIPSET_BACKEND"] = "cpu_sim"
    r = forked_cli.run([sys.executable, "-m", "chipset.cli.main", "train", "--nnodes", "1:3", "--set",
                        "train.global_batch=12", "--run-dir", str(run)], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "on 2 node(s) train.global_batch (12) cannot be kept on a world of 2 rank(s)" in r.stderr
    assert not run.exists()


def test_torchrun_command_passes_the_rendezvous_through(tmp_path):
    cmd = torchrun_command(tmp_path / "c.toml", tmp_path, nproc=1, nnodes="1:2", rdzv_endpoint="10.0.0.1:29400",
                           rdzv_id="job7", rdzv_conf="last_call_timeout=5,is_host=true", local_addr="10.0.0.2",
                           max_restarts=1)
    assert {"--nnodes=1:2", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29400", "--rdzv-id=job7",
            "--rdzv-conf=last_call_timeout=5,is_host=true", "--local-addr=10.0.0.2", "--max-restarts=1"} <= set(cmd)
    single = torchrun_command(tmp_path / "c.toml", tmp_path, nproc=2)
    # one node: a private rendezvous on loopback (chipset.train.agent keeps its store there)
    assert "--rdzv-endpoint=127.0.0.1:0" in single and "--nnodes=1" in single
    assert not any(a.startswith(("--rdzv-conf", "--local-addr")) for a in single)


def test_rendezvous_conf_says_who_hosts_the_store():
    # 192.0.2.0/24 is reserved for documentation: never an address of this machine.
    assert rendezvous_conf("192.0.2.7:29400", "last_call_timeout=5") == "last_call_timeout=5,is_host=false"
    assert rendezvous_conf("192.0.2.7", "") == "is_host=false"
    # Loopback endpoints keep torch's own guess; a user's is_host wins.
    assert rendezvous_conf("localhost:29400", "") == ""
    assert rendezvous_conf("127.0.0.1:29400", "a=1") == "a=1"
    assert rendezvous_conf("192.0.2.7:29400", "is_host=true") == "is_host=true"
    assert rendezvous_conf(None, "x=1, ,y=2") == "x=1,y=2"


def test_hosting_is_decided_by_binding_the_endpoint():
    import socket

    from chipset.train.launch import _bind_result

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert _bind_result("127.0.0.1", port) is None  # local, but another process hosts: torch decides
    assert _bind_result("127.0.0.1", 0) is True
    assert _bind_result("192.0.2.7", 29400) is False


def test_kill_node_parses_with_or_without_a_rank():
    assert parse_faults("kill_node:step=7") == [Fault("kill_node", ANY_RANK, step=7, spec="kill_node:step=7")]
    assert parse_faults("kill_node:rank=1,step=3")[0].rank == 1
    assert parse_faults("kill_node:step=7")[0].marker_name == "kill_node-step7.done"
    with pytest.raises(ConfigError, match="give exactly one of step"):
        parse_faults("kill_node:rank=1")


def test_kill_node_outside_torchrun_refuses_instead_of_killing_its_parent(monkeypatch):
    monkeypatch.delenv("GROUP_RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("CHIPSET_SIM_FAULT_DIR", raising=False)
    plan = FaultPlan(parse_faults("kill_node:step=2"))
    plan.on_step(0, 1)  # not its step: nothing happens
    with pytest.raises(ConfigError, match="kill_node needs ranks started by torchrun"):
        plan.on_step(0, 2)


def test_summary_records_the_change(tmp_path):
    # The world fit as the worker applies it, through the trainer, in one process.
    code = (
        "import json, sys\n"
        "from chipset.train.config import resolve_config\n"
        "from chipset.train.elastic import fit_world\n"
        "from chipset.train.loop import train\n"
        "from chipset.loader import backend\n"
        "cfg = resolve_config(None, ['train.steps=2', 'train.global_batch=4'], world_size=2)\n"
        "change = fit_world(cfg, 1)\n"
        "b = backend(); b.collective.init_process_group()\n"
        f"train(cfg, b, {str(tmp_path)!r}, elastic=change)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CHIPSET_", "TORCHELASTIC_"))}
    env["CHIPSET_BACKEND"] = "cpu_sim"
    r = forked_cli.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "chipset elastic: running on 1 of 2 planned node(s): world 2 -> 1" in r.stdout
    summary = json.loads((Path(tmp_path) / "summary.json").read_text())
    assert summary["elastic"]["micro_batches"] == 2 and summary["layout"]["dp"] == 1
