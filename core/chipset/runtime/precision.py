"""Mixed precision: compute dtypes and the dynamic loss scaler for float16.

Parameters live in the compute dtype; the optimizer keeps float32 master weights
(:mod:`chipset.runtime.data_parallel`). float16 needs loss scaling; float32 and
bfloat16 run with a scale of 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DTYPE_BY_NAME", "LossScaler", "compute_input"]

DTYPE_BY_NAME = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LossScaler:
    """Dynamic loss scaling (Megatron/DeepSpeed semantics).

    On a step with inf/nan gradients the step is skipped and the hysteresis counter drops;
    when it reaches 0 the scale is multiplied by ``backoff`` (not below ``min_scale``).
    After ``window`` consecutive clean steps the scale is multiplied by ``growth`` and the
    hysteresis counter is refilled. ``dynamic=False`` keeps ``scale`` fixed (overflowing
    steps are still skipped).
    """

    scale: float = 2.0**16
    dynamic: bool = True
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    growth: float = 2.0
    backoff: float = 0.5
    clean_steps: int = 0
    hysteresis_left: int = -1
    skipped_steps: int = 0

    def __post_init__(self) -> None:
        if self.hysteresis_left < 0:
            self.hysteresis_left = self.hysteresis

    def update(self, found_inf: bool) -> None:
        """Record one step's outcome and adjust the scale."""
        if found_inf:
            self.skipped_steps += 1
            self.clean_steps = 0
            if not self.dynamic:
                return
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff, self.min_scale)
            return
        if not self.dynamic:
            return
        self.clean_steps += 1
        if self.clean_steps >= self.window:
            self.clean_steps = 0
            self.hysteresis_left = self.hysteresis
            self.scale *= self.growth

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "clean_steps": self.clean_steps,
            "hysteresis_left": self.hysteresis_left,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


def compute_input(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the model's input under compute dtype ``dtype``: floating-point inputs (images,
    features) follow the parameters' dtype, as torch.autocast would cast them for a conv or
    linear; integer inputs (token ids) and inputs already in ``dtype`` pass unchanged."""
    return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x
