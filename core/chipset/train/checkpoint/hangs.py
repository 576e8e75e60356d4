"""Hang diagnosis: each rank's recent collectives on a failure, and who never arrived.

When a collective fails (a timeout, or a peer that vanished), the worker writes
``RUN_DIR/hangs/rank<r>.json``: the error and the rank's last collectives from
:attr:`chipset.interfaces.Collective.recent_ops` (op, group, per-group sequence number,
bytes, time, state). After the job ends non-zero the launcher calls :func:`diagnose`:
for every collective some rank timed out in, it lists the ranks of that group whose log
never reached that sequence number, or who wrote no log at all (killed, or still stuck).

Backends with a native flight recorder (NCCL's, HCCL's) turn it on in their
launch environment, dumping into ``RUN_DIR/hangs/flight`` on a watchdog timeout; the report
then also names, per dump, the rank and the last collective its library recorded.
"""

from __future__ import annotations

import json
import os
import pickle
import time
from pathlib import Path

from chipset.errors import CollectiveTimeoutError

__all__ = ["HANGS", "write_rank_log", "diagnose", "flight_dir", "read_flight_dumps"]

HANGS = "hangs"


def flight_dir(run_dir: str | Path) -> Path:
    """Where native flight recorders dump (``chipset.interfaces.collective.FLIGHT_RECORDER_ENV``)."""
    return Path(run_dir) / HANGS / "flight"


class _PlainUnpickler(pickle.Unpickler):
    """A flight-recorder dump is a pickle; only plain containers and scalars are accepted from
    it, so a foreign file in the run directory cannot run code when the report reads it."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a flight-recorder dump")


def read_flight_dumps(run_dir: str | Path) -> list[dict]:
    """``[{"file", "rank", "entries", "last"}]`` for every dump in :func:`flight_dir` (``last``:
    the newest entry's name, sequence id and state, as the library wrote them); unreadable
    dumps are listed with their reason instead."""
    out = []
    d = flight_dir(run_dir)
    for f in sorted(d.iterdir()) if d.is_dir() else []:
        if not f.is_file():
            continue
        rank = f.name.rsplit("_", 1)[-1]
        item = {"file": f.name, "rank": int(rank) if rank.isdigit() else None}
        try:
            with f.open("rb") as fh:
                body = _PlainUnpickler(fh).load()
            entries = body.get("entries", []) if isinstance(body, dict) else []
            item["entries"] = len(entries)
            last = entries[-1] if entries and isinstance(entries[-1], dict) else {}
            item["last"] = {k: last.get(k) for k in ("profiling_name", "collective_seq_id", "state")}
        except Exception as exc:  # noqa: BLE001 - a report must not fail on a bad dump
            item["error"] = f"{type(exc).__name__}: {exc}"
        out.append(item)
    return out


def write_rank_log(run_dir: str | Path, collective, exc: BaseException) -> Path | None:
    """Write this rank's recent collectives and ``exc`` to ``RUN_DIR/hangs/rank<r>.json`` (never raises)."""
    try:
        rank = int(os.environ.get("RANK", "0") or 0)
        d = Path(run_dir) / HANGS
        d.mkdir(parents=True, exist_ok=True)
        ops = [dict(e, ranks=list(e["ranks"])) for e in list(collective.recent_ops)]
        body = {"rank": rank, "pid": os.getpid(), "time": time.time(), "timeout": isinstance(exc, CollectiveTimeoutError),
                "error": str(exc), "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
                "recent_ops": ops}
        path = d / f"rank{rank}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body, indent=1) + "\n")
        os.replace(tmp, path)
        return path
    except Exception:  # diagnosis must never mask the original error
        return None


def _stuck_op(log: dict) -> dict | None:
    ops = log.get("recent_ops") or []
    for e in reversed(ops):
        if e.get("state") != "done":
            return e
    return ops[-1] if ops else None


def diagnose(run_dir: str | Path) -> dict | None:
    """``{"collectives": [...], "lines": [...]}`` from the rank logs of ``run_dir``, or None if there are none."""
    d = Path(run_dir) / HANGS
    logs = {}
    for f in sorted(d.glob("rank*.json")) if d.is_dir() else []:
        try:
            body = json.loads(f.read_text())
            logs[int(body["rank"])] = body
        except (OSError, ValueError, KeyError, TypeError):
            continue
    if not logs and not read_flight_dumps(run_dir):
        return None
    stuck: dict[tuple[str, int, str], dict] = {}
    for rank, log in sorted(logs.items()):
        if not log.get("timeout"):
            continue
        e = _stuck_op(log)
        if e is None:
            continue
        key = (e["group"], int(e["seq"]), e["op"])
        item = stuck.setdefault(key, {"op": e["op"], "group": e["group"], "seq": int(e["seq"]),
                                      "ranks": list(e["ranks"]), "waiting": [], "missing": []})
        item["waiting"].append(rank)
    lines = []
    for item in stuck.values():
        for r in item["ranks"]:
            if r in item["waiting"]:
                continue
            log = logs.get(r)
            seen = [e for e in (log or {}).get("recent_ops", []) if e["group"] == item["group"]]
            last = max(seen, key=lambda e: e["seq"]) if seen else None
            if log is None:
                item["missing"].append({"rank": r, "why": "wrote no log (killed, or still stuck outside a collective)"})
            elif last is None or last["seq"] < item["seq"]:
                where = f"its last op on {item['group']} was {last['op']} #{last['seq']}" if last else \
                    f"no op on {item['group']} in its recent log"
                item["missing"].append({"rank": r, "why": f"never entered it; {where}; its error: "
                                        + log.get("error", "").splitlines()[0][:200]})
        missing = ", ".join(str(m["rank"]) for m in item["missing"]) or "none (every rank entered it)"
        lines.append(f"collective {item['op']} #{item['seq']} on group {item['group']} (ranks {item['ranks']}): "
                     f"rank(s) {item['waiting']} timed out waiting; rank(s) that did not arrive: {missing}")
        lines += [f"  rank {m['rank']}: {m['why']}" for m in item["missing"]]
    # A rank in the job that wrote no log died without raising (SIGKILL, a crash): it failed first,
    # and the ranks that did write one only lost it.
    world = {int(r) for log in logs.values() for e in log.get("recent_ops") or [] for r in e.get("ranks", [])}
    died = sorted(world - set(logs))
    if not stuck and logs:
        if died:
            lines.append(f"rank(s) {', '.join(map(str, died))} died without reporting an error (killed by a "
                         "signal or crashed; see its output above): the first failure")
        lines.append(("then " if died else "no rank reported a collective timeout; ") + "failing ranks: "
                     + ", ".join(f"{r} ({(logs[r].get('error') or '?').splitlines()[0][:160]})" for r in sorted(logs)))
    flight = read_flight_dumps(run_dir)
    for item in flight:
        who = f"rank {item['rank']}" if item["rank"] is not None else item["file"]
        if "error" in item:
            lines.append(f"flight recorder dump {item['file']}: unreadable ({item['error']})")
        elif item["entries"]:
            last = item["last"]
            lines.append(f"flight recorder ({who}, {item['file']}): {item['entries']} recorded collectives, the last "
                         f"{last['profiling_name']} #{last['collective_seq_id']} in state {last['state']}")
    report = {"collectives": list(stuck.values()), "died": died, "flight": flight, "lines": lines}
    (d / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report
