"""Metrics sinks: where rank 0 sends each step's record besides ``RUN_DIR/metrics.jsonl``.

``train.metrics_sinks`` names them, comma-separated (docs/observability.md, "Metrics sinks"):
``tensorboard`` is built in; ``wandb`` and ``mlflow`` ship with chipset as entry points of the
``chipset.metrics_sinks`` group, the same way a third party's sink is found; ``auto`` (the
default) is tensorboard when ``torch.utils.tensorboard`` imports, ``none`` is metrics.jsonl only.

A sink is made by a factory (the entry point's object, called with no arguments) and is driven
through :class:`MetricsSink`: ``open(run_dir, cfg)`` once, ``log(step, record)`` per step,
``close()`` at the end, on rank 0 only. The factory imports the sink's library and raises
:class:`SinkUnavailable` with the install line when it is missing; the launcher calls
:func:`check_metrics_sinks` before anything is written, so an unknown name or a missing
package exits 2 there. A sink that raises during the run is logged once and dropped: training
goes on and metrics.jsonl has every step.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from chipset.errors import ConfigError

log = logging.getLogger(__name__)

__all__ = [
    "ENTRY_POINT_GROUP",
    "MetricsSink",
    "SinkUnavailable",
    "SinkSet",
    "TensorBoardSink",
    "WandbSink",
    "MlflowSink",
    "check_metrics_sinks",
    "open_sinks",
    "scalars",
    "sink_names",
]

ENTRY_POINT_GROUP = "chipset.metrics_sinks"
KEY = "train.metrics_sinks"


@runtime_checkable
class MetricsSink(Protocol):
    """What chipset calls on a sink, on rank 0 only, in this order.

    ``open(run_dir, cfg)``: once, before the first step (``cfg`` is the run's
    :class:`chipset.train.config.RunConfig`); ``log(step, record)``: once per step, ``step``
    1-based and ``record`` the step's ``metrics.jsonl`` object (read it, do not change it;
    :func:`scalars` flattens it to ``{"train/loss": ..., ...}``); ``close()``: once at the end,
    also when the run stops early. An exception from any of them drops the sink, with one
    warning.
    """

    def open(self, run_dir: Path, cfg: Any) -> None: ...

    def log(self, step: int, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class SinkUnavailable(ConfigError):
    """Raised by a sink factory whose package cannot be imported; the message says how to install it."""


# --- the record as scalars ------------------------------------------------------------

_PER_RANK = (("peak_memory_bytes_per_rank", "memory/peak_bytes"), ("memory_bytes", "memory/bytes"),
             ("compute_s", "time/compute_s"), ("comm_s", "time/comm_s"), ("idle_s", "time/idle_s"))


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not (isinstance(v, float) and math.isnan(v))


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A step record flattened to named scalars, the names every built-in sink uses.

    ``train/<key>`` for each number of the record (``loss``, ``grad_norm``, ``lr``,
    ``tokens_per_s``, ``mfu``, ...), ``eval/<name>`` for ``eval_<name>``,
    ``memory/{peak_bytes,bytes}/rank<r>``, ``time/{compute,comm,idle}_s/rank<r>`` and
    ``comm/<op>/bytes`` (summed over ranks) and ``comm/<op>/seconds`` (the slowest rank's).
    ``step`` is not one (it is the x axis); NaN and null values are left out.
    """
    out: dict[str, float] = {}
    for key, v in record.items():
        if key == "step" or not _number(v):
            continue
        out[f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}"] = v
    for key, tag in _PER_RANK:
        values = record.get(key)
        if isinstance(values, list):
            for r, v in enumerate(values):
                if _number(v):
                    out[f"{tag}/rank{r}"] = v
    comm = record.get("comm")
    if isinstance(comm, dict):
        for op, d in comm.items():
            if isinstance(d, dict) and d.get("bytes") and d.get("seconds"):
                out[f"comm/{op}/bytes"] = sum(d["bytes"])
                out[f"comm/{op}/seconds"] = max(d["seconds"])
    return out


def _config_items(cfg: Any) -> dict[str, Any]:
    """``{"train.steps": 20, ...}``: the run config flattened (parameters for W&B and MLflow)."""
    return {f"{section}.{k}": v for section, body in cfg.to_dict().items() for k, v in body.items()}


def _run_id(run_dir: Path) -> str | None:
    from chipset.train.rundir import read_run_id

    return read_run_id(run_dir)


# --- built-in sinks -------------------------------------------------------------------


