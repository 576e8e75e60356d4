"""Metrics sinks (issue 37): train.metrics_sinks chooses where rank 0 sends each step's record
besides metrics.jsonl; tensorboard built in, wandb and mlflow through chipset's own
``chipset.metrics_sinks`` entry points, a third party's through its distribution's."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import importlib_metadata
import pytest

import forked_cli
import testenv
from chipset.errors import ConfigError
from chipset.train import sinks
from chipset.train.config import RunConfig

ROOT = Path(__file__).resolve().parents[2]
TRACKER_ENV = ("WANDB_", "MLFLOW_")


def _cfg(names: str, steps: int = 3) -> RunConfig:
    cfg = RunConfig()
    cfg.train.metrics_sinks = names
    cfg.train.steps = steps
    return cfg


def _env(site: Path | None = None, **extra: str) -> dict[str, str]:
    """A ``chipset train`` subprocess's environment: no tracker settings of this machine's user."""
    env = {k: v for k, v in testenv.clean_env().items() if not k.startswith(TRACKER_ENV)}
    env["OMP_NUM_THREADS"] = "1"
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(site), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    env.update(extra)
    return env


def _train(run_dir: Path, *sets: str, env: dict[str, str], timeout: int = 300) -> subprocess.CompletedProcess:
    args = [a for s in ("train.global_batch=4", *sets) for a in ("--set", s)]
    return forked_cli.run([sys.executable, "-m", "chipset.cli.main", "train", "--run-dir", str(run_dir), *args],
                          capture_output=True, text=True, env=env, timeout=timeout)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _install_sinks(site: Path, dist: str, module: str, body: str, entries: dict[str, str]) -> None:
    """A real installed distribution (package + dist-info, as pip leaves it) with
    ``chipset.metrics_sinks`` entry points ``{name: "attr"}`` into ``module``."""
    (site / module).mkdir(parents=True)
    (site / module / "__init__.py").write_text(textwrap.dedent(body))
    info = site / f"{dist.replace('-', '_')}-1.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0.0\n")
    (info / "entry_points.txt").write_text(
        "[chipset.metrics_sinks]\n" + "".join(f"{n} = {module}:{attr}\n" for n, attr in entries.items()))
    (info / "top_level.txt").write_text(module + "\n")


THIRD_PARTY = """
import json
from pathlib import Path


class Recorder:
    \"\"\"Writes every call it gets to RUN_DIR/<name>.jsonl.\"\"\"

    def __init__(self, name):
        self.name = name

    def open(self, run_dir, cfg):
        self.path = Path(run_dir) / f"{self.name}.jsonl"
        self._write({"event": "open", "run_dir": str(run_dir), "steps": cfg.train.steps})

    def log(self, step, record):
        self._write({"event": "log", "step": step, "record": record})
        if self.name == "broken" and step >= 2:
            raise RuntimeError(f"disk full at step {step}")

    def close(self):
        self._write({"event": "close"})

    def _write(self, obj):
        with open(self.path, "a") as f:
            f.write(json.dumps(obj) + "\\n")


class BadOpen(Recorder):
    def open(self, run_dir, cfg):
        raise OSError("no route to host")


def recorder():
    return Recorder("recorder")


def broken():
    return Recorder("broken")


def bad_open():
    return BadOpen("bad_open")


def needs_package():
    from chipset.train.sinks import SinkUnavailable

    raise SinkUnavailable("the acme sink needs acme-client: pip install acme-client")


def not_a_sink():
    return 42
