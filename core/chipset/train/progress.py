"""The console line of a training run, on rank 0: what a person watching a run wants to read.

Every ``train.log_every`` steps (and at the last step): step/total, loss, lr, gradient norm,
tokens/s averaged over the steps since the previous line, MFU when the backend declares its
peak, peak memory, elapsed time and the estimated time left (mean step time of the last
interval times the steps to go). On a terminal a rich progress bar sits below the lines;
elsewhere (a log file, CI) only the plain lines are written.
"""

from __future__ import annotations

import time


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def fmt_duration(s: float) -> str:
    s = int(round(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m:02d}:{sec:02d}"


class Progress:
    def __init__(self, cfg, out, *, start_step: int, enabled: bool):
        self.total, self.every = cfg.train.steps, cfg.train.log_every
        from chipset.models.registry import resolve_family
        from chipset.train.evaluate import family_unit

        self.unit = family_unit(resolve_family(cfg.model.family), cfg)  # tokens, or samples (images, ...)
        self.tokens_per_step = cfg.train.global_batch * (cfg.train.seq_len if self.unit == "tokens" else 1)
        self.out, self.enabled = out, enabled
        self.t0 = time.perf_counter()
        self._times: list[float] = []
        self._bar = None
        if enabled and getattr(out, "isatty", lambda: False)():
            try:
                from rich.console import Console
                from rich.progress import BarColumn, MofNCompleteColumn, TimeRemainingColumn
                from rich.progress import Progress as Bar

                self._bar = Bar("train", BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                console=Console(file=out), transient=True)
                self._task = self._bar.add_task("train", total=self.total, completed=start_step)
                self._bar.start()
            except ImportError:
                self._bar = None

    def line(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.out, flush=True)

    def step(self, rec: dict, skipped: bool) -> None:
        self._times.append(rec["step_time_s"])
        step = rec["step"]
        if self._bar is not None:
            self._bar.update(self._task, completed=step)
        if not (step % self.every == 0 or step == self.total):
            return
        interval = self._times
        self._times = []
        mean = sum(interval) / len(interval)
        tok_s = self.tokens_per_step / mean if mean > 0 else 0.0
        elapsed = time.perf_counter() - self.t0
        parts = [f"step {step:>4}/{self.total}", f"loss {rec['loss']:8.4f}",
                 f"lr {rec['lr']:.2e}", f"grad_norm {rec['grad_norm']:8.4f}", f"{tok_s:9.0f} {'tok' if self.unit == 'tokens' else 'samples'}/s"]
        if rec.get("mfu") is not None:
            parts.append(f"mfu {100 * rec['mfu']:5.1f}%")
        parts += [f"mem {fmt_bytes(rec['peak_memory_bytes'])}", f"elapsed {fmt_duration(elapsed)}",
                  f"eta {fmt_duration(mean * (self.total - step))}"]
        self.line("  ".join(parts) + (" (skipped: overflow)" if skipped else ""))

    def eval(self, step: int, rec: dict) -> None:
        names = {"eval_ppl": "perplexity"}
        rest = "  ".join(f"{names.get(k, k.removeprefix('eval_'))} {v:.4f}" for k, v in rec.items() if k != "eval_loss")
        self.line(f"eval at step {step}: loss {rec['eval_loss']:.4f}" + (f"  {rest}" if rest else ""))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
