"""A chipset checkpoint (any layout) to a Hugging Face directory or one torch state-dict file.

Checkpoints store every parameter under its logical, single-process name and shape
(:mod:`chipset.train.checkpoint.layout`), whatever layout wrote them, so export needs no
ranks: DCP reads the logical tensors in this one process (``no_dist``), a shard's worth
at a time, from the fp32 masters. The output is written into a temporary sibling folder
and renamed into place, so a failed export leaves nothing behind.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch

from chipset.errors import ConfigError
from chipset.models.hf.config import SUPPORTED_ARCHITECTURES, to_hf_config
from chipset.models.hf.names import expert_names, to_hf
from chipset.train.config import RunConfig

__all__ = ["FORMATS", "export", "find_checkpoint"]

log = logging.getLogger(__name__)

FORMATS = ("hf", "torch")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def find_checkpoint(run_dir: Path, step: int | None) -> Path:
    """The complete checkpoint of ``run_dir`` at ``step`` (None: the newest); ConfigError if none."""
    from chipset.train.checkpoint import store

    if step is None:
        chosen, skipped = store.select(run_dir)
        if chosen is None:
            why = "; ".join(f"{p.name}: {w}" for p, w in skipped) or "none written"
            raise ConfigError(f"{run_dir}: no complete checkpoint to export ({why}); train with "
                              "train.checkpoint_every > 0 (docs/fault-tolerance.md)")
        return chosen.path
    path = store.checkpoint_dir(run_dir, step)
    why = store.verify(path) if path.is_dir() else "no such checkpoint"
    if why is not None:
        have = ", ".join(str(c.step) for c in store.list_checkpoints(run_dir)) or "none"
        raise ConfigError(f"--step {step}: {path}: {why}; steps with checkpoints: {have}")
    return path


def _read(reader, keys: dict[str, tuple[list[int], torch.Tensor]]) -> None:
    """Fill each tensor of ``keys`` (checkpoint key -> (shape, target)) from the checkpoint, in this process."""
    import torch.distributed.checkpoint as dcp

    from chipset.train.checkpoint.layout import read_planner

    chunks = {k: [([0] * len(shape), list(shape), t)] for k, (shape, t) in keys.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({}, storage_reader=reader, planner=read_planner(chunks), no_dist=True)


def _groups(shapes: dict[str, list[int]], max_bytes: int, esize: int) -> list[list[str]]:
    """Parameter names in order, cut into output files of at most ``max_bytes`` (one tensor may exceed it)."""
    out, cur, size = [], [], 0
    for name, shape in shapes.items():
        n = esize
        for d in shape:
            n *= d
        if cur and size + n > max_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(name)
        size += n
    return out + ([cur] if cur else [])


def export(run_dir: str | Path, out: str | Path, *, step: int | None = None, fmt: str = "hf",
           dtype: str = "float32", max_shard_mb: float = 2048.0) -> Path:
    """Write checkpoint ``step`` of ``run_dir`` to the new folder ``out``; returns the checkpoint used."""
    from chipset.train.checkpoint import store

    run_dir, out = Path(run_dir), Path(out)
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out}: exists and is not an empty folder; chipset export never overwrites, "
                          "choose a new path")
    ckpt = find_checkpoint(run_dir, step)
    state = json.loads((ckpt / store.STATE).read_text())
    cfg = RunConfig.from_dict(state["config"], where=str(ckpt / store.STATE))
    shapes = {n: list(s) for n, s in state["shapes"].items()}
    hf_cfg = None
    if fmt == "hf":
        try:
            hf_cfg = to_hf_config(cfg.model)
        except ValueError as exc:
            raise ConfigError(f"cannot export {ckpt} as a Hugging Face model: {exc}") from None
        hf_cfg["torch_dtype"] = dtype
    reader = store.safe_reader(ckpt)
    md = reader.read_metadata().state_dict_metadata
    kind = "optim.master" if all(f"optim.master.{n}" in md for n in shapes) else "model"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        if fmt == "hf":
            family = SUPPORTED_ARCHITECTURES[hf_cfg["architectures"][0]]
            _write_hf(reader, kind, shapes, hf_cfg, tmp, DTYPES[dtype], int(max_shard_mb * 2**20), family)
        else:
            _write_torch(reader, kind, shapes, cfg, tmp, DTYPES[dtype])
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("exported %s (%s) to %s", ckpt, fmt, out)
    return ckpt


def _hf_tensors(name: str, t: torch.Tensor, family: str) -> dict[str, torch.Tensor]:
    """HF names and tensors of chipset's ``name``: stacked experts become one tensor per expert."""
    experts = expert_names(name, family, t.shape[0])
    if experts is None:
        return {to_hf(name, family): t.contiguous()}
    return {e: t[i].contiguous() for i, e in enumerate(experts)}


def _write_hf(reader, kind, shapes, hf_cfg, tmp: Path, dtype, max_bytes: int, family: str) -> None:
    from safetensors.torch import save_file

    groups = _groups(shapes, max_bytes, torch.tensor([], dtype=dtype).element_size())
    files = ["model.safetensors"] if len(groups) == 1 else [
        f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map, total = {}, 0
    for names, file in zip(groups, files, strict=True):
        buf = {n: (shapes[n], torch.empty(shapes[n], dtype=torch.float32)) for n in names}
        _read(reader, {f"{kind}.{n}": v for n, v in buf.items()})
        tensors = {k: v for n, (_, t) in buf.items() for k, v in _hf_tensors(n, t.to(dtype), family).items()}
        save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        for k, t in tensors.items():
            weight_map[k] = file
            total += t.numel() * t.element_size()
        del buf, tensors
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")


def _write_torch(reader, kind, shapes, cfg: RunConfig, tmp: Path, dtype) -> None:
    """``model.pt``: the state dict of the run's model family's module (its own names), and its
    ``[model]`` config as ``config.json`` (``ModelConfig(**json)`` rebuilds the module)."""
    import dataclasses

    from chipset.models.family import meta_model
    from chipset.models.registry import resolve_family

    buf = {n: (s, torch.empty(s, dtype=torch.float32)) for n, s in shapes.items()}
    _read(reader, {f"{kind}.{n}": v for n, v in buf.items()})
    sd = {n: t.to(dtype) for n, (_, t) in buf.items()}
    # A module's state_dict lists a shared (tied) weight under each of its names; the
    # checkpoint holds it once, under the first.
    first: dict[int, str] = {}
    for name, p in meta_model(resolve_family(cfg.model.family), cfg).named_parameters(remove_duplicate=False):
        if id(p) in first and name not in sd:
            sd[name] = sd[first[id(p)]]
        first.setdefault(id(p), name)
    torch.save(sd, tmp / "model.pt")
    (tmp / "config.json").write_text(json.dumps(dataclasses.asdict(cfg.model), indent=2) + "\n")