"""


@pytest.fixture
def third_party(site):
    _install_sinks(site, "chipset-sinks-acme", "plugin_sinks_acme", THIRD_PARTY,
                   {"recorder": "recorder", "broken": "broken", "bad_open": "bad_open",
                    "needs_package": "needs_package", "not_a_sink": "not_a_sink"})
    _install_sinks(site, "chipset-sinks-lost", "plugin_sinks_lost", "raise ImportError(\"No module named 'lost_dep'\")\n",
                   {"lost": "factory"})
    return site


# --- choosing sinks ---------------------------------------------------------------------


def test_metrics_sinks_key_is_a_comma_separated_string_with_auto_and_none():
    assert RunConfig().train.metrics_sinks == "auto"
    assert sinks.sink_names("auto") is None
    assert sinks.sink_names("none") == [] and sinks.sink_names("") == []
    assert sinks.sink_names(" wandb, mlflow ,wandb,") == ["wandb", "mlflow"]
    with pytest.raises(ConfigError, match="auto and none stand alone"):
        sinks.sink_names("auto,wandb")


def test_wandb_and_mlflow_are_entry_points_of_chipset_itself_and_extras_of_all():
    eps = {ep.name: ep for ep in importlib_metadata.entry_points(group=sinks.ENTRY_POINT_GROUP)}
    for name, target in (("wandb", "chipset.train.sinks:WandbSink"), ("mlflow", "chipset.train.sinks:MlflowSink")):
        assert name in eps, (f"no {name!r} entry point in {sinks.ENTRY_POINT_GROUP}: pyproject.toml declares it; "
                             "refresh the editable install (pip install --no-deps -e .)")
        assert eps[name].value == target and eps[name].dist.metadata["Name"] == "chipset"
    try:
        import tomllib
    except ModuleNotFoundError:
        import tomli as tomllib
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(r.startswith("wandb>=") for r in extras["wandb"])
    assert any(r.startswith("mlflow-skinny>=") for r in extras["mlflow"])
    assert "wandb" in extras["all"][0] and "mlflow" in extras["all"][0]


def test_unknown_sink_names_the_installed_ones_and_exits_2(third_party):
    with pytest.raises(ConfigError) as exc:
        sinks.check_metrics_sinks(_cfg("wandbb,tensorboard,nosuch"))
    msg = str(exc.value)
    assert exc.value.exit_code == 2
    assert "unknown metrics sink 'wandbb' (did you mean 'wandb'?)" in msg
    assert "unknown metrics sink 'nosuch'" in msg
    assert "available: bad_open, broken, lost, mlflow, needs_package, not_a_sink, recorder, tensorboard, wandb" in msg
    assert "Nothing was written" in msg


@pytest.mark.parametrize("name, module, line", [
    ("wandb", "wandb", "pip install 'chipset[wandb]' (or pip install wandb)"),
    ("mlflow", "mlflow", "pip install 'chipset[mlflow]' (or pip install mlflow-skinny)"),
    ("tensorboard", "torch.utils.tensorboard", "pip install 'chipset[tensorboard]' (or pip install tensorboard)"),
])
def test_a_sink_whose_package_is_missing_exits_2_with_the_install_line(monkeypatch, name, module, line):
    for loaded in [m for m in sys.modules if m.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, loaded)
    monkeypatch.setitem(sys.modules, module, None)  # import of it raises ImportError, installed or not
    with pytest.raises(ConfigError) as exc:
        sinks.check_metrics_sinks(_cfg(name))
    assert exc.value.exit_code == 2
    assert f"the {name} sink needs" in str(exc.value) and line in str(exc.value)


def test_auto_without_tensorboard_is_a_note_not_an_error(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    sinks.check_metrics_sinks(_cfg("auto"))  # never refused
    with caplog.at_level(logging.WARNING, logger="chipset"):
        assert not sinks.open_sinks(_cfg("auto"), Path("unused"))
    assert "TensorBoard event files not written (pip install 'chipset[tensorboard]'" in caplog.text


def test_third_party_sinks_that_cannot_be_made_are_refused_with_why(third_party):
    with pytest.raises(ConfigError) as exc:
        sinks.check_metrics_sinks(_cfg("needs_package,lost,not_a_sink"))
    msg = str(exc.value)
    assert "the acme sink needs acme-client: pip install acme-client" in msg  # the factory's own install line
    assert ("metrics sink 'lost' (lost = plugin_sinks_lost:factory, distribution chipset-sinks-lost) cannot be "
            "loaded: ImportError: No module named 'lost_dep'") in msg
    assert "made a int, which is not a metrics sink" in msg
    sinks.check_metrics_sinks(_cfg("recorder,broken"))  # these are fine


def test_scalars_flatten_a_record_with_the_tensorboard_names():
    rec = {"step": 4, "loss": 2.5, "lr": 0.01, "mfu": None, "grad_norm": float("nan"), "skipped": False,
           "eval_loss": 2.0, "peak_memory_bytes_per_rank": [10, 20], "memory_bytes": [1, 2],
           "compute_s": [0.5, 0.25], "comm_s": [0.1, 0.2], "idle_s": [0.0, 0.3], "slowest_rank": 0,
           "comm": {"all_reduce": {"calls": [1, 1], "bytes": [8, 8], "seconds": [0.1, 0.3]}}}
    got = sinks.scalars(rec)
    assert got == {"train/loss": 2.5, "train/lr": 0.01, "train/slowest_rank": 0, "eval/loss": 2.0,
                   "memory/peak_bytes/rank0": 10, "memory/peak_bytes/rank1": 20,
                   "memory/bytes/rank0": 1, "memory/bytes/rank1": 2,
                   "time/compute_s/rank0": 0.5, "time/compute_s/rank1": 0.25,
                   "time/comm_s/rank0": 0.1, "time/comm_s/rank1": 0.2,
                   "time/idle_s/rank0": 0.0, "time/idle_s/rank1": 0.3,
                   "comm/all_reduce/bytes": 16, "comm/all_reduce/seconds": 0.3}


# --- the launcher: exit 2 before anything is written --------------------------------------


def test_chipset_train_refuses_an_unknown_sink_before_writing_anything(tmp_path):
    run = tmp_path / "run"
    r = _train(run, "train.steps=3", "train.metrics_sinks=tensorboard,wandbb", env=_env())
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "unknown metrics sink 'wandbb' (did you mean 'wandb'?)" in r.stderr
    assert "Traceback" not in r.stderr
    assert not run.exists(), "refused only after the run directory was written: call check_metrics_sinks " \
                             "from cli/train.py's _preflight"


def test_chipset_train_refuses_a_sink_whose_package_is_missing(tmp_path):
    shadow = tmp_path / "shadow"  # a wandb that cannot be imported, ahead of any installed one
    (shadow / "wandb").mkdir(parents=True)
    (shadow / "wandb" / "__init__.py").write_text("raise ImportError(\"No module named 'wandb_core'\")\n")
    run = tmp_path / "run"
    r = _train(run, "train.steps=3", "train.metrics_sinks=wandb", env=_env(shadow))
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "the wandb sink needs the wandb package" in r.stderr
    assert "pip install 'chipset[wandb]' (or pip install wandb)" in r.stderr
    assert not run.exists(), "refused only after the run directory was written: call check_metrics_sinks " \
                             "from cli/train.py's _preflight"


# --- during the run ----------------------------------------------------------------------


def test_a_third_party_sink_gets_every_complete_record_and_a_broken_one_is_dropped_once(third_party, tmp_path):
    run = tmp_path / "run"
    r = _train(run, "train.steps=3", "train.eval_every=2", "train.metrics_sinks=bad_open,broken,recorder",
               env=_env(third_party))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    metrics = _metrics(run)
    assert [m["step"] for m in metrics] == [1, 2, 3]

    calls = [json.loads(line) for line in (run / "recorder.jsonl").read_text().splitlines()]
    assert [c["event"] for c in calls] == ["open", "log", "log", "log", "close"]
    assert calls[0]["run_dir"] == str(run) and calls[0]["steps"] == 3
    assert [c["step"] for c in calls[1:4]] == [1, 2, 3]
    # the very records of metrics.jsonl, evaluation included (added by the loop after end_step)
    assert [c["record"] for c in calls[1:4]] == metrics
    assert "eval_loss" in calls[2]["record"] and "eval_loss" in calls[3]["record"]

    broken = [json.loads(line)["event"] for line in (run / "broken.jsonl").read_text().splitlines()]
    assert broken == ["open", "log", "log", "close"]  # raised at step 2: no step 3; closed once
    warnings = [line for line in r.stderr.splitlines() if "metrics sink" in line]
    assert len(warnings) == 2, warnings
    assert ("metrics sink 'broken' failed in log() (RuntimeError: disk full at step 2) and is dropped for the rest "
            "of the run; training goes on") in warnings[1]
    assert "metrics sink 'bad_open' failed in open() (OSError: no route to host)" in warnings[0]
    assert not (run / "bad_open.jsonl").exists()


def test_sink_set_drops_a_sink_that_raises_in_close_with_one_warning(caplog):
    class Sink:
        closed = 0

        def open(self, run_dir, cfg):
            pass

        def log(self, step, record):
            pass

        def close(self):
            Sink.closed += 1
            raise ValueError("flush failed")

    s = sinks.SinkSet([("x", Sink())])
    with caplog.at_level(logging.WARNING, logger="chipset"):
        s.open(Path("."), _cfg("none"))
        s.log(1, {"step": 1})
        s.close()
        s.close()
    assert Sink.closed == 1
    assert caplog.text.count("metrics sink 'x' failed in close() (ValueError: flush failed)") == 1


# --- W&B and MLflow for real ---------------------------------------------------------------


def _wandb_history(wandb_dir: Path) -> tuple[list[dict], list[dict]]:
    """History and exit records of the latest offline run, read by wandb's own reader (`wandb leet inspect`)."""
    exe = shutil.which("wandb", path=str(Path(sys.executable).parent)) or "wandb"
    r = forked_cli.run([exe, "leet", "inspect", "--json", str(wandb_dir / "latest-run")],
                       capture_output=True, text=True, timeout=120, env=_env())
    assert r.returncode == 0, r.stderr[-2000:]
    records = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
    return ([x["history"] for x in records if x["type"] == "history"],
            [x["exit"] for x in records if x["type"] == "exit"])


