"""Training runs: the configuration, the loop each rank runs, launching, checkpoints and run directories.

The top room of the engine: it builds a model family's model (``chipset.models``), applies the
parallel transforms (``chipset.parallel``), wraps it in a runtime (``chipset.runtime``) and runs
the steps. Reaches hardware only through a loaded backend's interfaces.
"""

from chipset.train.loop import TrainResult, build, params_digest, train

__all__ = ["TrainResult", "build", "params_digest", "train"]
