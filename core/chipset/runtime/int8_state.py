"""8-bit optimizer state (``train.optimizer_state_dtype = "int8"``): blockwise-quantised moments.

A state tensor of ``n`` float32 values is held as ``n`` int8 codes and one float32 scale per
block of :data:`BLOCK` consecutive elements (about 1.02 bytes per element instead of 4):

* ``scale = absmax(block) / 127`` and ``code = round(x / scale)`` (to nearest), so every value
  is within half a step, ``absmax / 254``, of the float32 one, and the block's largest keeps its
  magnitude exactly up to float32 rounding (Dettmers et al. 2022, blockwise absmax quantisation,
  with a linear code instead of their dynamic map: see the second moment below);
* a second moment (``exp_avg_sq``, Adam's ``v``) is stored as its square root, and a positive
  value never rounds to code 0 (it keeps at least one step): a small ``v`` rounded to zero
  would turn Adam's ``m / (sqrt(v) + eps)`` into ``m / eps``. The square root halves the
  dynamic range the 127 levels must cover; the floor bounds the update.

The engine updates one bucket at a time: :meth:`Int8Blocks.float` dequantises the bucket's
state to float32, the optimizer updates it, :meth:`Int8Blocks.copy_` quantises it back (as it
does for bfloat16 state). Checkpoints store the dequantised float32 values (the same
``optim.*`` entries as float32 state, so a run may change its state dtype between resumes, and
resharding works as for any state); loading quantises them again, which gives back the same
codes (a dequantised value is a code times the scale, and the block's absmax is one of them).
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "Int8Blocks", "SQUARED_STATES"]

BLOCK = 256
"""Elements per quantisation block (one float32 scale each)."""
SQUARED_STATES = ("exp_avg_sq",)
"""State names holding a second moment (non-negative): stored as square roots, never rounded to zero."""


class Int8Blocks:
    """A flat float32 state tensor stored as int8 codes and per-block float32 scales."""

    def __init__(self, numel: int, device, *, squared: bool = False):
        self.squared = squared
        self.codes = torch.zeros(numel, dtype=torch.int8, device=device)
        self.scales = torch.zeros(-(-numel // BLOCK), dtype=torch.float32, device=device)
        self._staged: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()

    def numel(self) -> int:
        return self.codes.numel()

    def _blocks(self, t: torch.Tensor) -> torch.Tensor:
        pad = self.scales.numel() * BLOCK - t.numel()
        return torch.nn.functional.pad(t, (0, pad)).view(-1, BLOCK)

    def float(self) -> torch.Tensor:
        """The state as float32 values (a new tensor)."""
        x = (self._blocks(self.codes.float()) * self.scales[:, None]).reshape(-1)[: self.codes.numel()]
        return x * x if self.squared else x

    def copy_(self, values: torch.Tensor) -> Int8Blocks:
        """Quantise float ``values`` (``numel`` of them) into this state."""
        x = values.detach().reshape(-1).to(self.codes.device, torch.float32)
        if self.squared:
            x = x.clamp(min=0).sqrt()
        blocks = self._blocks(x)
        scales = blocks.abs().amax(dim=1) / 127
        codes = torch.round(blocks / scales.clamp(min=torch.finfo(torch.float32).tiny)[:, None]).clamp_(-127, 127)
        if self.squared:  # a positive second moment keeps at least one step (module docstring)
            codes = torch.where(blocks > 0, codes.clamp(min=1), codes)
        self.scales.copy_(scales)
        self.codes.copy_(codes.reshape(-1)[: self.codes.numel()].to(torch.int8))
        return self

    # Checkpoints read and write flat float32 slices of a state (train/checkpoint/layout.py).
    def staged(self) -> torch.Tensor:
        """A float32 copy to save from or load into; :meth:`commit_staged` quantises what was loaded."""
        self._staged = self.float()
        return self._staged

    def commit_staged(self) -> None:
        if self._staged is not None:
            self.copy_(self._staged)
            self._staged = None