def test_wandb_offline_and_mlflow_file_store_in_the_run_dir_read_back_with_their_own_readers(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'chipset[wandb]')")
    pytest.importorskip("mlflow", reason="mlflow is not installed (pip install 'chipset[mlflow]')")
    from mlflow.tracking import MlflowClient

    run = tmp_path / "run"
    r = _train(run, "train.steps=3", "train.eval_every=2", "train.metrics_sinks=wandb,mlflow", env=_env())
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    metrics = _metrics(run)
    assert not (run / "tensorboard").exists()  # named sinks replace auto's tensorboard

    history, exits = _wandb_history(run / "wandb")
    assert [h["step"]["num"] for h in history] == [1, 2, 3]
    assert [h["item"]["train/loss"] for h in history] == [m["loss"] for m in metrics]
    assert history[2]["item"]["eval/loss"] == metrics[2]["eval_loss"]
    assert exits and exits[-1]["exit_code"] == 0

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow >= 3.7 reads a file store only with it
    client = MlflowClient(tracking_uri=(run / "mlruns").as_uri())
    exp = client.get_experiment_by_name("chipset")
    (mlrun,) = client.search_runs([exp.experiment_id])
    assert mlrun.info.status == "FINISHED" and mlrun.info.run_name == "run"
    assert mlrun.data.tags["chipset.run_id"] == json.loads((run / "run.json").read_text())["run_id"]
    assert mlrun.data.params["train.steps"] == "3" and mlrun.data.params["train.metrics_sinks"] == "wandb,mlflow"
    loss = client.get_metric_history(mlrun.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in loss] == [(m["step"], m["loss"]) for m in metrics]
    assert [m.step for m in client.get_metric_history(mlrun.info.run_id, "eval/loss")] == [2, 3]

    # --resume with more steps goes on in the same MLflow run (its parameters cannot change: new ones only)
    r = _train(run, "train.steps=5", "train.eval_every=2", "train.metrics_sinks=wandb,mlflow", env=_env())
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    (mlrun,) = client.search_runs([exp.experiment_id])
    assert mlrun.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(mlrun.info.run_id, "train/loss")] == [1, 2, 3, 4, 5]
    history, _ = _wandb_history(run / "wandb")  # the resumed W&B run, same id, its own offline folder
    assert [h["step"]["num"] for h in history] == [4, 5]
    assert "metrics sink" not in r.stderr


