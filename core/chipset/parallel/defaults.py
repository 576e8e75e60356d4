"""Layout defaults declared once: the run config (``[parallel]`` in train/config.py) and the
planner's ``Layout`` both read them, so a layout the planner evaluates without naming these knobs
is the one ``chipset train`` runs without them."""

from __future__ import annotations

__all__ = ["DEFAULT_SEQUENCE_PARALLEL", "DEFAULT_CP_ATTENTION"]

DEFAULT_SEQUENCE_PARALLEL = False
"""``parallel.sequence_parallel``: off, as in Megatron-LM (the planner's search still tries it on)."""

DEFAULT_CP_ATTENTION = "allgather"
"""``parallel.cp_attention``: K and V gathered whole, the simplest exact context-parallel attention."""