class TensorBoardSink:
    """Event files in ``RUN_DIR/tensorboard`` (``torch.utils.tensorboard``; the tensorboard package)."""

    install = "pip install 'chipset[tensorboard]' (or pip install tensorboard)"

    def __init__(self) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except Exception as exc:  # torch raises ImportError, or another error from a broken install
            raise SinkUnavailable(f"the tensorboard sink needs the tensorboard package, which cannot be imported "
                                  f"here ({type(exc).__name__}: {exc}); install it: {self.install}") from None
        self._writer_class = SummaryWriter
        self._tb = None

    def open(self, run_dir: Path, cfg: Any) -> None:
        self._tb = self._writer_class(log_dir=str(Path(run_dir) / "tensorboard"))

    def log(self, step: int, record: dict[str, Any]) -> None:
        for tag, v in scalars(record).items():
            self._tb.add_scalar(tag, v, step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


class WandbSink:
    """A Weights & Biases run: offline in ``RUN_DIR/wandb`` unless ``WANDB_MODE``/``WANDB_DIR`` say otherwise.

    The W&B run id is chipset's run id (``RUN_DIR/run.json``), so a resumed run goes on in the
    same W&B run; project ``chipset`` and the run directory's name as the run name, unless
    ``WANDB_PROJECT``, ``WANDB_RUN_ID`` or ``WANDB_NAME`` are set. ``wandb sync RUN_DIR/wandb``
    uploads an offline run.
    """

    install = "pip install 'chipset[wandb]' (or pip install wandb)"

    def __init__(self) -> None:
        try:
            import wandb
        except Exception as exc:  # ImportError, or another error from a broken install
            raise SinkUnavailable(f"the wandb sink needs the wandb package, which cannot be imported here "
                                  f"({type(exc).__name__}: {exc}); install it: {self.install}") from None
        self._wandb = wandb
        self._run = None
        self._last = 0
        self._steps = 0

    def open(self, run_dir: Path, cfg: Any) -> None:
        run_dir = Path(run_dir).resolve()
        kw: dict[str, Any] = {"config": cfg.to_dict(), "resume": "allow"}
        if not os.environ.get("WANDB_MODE"):
            kw["mode"] = "offline"
        if not os.environ.get("WANDB_DIR"):
            kw["dir"] = str(run_dir)  # wandb writes its runs to DIR/wandb
        if not os.environ.get("WANDB_PROJECT"):
            kw["project"] = "chipset"
        if not os.environ.get("WANDB_NAME"):
            kw["name"] = run_dir.name
        run_id = _run_id(run_dir)
        if run_id and not os.environ.get("WANDB_RUN_ID"):
            kw["id"] = run_id
        self._steps = cfg.train.steps
        self._run = self._wandb.init(**kw)

    def log(self, step: int, record: dict[str, Any]) -> None:
        self._run.log(scalars(record), step=step)
        self._last = step

    def close(self) -> None:
        if self._run is not None:
            run, self._run = self._run, None
            run.finish(exit_code=0 if self._last >= self._steps else 1)


class MlflowSink:
    """An MLflow run: a file store in ``RUN_DIR/mlruns`` unless ``MLFLOW_TRACKING_URI`` is set.

    Experiment ``chipset`` (or ``MLFLOW_EXPERIMENT_NAME``); the run is named after the run
    directory and tagged ``chipset.run_id``, so a resumed run goes on in the same MLflow run;
    the run config is its parameters (``train.steps``, ...). Newer MLflow refuses a file store
    unless ``MLFLOW_ALLOW_FILE_STORE=true``, which this sink sets when it chose the file store.
    """

    install = "pip install 'chipset[mlflow]' (or pip install mlflow-skinny)"
    _BATCH = 1000  # metrics per log_batch call (MLflow's limit); params: 100

    def __init__(self) -> None:
        try:
            from mlflow.entities import Metric, Param
            from mlflow.tracking import MlflowClient
        except Exception as exc:  # ImportError, or another error from a broken install
            raise SinkUnavailable(f"the mlflow sink needs the mlflow package (mlflow or mlflow-skinny), which cannot "
                                  f"be imported here ({type(exc).__name__}: {exc}); install it: {self.install}") from None
        self._client_class, self._metric, self._param = MlflowClient, Metric, Param
        self._client = None
        self._run_id = ""
        self._last = 0
        self._steps = 0
        self._status = ""  # a resumed MLflow run's status before this launch

    def open(self, run_dir: Path, cfg: Any) -> None:
        run_dir = Path(run_dir).resolve()
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (run_dir / "mlruns").as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow >= 3.7 asks for the opt-in
        client = self._client_class(tracking_uri=uri)
        exp_id = os.environ.get("MLFLOW_EXPERIMENT_ID")
        if not exp_id:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "chipset"
            exp = client.get_experiment_by_name(name)
            exp_id = exp.experiment_id if exp is not None else client.create_experiment(name)
        chipset_id = _run_id(run_dir)
        run = None
        if chipset_id:  # a resumed run goes on in its MLflow run
            found = client.search_runs([exp_id], filter_string=f"tags.`chipset.run_id` = '{chipset_id}'",
                                       max_results=1)
            run = found[0] if found else None
        if run is None:
            tags = {"chipset.run_dir": str(run_dir), **({"chipset.run_id": chipset_id} if chipset_id else {})}
            run = client.create_run(exp_id, run_name=run_dir.name, tags=tags)
        else:
            self._status = run.info.status
            client.update_run(run.info.run_id, status="RUNNING")
        self._client, self._run_id, self._steps = client, run.info.run_id, cfg.train.steps
        # Parameters cannot change in MLflow: a resumed run (say with more train.steps) adds new ones only.
        known = run.data.params
        params = [self._param(k, str(v)[:6000]) for k, v in _config_items(cfg).items() if k not in known]
        for i in range(0, len(params), 100):
            client.log_batch(self._run_id, params=params[i:i + 100])

    def log(self, step: int, record: dict[str, Any]) -> None:
        now = int(time.time() * 1000)
        metrics = [self._metric(k, float(v), now, step) for k, v in scalars(record).items()]
        for i in range(0, len(metrics), self._BATCH):
            self._client.log_batch(self._run_id, metrics=metrics[i:i + self._BATCH])
        self._last = step

    def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            if self._last >= self._steps:
                status = "FINISHED"
            elif not self._last and self._status in ("FINISHED", "FAILED", "KILLED"):
                status = self._status  # a launch that ran no step (the run had finished) changes nothing
            else:
                status = "KILLED"  # stopped early; --resume goes on in this run
            client.set_terminated(self._run_id, status)


BUILTIN: dict[str, Callable[[], MetricsSink]] = {"tensorboard": TensorBoardSink}
"""Sinks found without entry points; an entry point of the same name is ignored."""

SHIPPED = {"wandb": WandbSink.install, "mlflow": MlflowSink.install}
"""Sinks chipset registers as its own entry points (pyproject.toml), with their install lines."""


# --- choosing sinks -------------------------------------------------------------------


def sink_names(text: str) -> list[str] | None:
    """``train.metrics_sinks`` -> the names it lists (``none``: []); None for ``auto``. ConfigError if malformed."""
    names = [n.strip() for n in (text or "").split(",")]
    names = list(dict.fromkeys(n for n in names if n))
    if names == ["auto"]:
        return None
    if not names or names == ["none"]:
        return []
    if "auto" in names or "none" in names:
        raise ConfigError(f"{KEY} = {text!r}: auto and none stand alone; list sink names instead, "
                          "e.g. \"tensorboard,wandb\"")
    return names


def _entry_points(name: str) -> list:
    import importlib_metadata

    eps = importlib_metadata.entry_points(group=ENTRY_POINT_GROUP, name=name)
    by_dist: dict[str, Any] = {}
    for ep in eps:  # one distribution found twice on the path is one registration
        dist = getattr(ep, "dist", None)
        by_dist.setdefault(dist.metadata["Name"] if dist is not None else ep.value, ep)
    return list(by_dist.items())


def _known_names() -> list[str]:
    import importlib_metadata

    return sorted({*BUILTIN, *(ep.name for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP))})