def test_mlflow_sink_uses_the_users_tracking_uri_and_experiment(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="mlflow is not installed (pip install 'chipset[mlflow]')")
    from mlflow.tracking import MlflowClient

    store = tmp_path / "elsewhere"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "mine")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    s = sinks.MlflowSink()
    s.open(run_dir, _cfg("mlflow", steps=2))
    s.log(1, {"step": 1, "loss": 3.0})  # stops after step 1 of 2: KILLED, for --resume to go on
    s.close()
    assert not (run_dir / "mlruns").exists()
    client = MlflowClient(tracking_uri=store.as_uri())
    (mlrun,) = client.search_runs([client.get_experiment_by_name("mine").experiment_id])
    assert mlrun.info.status == "KILLED"
    assert [(m.step, m.value) for m in client.get_metric_history(mlrun.info.run_id, "train/loss")] == [(1, 3.0)]


def test_wandb_sink_is_offline_in_the_run_dir_unless_the_user_set_wandb_env(tmp_path, monkeypatch):
    calls = []

    class FakeRun:
        def log(self, data, step):
            calls.append(("log", step, data))

        def finish(self, exit_code):
            calls.append(("finish", exit_code))

    class FakeWandb:
        @staticmethod
        def init(**kw):
            calls.append(("init", kw))
            return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", FakeWandb)  # the sink's own logic, without the library
    for var in [v for v in os.environ if v.startswith("WANDB_")]:
        monkeypatch.delenv(var)
    run_dir = tmp_path / "myrun"
    (run_dir).mkdir()
    (run_dir / "run.json").write_text(json.dumps({"run_id": "20260101T000000Z-abcd1234"}))
    s = sinks.WandbSink()
    s.open(run_dir, _cfg("wandb", steps=1))
    s.log(1, {"step": 1, "loss": 2.0})
    s.close()
    kw = calls[0][1]
    assert kw["mode"] == "offline" and kw["dir"] == str(run_dir.resolve()) and kw["project"] == "chipset"
    assert kw["name"] == "myrun" and kw["id"] == "20260101T000000Z-abcd1234" and kw["resume"] == "allow"
    assert kw["config"]["train"]["steps"] == 1
    assert calls[1:] == [("log", 1, {"train/loss": 2.0}), ("finish", 0)]

    calls.clear()
    for var, value in (("WANDB_MODE", "online"), ("WANDB_DIR", str(tmp_path / "w")), ("WANDB_PROJECT", "p"),
                       ("WANDB_NAME", "n"), ("WANDB_RUN_ID", "r")):
        monkeypatch.setenv(var, value)
    s = sinks.WandbSink()
    s.open(run_dir, _cfg("wandb", steps=2))
    s.close()  # no step logged of 2: a failed run
    assert set(calls[0][1]) == {"config", "resume"}  # the user's settings stand
    assert calls[1] == ("finish", 1)
