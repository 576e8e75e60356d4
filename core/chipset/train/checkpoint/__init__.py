"""Fault tolerance: checkpoints that reshard, resume, and hang diagnosis.

* :mod:`.layout` maps the engine's sharded flat buffers to logical full-tensor names;
* :mod:`.store` is the on-disk format: atomic commit, manifest, verification, selection;
* :mod:`.manager` saves and resumes a run (:class:`Checkpointer`);
* :mod:`.hangs` writes each rank's recent collectives on a timeout and tells the
  launcher which ranks never arrived.

See docs/fault-tolerance.md.
"""

from chipset.train.checkpoint.manager import Checkpointer, resolve_resume, shape_mismatches

__all__ = ["Checkpointer", "resolve_resume", "shape_mismatches"]
