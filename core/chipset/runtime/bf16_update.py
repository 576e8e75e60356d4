"""bfloat16 training without float32 master weights (``train.master_weights = "none"``).

The parameters are the only copy of the weights, in bfloat16. Each step the engine widens the
slice a rank updates to float32, runs the optimizer on it and writes the result back into the
bfloat16 parameters in one of three ways (``train.bf16_update``):

* ``stochastic``: rounded up or down to a neighbouring bfloat16 with probabilities that make
  the result exact on average (stochastic rounding; Gupta et al. 2015, Zamirai et al. 2020).
  A float32 ``x`` between bfloat16 neighbours ``a < x < b`` has ``L = (x - a) / (b - a) * 2^16``
  in its 16 low bits; adding a uniform integer in ``[0, 2^16)`` to them and dropping them rounds
  up with probability exactly ``L / 2^16``, so ``E[round(x)] = x``. The noise comes from a
  generator seeded by (``train.seed``, step, bucket, first owned element): ranks holding the same
  replicated bucket (ZeRO 0) draw the same noise and stay bit-identical, a rerun repeats it.
* ``kahan``: a bfloat16 compensation buffer per parameter (optimizer state ``compensation``,
  sharded and checkpointed like the moments) holds what the last rounding dropped; the
  optimizer updates ``param + compensation``, the parameter takes that rounded to nearest and
  the buffer the remainder (Kahan 1965's compensated summation, with bfloat16 parts).
* ``nearest``: plain round to nearest, the baseline the other two exist for: an update smaller
  than half a bfloat16 step (``|w| * 2^-9``) is lost every time, so small learning rates stall.

Memory per trainable parameter, against float32 masters: 4 bytes fewer (the master), 2 of them
back for ``kahan``'s buffer. Optimizer state (moments) is unaffected (``train.optimizer_state_dtype``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

__all__ = ["BF16_UPDATES", "Bf16Update", "stochastic_round"]

BF16_UPDATES = ("stochastic", "kahan", "nearest")
"""``train.bf16_update`` values (with ``train.master_weights = "none"``)."""

_LOW = 1 << 16  # the float32 bits below bfloat16's last mantissa bit


def stochastic_round(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``x`` (float32) rounded to bfloat16 stochastically: up with probability equal to the
    fraction of the bfloat16 step that ``x`` lies above the lower neighbour (module docstring).
    Infinities and NaN round to nearest (they have no neighbours)."""
    noise = torch.randint(0, _LOW, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    # In float32's sign-magnitude bit pattern, adding to the low bits moves the magnitude away
    # from zero, so the same rule rounds negative values symmetrically.
    bits = (x.contiguous().view(torch.int32) + noise) & -_LOW
    return torch.where(torch.isfinite(x), bits.view(torch.float32), x).to(torch.bfloat16)


@dataclass(frozen=True)
class Bf16Update:
    """How the engine writes a float32 update back into bfloat16 parameters (module docstring)."""

    rounding: str = "stochastic"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rounding not in BF16_UPDATES:
            raise ValueError(f"bf16 update rounding {self.rounding!r}: expected one of {', '.join(BF16_UPDATES)}")

    @property
    def state_names(self) -> tuple[str, ...]:
        """Per-element state the engine keeps beside the optimizer's (bfloat16, shaped like the owned slice)."""
        return ("compensation",) if self.rounding == "kahan" else ()

    def widen(self, params: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """The float32 weights the optimizer updates: ``params`` (+ the compensation under kahan)."""
        w = params.float()
        if self.rounding == "kahan":
            w += state["compensation"].float()
        return w

    def write_back(self, params: torch.Tensor, w: torch.Tensor, state: dict[str, torch.Tensor], *,
                   step: int, key: tuple[int, ...]) -> None:
        """Store the updated float32 ``w`` into bfloat16 ``params`` (and the compensation).
        ``key`` names the slice (bucket, first owned element): the stochastic noise depends on
        the seed, the step and it alone."""
        if self.rounding == "stochastic":
            params.copy_(stochastic_round(w, self.generator(params.device, step, key)))
            return
        params.copy_(w)  # to nearest
        if self.rounding == "kahan":
            state["compensation"].copy_(w - params.float())

    def generator(self, device: torch.device, step: int, key: tuple[int, ...]) -> torch.Generator:
        """A generator seeded by (seed, step, key) alone, on ``device``."""
        digest = hashlib.blake2b(repr((self.seed, step, *key)).encode(), digest_size=8).digest()
        return torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little") >> 1)
