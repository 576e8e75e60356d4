"""Saving and resuming one training run: :class:`Checkpointer`.

Used by :func:`chipset.train.loop.train`: ``start = ckpt.resume(mode)`` before the
first step, ``ckpt.save(step)`` every ``train.checkpoint_every`` steps and after the last, ``ckpt.finish()``
at the end (waits for an asynchronous save). Every rank calls every method (they are
collective).

Contents of a checkpoint: every parameter and the optimizer state (fp32 masters, Adam
moments) under logical full-tensor names (:mod:`.layout`), every rank's device and
host RNG state (``rng.device.rank<r>``, ``rng.host.rank<r>``), and ``state.json``:
optimizer step count, loss-scaler state, data position, the resolved config and the
parameters' shapes.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from chipset.errors import ChipsetError, ConfigError
from chipset.train.checkpoint import store
from chipset.train.checkpoint.layout import (
    engine_pieces,
    host_boxes,
    kinds,
    logical_shapes,
    read_planner,
    write_planner,
)
from chipset.train.resume_check import check_compatible
from chipset.train.rundir import atomic_write_text, disk_full, ensure_run_id, find_enospc

if TYPE_CHECKING:
    from chipset.loader import Backend

__all__ = ["Checkpointer", "shape_mismatches", "resolve_resume"]

log = logging.getLogger(__name__)

_PATH_BYTES = 4096


def shape_mismatches(saved: dict[str, tuple[int, ...]], mine: dict[str, tuple[int, ...]]) -> list[str]:
    """Human-readable differences between a checkpoint's parameter shapes and this model's."""
    out = []
    for n in sorted(set(saved) | set(mine)):
        if n not in saved:
            out.append(f"{n}: missing from the checkpoint (this model has {tuple(mine[n])})")
        elif n not in mine:
            out.append(f"{n}: in the checkpoint {tuple(saved[n])}, not in this model")
        elif tuple(saved[n]) != tuple(mine[n]):
            out.append(f"{n}: checkpoint {tuple(saved[n])}, this model {tuple(mine[n])}")
    return out


def refuse_shapes(path: Path, problems: list[str]) -> ConfigError:
    shown = problems[:12] + ([f"... and {len(problems) - 12} more"] if len(problems) > 12 else [])
    return ConfigError(
        f"checkpoint {path} was written for a different model shape; {len(problems)} parameter(s) differ:\n"
        + "\n".join(f"  - {p}" for p in shown)
        + "\nUse the [model] config it was trained with (its state.json holds it), or --resume none to start fresh."
    )


def resolve_resume(run_dir: Path, mode: str, run_id: str | None = None) -> tuple[Path | None, list[tuple[Path, str]]]:
    """Which checkpoint ``mode`` (``auto``, ``none`` or a path) selects; and newer ones skipped.

    ``auto`` considers only run ``run_id``'s checkpoints when given (an earlier run's in the
    same directory never take over). A path may name a checkpoint folder or a run directory
    (its newest complete one). An explicit path that is incomplete or corrupt is a
    ConfigError, not a silent skip.
    """
    if mode == "none":
        return None, []
    if mode == "auto":
        chosen, skipped = store.select(run_dir, run_id)
        return (chosen.path if chosen else None), skipped
    p = Path(mode)
    if (p / store.MANIFEST).exists() or store._STEP_RE.match(p.name):
        why = store.verify(p)
        if why is not None:
            raise ConfigError(f"--resume {mode}: not a usable checkpoint: {why}. Pick another (ls {p.parent}) "
                              "or use --resume auto")
        return p, []
    if (p / store.CHECKPOINTS).is_dir():
        chosen, skipped = store.select(p)
        if chosen is None:
            raise ConfigError(f"--resume {mode}: the run directory has no complete checkpoint "
                              f"({'; '.join(f'{s.name}: {w}' for s, w in skipped) or 'none written'})")
        return chosen.path, skipped
    raise ConfigError(f"--resume {mode}: no checkpoint there (expected a checkpoints/step-N folder with "
                      f"{store.MANIFEST}, or a run directory holding checkpoints/); or use auto / none")


def _unpickling(exc: BaseException | None, depth: int = 0) -> bool:
    """Whether ``exc`` (or what it wraps) is torch.load refusing the bytes it was given."""
    if exc is None or depth > 8:
        return False
    if isinstance(exc, pickle.UnpicklingError) or "weights_only" in str(exc):
        return True
    inner = list(getattr(exc, "failures", {}).values()) if isinstance(getattr(exc, "failures", None), dict) else []
    inner = [x[0] if isinstance(x, tuple) else x for x in inner]
    return any(_unpickling(x, depth + 1) for x in [exc.__cause__, exc.__context__, *inner]
               if isinstance(x, BaseException))


def _foreign_shard(path: Path, state: dict) -> ConfigError:
    """A shard whose bytes are not the tensors ``.metadata`` records: say so, without torch's advice
    to load it unsafely (that advice would run code from the file)."""
    shards = sorted(p.name for p in path.glob("*.distcp"))
    return ConfigError(
        f"checkpoint {path}: shard file(s) {', '.join(shards) or '(none)'} do not hold the tensors its .metadata "
        f"records (expected the layout {state.get('layout')} in {state.get('dtype')} at world size "
        f"{state.get('world_size')}; found bytes that do not decode as those tensors). A shard was replaced by "
        "one from another save (another layout, dtype or run). Restore this checkpoint's own files, resume "
        "another checkpoint with --resume PATH, or start fresh with --resume none.")


class Checkpointer:
    """Checkpoints of one run directory for one engine; collective: every rank calls each method."""

    def __init__(self, cfg, backend: Backend, engine, run_dir: str | Path, *, out=None):
        self.cfg = cfg
        self.backend = backend
        self.engine = engine
        self.col = backend.collective
        self.rank = self.col.rank()
        self.world = self.col.world_size()
        self.run_dir = Path(run_dir)
        self.out = out or sys.stdout
        tr = cfg.train
        self.every = tr.checkpoint_every
        self.keep = tr.keep_checkpoints
        self.async_save = tr.async_checkpoint
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.islands = None
        """The run's :class:`chipset.train.islands.outer.Islands`, whose outer step count is saved and restored."""
        self.saved: list[int] = []
        self.save_seconds: list[float] = []
        """Seconds each save blocked training (staging only when asynchronous)."""
        self.run_id = None
        if self.rank == 0:  # only rank 0 selects, commits and prunes
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.run_id = ensure_run_id(self.run_dir)
        self.info: dict = {"restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
                           "resumed_from": None, "resumed_step": 0, "skipped_checkpoints": []}
        # Asynchronous saves talk over their own group so they never interleave with training's.
        self._group = None
        if self.async_save and self.world > 1:
            self._group = self.col.new_group(range(self.world), name="checkpoint")

    # --- resume -------------------------------------------------------------------------
    def resume(self, mode: str = "auto") -> int:
        """Load the checkpoint ``mode`` selects (see :func:`resolve_resume`); returns the step to start at."""
        path = None
        if self.rank == 0:
            store.remove_partials(self.run_dir)
            try:
                path, skipped = None, []
                if self.info["restarts"] > 0:  # a restarted job continues from this run's own checkpoints
                    path, skipped = resolve_resume(self.run_dir, "auto", self.run_id)
                if path is None:
                    path, skipped = resolve_resume(self.run_dir, mode, self.run_id)
            except ConfigError as exc:
                path, skipped = None, []
                self._share_path(f"!{exc}")
                raise
            for p, why in skipped:
                log.warning("skipping checkpoint %s: %s; using an older checkpoint", p, why)
            self.info["skipped_checkpoints"] = [{"path": str(p), "reason": why} for p, why in skipped]
            self._share_path(str(path) if path else "")
        else:
            got = self._share_path(None)
            if got.startswith("!"):
                raise ConfigError(got[1:])
            path = Path(got) if got else None
        if path is None:
            return 0
        step = self.load(Path(path))
        self.info["resumed_from"] = str(path)
        self.info["resumed_step"] = step
        if self.rank == 0:
            self._trim_metrics(step)
            print(f"chipset checkpoint: resumed from {path} (step {step})"
                  + (f" after restart {self.info['restarts']}" if self.info["restarts"] else ""), file=self.out, flush=True)
        return step

    def _share_path(self, text: str | None) -> str:
        """Rank 0's choice to every rank (a fixed-size byte tensor broadcast)."""
        if self.world == 1:
            return text or ""
        buf = torch.zeros(_PATH_BYTES, dtype=torch.uint8, device=self.engine.device)
        if text is not None:
            raw = text.encode()[:_PATH_BYTES]
            buf[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        self.col.broadcast(buf, 0)
        return bytes(buf.cpu().tolist()).rstrip(b"\0").decode()

    def _trim_metrics(self, step: int) -> None:
        """Keep the records of steps <= ``step``; drop a torn line (a crash mid-write) with a warning."""
        f = self.run_dir / "metrics.jsonl"
        if not f.exists():
            return
        keep = []
        for i, ln in enumerate(f.read_text(errors="replace").splitlines(), 1):
            if not ln.strip():
                continue
            try:
                rec = json.loads(ln)
                s = int(rec.get("step", 0))
            except (ValueError, TypeError, AttributeError):
                log.warning("%s line %d is not a complete JSON record (a write cut short); dropped", f, i)
                continue
            if s <= step:
                keep.append(ln)
        atomic_write_text(f, "".join(ln + "\n" for ln in keep))

    def load(self, path: Path) -> int:
        """Load ``path`` into the engine under its current layout (reshards); returns the saved step."""
        import torch.distributed.checkpoint as dcp

        e = self.engine
        state = json.loads((path / store.STATE).read_text())
        check_compatible(path, state.get("config"), self.cfg.to_dict())
        reader = store.safe_reader(path)
        try:
            md = reader.read_metadata()
        except pickle.UnpicklingError as exc:  # a crafted or foreign .metadata: refuse, run nothing
            raise ConfigError(f"checkpoint {path} is refused: {exc}. Resume from a checkpoint this "
                              "run wrote, or start fresh with --resume none.") from None
        saved = {k.removeprefix("model."): tuple(v.size) for k, v in md.state_dict_metadata.items()
                 if k.startswith("model.")}
        problems = shape_mismatches(saved, logical_shapes(e))
        if problems:
            raise refuse_shapes(path, problems)
        alias = all(b.master_aliases_params for b in e.buckets)
        chunks, copies = {}, []
        have = {k.split(".")[0] + "." + k.split(".")[1] for k in md.state_dict_metadata if k.startswith("outer.")}
        missing_outer = set()
        for kind in kinds(e):
            if kind == "model" and alias:
                continue  # the parameters are their own fp32 masters: load optim.master into them
            if kind.startswith("outer.") and kind not in have:
                missing_outer.add(kind)  # written without islands (or another wire format / overlap): rebuilt below
                continue
            for name, _, pieces in engine_pieces(e, kind, for_load=True):
                for piece in pieces:
                    # Host staging initialised from the device: tp padding keeps its (zero) value.
                    host = piece.tensor.detach().to("cpu", copy=True)
                    chunks.setdefault(f"{kind}.{name}", []).extend(
                        (b.offsets, b.sizes, b.view(host)) for b in piece.boxes)
                    copies.append((piece, host))
        rng = {}
        for what in ("device", "host"):
            key = f"rng.{what}.rank{self.rank}"
            if key in md.state_dict_metadata:
                size = list(md.state_dict_metadata[key].size)
                rng[what] = torch.empty(size, dtype=torch.uint8)
                chunks[key] = [([0] * len(size), size, rng[what])]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                dcp.load({}, storage_reader=reader, planner=read_planner(chunks))
            except BaseException as exc:  # torch's CheckpointException is a BaseException
                if _unpickling(exc):
                    raise _foreign_shard(path, state) from None
                raise
        with torch.no_grad():
            for piece, host in copies:
                piece.tensor.copy_(host.reshape(-1))
            for b in e.buckets:  # int8 state loaded into float32 staging: quantise it (runtime/int8_state.py)
                for t in b.state.values():
                    if not isinstance(t, torch.Tensor):
                        t.commit_staged()
        e.step_count = int(state["engine_step"])
        e.scaler.load_state_dict(state["scaler"])
        if self.islands is not None:
            self.islands.load_state(state.get("islands"))
            if "outer.global" in missing_outer:
                self.islands.reset_global()
        if "device" in rng:
            self.backend.device.set_rng_state(rng["device"])
        if "host" in rng:
            torch.set_rng_state(rng["host"])
        if state.get("world_size") != self.world or state.get("layout") != e.dims.layout():
            self.info["resharded"] = {"from": {"world_size": state.get("world_size"), "layout": state.get("layout")},
                                      "to": {"world_size": self.world, "layout": e.dims.layout()}}
        return int(state["step"])

    # --- save ---------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        """Whether a checkpoint is due after ``step`` completed steps.

        Also after the last step: a finished run can then be extended (raise ``train.steps``) and
        a rerun of its command is recognised as finished instead of training again.
        """
        return self.every > 0 and (step % self.every == 0 or step == self.cfg.train.steps)

    def save(self, step: int) -> None:
        """Checkpoint the state after ``step`` completed steps (returns early when asynchronous)."""
        self.finish()
        if self.islands is not None:
            self.islands.settle()  # islands.overlap = "delayed": the exchange in flight ends; its average is kept
        t0 = time.perf_counter()
        e = self.engine
        tensors = {}  # staged to host now: an asynchronous save must not see later steps
        with torch.no_grad():
            for kind in kinds(e):
                for name, shape, pieces in engine_pieces(e, kind, for_load=False):
                    dtype = e.dtype if kind == "model" else torch.float32
                    tensors[f"{kind}.{name}"] = (shape, dtype, host_boxes(pieces, dtype))
        sd = {}
        sd[f"rng.device.rank{self.rank}"] = self.backend.device.get_rng_state().cpu().clone()
        sd[f"rng.host.rank{self.rank}"] = torch.get_rng_state().clone()
        tr = self.cfg.train
        state = {
            "step": step, "engine_step": e.step_count, "scaler": e.scaler.state_dict(),
            "data": {"next_step": step, "next_sequence": step * tr.global_batch, "global_batch": tr.global_batch,
                     "seq_len": tr.seq_len, "source": self.cfg.data.source, "seed": self.cfg.data.seed},
            "config": self.cfg.to_dict(), "world_size": self.world, "layout": e.dims.layout(),
            "shapes": {n: list(s) for n, s in logical_shapes(e).items()}, "backend": self.backend.name,
            "dtype": str(e.dtype).removeprefix("torch."), "run_id": self.run_id,
            **({"islands": self.islands.state()} if self.islands is not None else {}),
        }
        tmp = self.run_dir / store.CHECKPOINTS / f".tmp-step-{step:08d}"
        final = store.checkpoint_dir(self.run_dir, step)
        if self.async_save:
            self._thread = threading.Thread(target=self._write_guarded, args=(sd, tensors, state, tmp, final, step),
                                            name=f"chipset-checkpoint-{step}", daemon=True)
            self._thread.start()
        else:
            try:
                self._write(sd, tensors, state, tmp, final, step)
            except BaseException as exc:  # torch's CheckpointException is a BaseException
                nospace = find_enospc(exc)
                if nospace is not None:
                    raise disk_full(tmp, nospace) from exc
                raise
        self.save_seconds.append(time.perf_counter() - t0)

    def _write_guarded(self, *args) -> None:
        try:
            self._write(*args)
        except BaseException as exc:  # re-raised on the training thread by finish()
            self._error = exc

    def _write(self, sd: dict, tensors: dict, state: dict, tmp: Path, final: Path, step: int) -> None:
        """Write ``sd`` (plain tensors) and ``tensors`` (this rank's boxes, :func:`.layout.write_planner`)."""
        import torch.distributed.checkpoint as dcp

        tmp.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            (tmp / store.STATE).write_text(json.dumps(state, indent=1) + "\n")
        pg = self._group.pg if self._group is not None else None
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp)), planner=write_planner(tensors), process_group=pg)
        # Each rank checksums its own files; rank 0 adds the shared ones and commits.
        mine = sorted(p.name for p in tmp.glob(f"__{self.rank}_*"))
        if self.rank == 0:
            mine += [".metadata", store.STATE]
        (tmp / f".sums-{self.rank}.json").write_text(json.dumps(store.hash_files(tmp, mine)))
        if self.world > 1:
            self.col.barrier(self._group)
        if self.rank != 0:
            return
        sums = {}
        for r in range(self.world):
            f = tmp / f".sums-{r}.json"
            sums.update(json.loads(f.read_text()))
            f.unlink()
        store.commit(tmp, final, step, sums, {"world_size": self.world, "layout": state["layout"],
                                              "run_id": self.run_id})
        self.saved.append(step)
        for p in store.prune(self.run_dir, self.keep, self.run_id):
            print(f"chipset checkpoint: removed {p} (train.keep_checkpoints = {self.keep})", file=self.out, flush=True)
        print(f"chipset checkpoint: saved {final}", file=self.out, flush=True)

    def finish(self) -> None:
        """Wait for an asynchronous save; re-raise its error here, on the training thread."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            if isinstance(err, ChipsetError):
                raise err
            nospace = find_enospc(err)
            if nospace is not None:
                raise disk_full(self.run_dir / store.CHECKPOINTS, nospace) from err
            raise ChipsetError(f"asynchronous checkpoint save failed: {type(err).__name__}: {err}") from err

    def summary(self) -> dict:
        """What ``summary.json`` records about checkpoints, resumes and restarts."""
        out = dict(self.info)
        out["checkpoints_saved"] = list(self.saved) if self.rank == 0 else None
        out["checkpoint_blocking_s"] = [round(s, 4) for s in self.save_seconds]
        return out