def _make(name: str) -> MetricsSink:
    """The sink ``name`` names, made but not opened. ConfigError (exit 2) says why it cannot be had."""
    if name in BUILTIN:
        try:
            return BUILTIN[name]()
        except ConfigError as exc:  # SinkUnavailable: not installed here
            raise ConfigError(f"{KEY}: {exc}") from None
    found = _entry_points(name)
    if not found:
        known = _known_names()
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        missing = (f"; chipset registers {name!r} as an entry point of its own distribution, whose metadata here "
                   f"lacks it: reinstall chipset (pip install -e . in a checkout), then {SHIPPED[name]}"
                   if name in SHIPPED else "")
        raise ConfigError(f"{KEY}: unknown metrics sink {name!r}{hint}; available: {', '.join(known) or 'none'} "
                          f"(built in, or {ENTRY_POINT_GROUP} entry points){missing}")
    if len(found) > 1:
        raise ConfigError(f"{KEY}: metrics sink {name!r} is registered by several distributions "
                          f"({', '.join(d for d, _ in found)}); uninstall all but one")
    dist, ep = found[0]
    where = f"metrics sink {name!r} ({ep.name} = {ep.value}, distribution {dist})"
    try:
        factory = ep.load()
        sink = factory() if callable(factory) else factory
    except ConfigError as exc:  # SinkUnavailable: the factory's own install line
        raise ConfigError(f"{KEY}: {exc}") from None
    except ImportError as exc:
        raise ConfigError(f"{KEY}: {where} cannot be loaded: {type(exc).__name__}: {exc}; install what it needs "
                          f"(pip install --force-reinstall '{dist}' brings its dependencies back)") from None
    except Exception as exc:  # noqa: BLE001 - a third party's factory: report it, do not crash
        raise ConfigError(f"{KEY}: {where}: its factory failed ({type(exc).__name__}: {exc})") from None
    if not isinstance(sink, MetricsSink):
        raise ConfigError(f"{KEY}: {where} made a {type(sink).__name__}, which is not a metrics sink: expected "
                          "an object with open(run_dir, cfg), log(step, record) and close() (chipset.train.sinks)")
    return sink


