"""What ``chipset train`` checks before launching and reports after a failed job."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from chipset.errors import UsageError
from chipset.train.checkpoint import store
from chipset.train.checkpoint.hangs import HANGS, diagnose
from chipset.train.checkpoint.manager import refuse_shapes, resolve_resume, shape_mismatches
from chipset.train.resume_check import check_compatible

if TYPE_CHECKING:
    from chipset.loader import Backend

__all__ = ["parse_nnodes", "check_resume", "report_failure", "clear_hang_logs"]


def parse_nnodes(text: str) -> tuple[int, int]:
    """``"2"`` -> (2, 2); ``"1:2"`` -> (1, 2) (an elastic node range)."""
    lo, sep, hi = str(text).partition(":")
    try:
        a, b = int(lo), int(hi if sep else lo)
    except ValueError:
        raise UsageError(f"--nnodes {text!r}: expected a number of nodes N or a range MIN:MAX, e.g. 2 or 1:2") from None
    if not 1 <= a <= b:
        raise UsageError(f"--nnodes {text!r}: expected 1 <= MIN <= MAX")
    return a, b


def check_resume(run_dir: Path, mode: str, cfg, backend: Backend, run_id: str | None = None) -> Path | None:
    """Before launch: the checkpoint ``mode`` selects must exist, fit the model and have been written
    under a compatible config (ConfigError, exit 2). ``auto`` looks only at run ``run_id``'s checkpoints."""
    if mode == "none":
        return None
    path, _ = resolve_resume(run_dir, mode, run_id)
    if path is None:
        return None
    from chipset.models.family import meta_model
    from chipset.models.registry import resolve_family
    from chipset.parallel.lora import apply_lora, lora_of

    state = json.loads((path / store.STATE).read_text())
    family = resolve_family(cfg.model.family)
    model = meta_model(family, cfg, backend.kernels)  # shapes only
    lora = lora_of(cfg, family)
    if lora is not None:  # its adapters are parameters the checkpoint holds too
        apply_lora(model, lora, seed=cfg.train.seed)
    mine = {n: tuple(p.shape) for n, p in model.named_parameters()}
    problems = shape_mismatches({n: tuple(s) for n, s in state["shapes"].items()}, mine)
    if problems:
        raise refuse_shapes(path, problems)
    check_compatible(path, state.get("config"), cfg.to_dict())
    return path


def clear_hang_logs(run_dir: Path) -> None:
    shutil.rmtree(Path(run_dir) / HANGS, ignore_errors=True)


def report_failure(run_dir: Path, out=None) -> dict | None:
    """After a failed job: print which ranks did not arrive at which collective (from the rank logs)."""
    out = out or sys.stdout
    report = diagnose(run_dir)
    if report is None:
        return None
    print("chipset train: collective diagnosis (" + str(Path(run_dir) / HANGS) + "):", file=out)
    for line in report["lines"]:
        print("  " + line, file=out)
    out.flush()
    return report
