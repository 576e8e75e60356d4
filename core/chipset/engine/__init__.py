"""The hardware-agnostic parallel engine (part 1: data parallel, ZeRO 0-3, AMP, recompute).

Reaches hardware only through a loaded backend's interfaces.
"""

from chipset.engine.data import SyntheticTokens
from chipset.engine.data_parallel import DataParallel
from chipset.engine.parallel_dims import ParallelDims
from chipset.engine.precision import LossScaler
from chipset.engine.recompute import apply_recompute
from chipset.engine.trainer import TrainResult, build, params_digest, train

__all__ = [
    "DataParallel",
    "LossScaler",
    "ParallelDims",
    "SyntheticTokens",
    "TrainResult",
    "apply_recompute",
    "build",
    "params_digest",
    "train",
]