def _make_all(text: str) -> list[tuple[str, MetricsSink]]:
    names = sink_names(text)
    if names is None:  # auto: tensorboard when it imports; otherwise the note below (rank 0 logs it)
        try:
            return [("tensorboard", TensorBoardSink())]
        except SinkUnavailable:
            log.warning("TensorBoard event files not written (pip install 'chipset[tensorboard]' to get them in "
                        "RUN_DIR/tensorboard)")
            return []
    made, problems = [], []
    for name in names:
        try:
            made.append((name, _make(name)))
        except ConfigError as exc:
            problems.append(str(exc))
    if problems:
        raise ConfigError("\n".join(problems))
    return made


def check_metrics_sinks(cfg: Any) -> None:
    """Launcher preflight: every sink ``train.metrics_sinks`` names can be made here, or ConfigError (exit 2).

    Names each unknown sink (with the ones installed) and each one whose package is missing
    (with its install line), before the run directory is written. Makes the sinks (which
    imports their libraries) but opens none.
    """
    if sink_names(cfg.train.metrics_sinks) is None:
        return  # auto never fails: no tensorboard is a note in the run
    try:
        _make_all(cfg.train.metrics_sinks)
    except ConfigError as exc:
        raise ConfigError(f"{exc}\nNothing was written; fix {KEY} (docs/observability.md, \"Metrics sinks\") "
                          "and run the command again.") from None


class SinkSet:
    """The open sinks of a run; one that raises is logged once and dropped."""

    def __init__(self, sinks: list[tuple[str, MetricsSink]]) -> None:
        self.sinks = list(sinks)

    def __bool__(self) -> bool:
        return bool(self.sinks)

    def _call(self, name: str, sink: MetricsSink, what: str, fn: Callable[[], Any]) -> bool:
        try:
            fn()
            return True
        except Exception as exc:  # noqa: BLE001 - a sink must never stop training
            log.warning("metrics sink %r failed in %s (%s: %s) and is dropped for the rest of the run; training "
                        "goes on and metrics.jsonl has every step", name, what, type(exc).__name__, exc)
            if what != "close()":
                try:
                    sink.close()
                except Exception:  # noqa: BLE001
                    log.debug("metrics sink %r: close() after the failure raised too", name, exc_info=True)
            return False

    def open(self, run_dir: Path, cfg: Any) -> None:
        self.sinks = [(n, s) for n, s in self.sinks if self._call(n, s, "open()", lambda s=s: s.open(run_dir, cfg))]

    def log(self, step: int, record: dict[str, Any]) -> None:
        self.sinks = [(n, s) for n, s in self.sinks if self._call(n, s, "log()", lambda s=s: s.log(step, record))]

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []
        for n, s in sinks:
            self._call(n, s, "close()", s.close)


def open_sinks(cfg: Any, run_dir: Path) -> SinkSet:
    """Make and open the sinks of ``cfg`` for ``run_dir`` (rank 0). ConfigError for a name the
    launcher's :func:`check_metrics_sinks` would have refused; a sink whose ``open`` raises is dropped."""
    sinks = SinkSet(_make_all(cfg.train.metrics_sinks))
    sinks.open(Path(run_dir), cfg)
    return sinks
