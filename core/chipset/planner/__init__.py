"""The planner: predict memory, communication and step time of a parallel layout, and search for the best.

Python API::

    from chipset.planner import PRESETS, TrainSpec, resolve_cluster, search
    res = search(PRESETS["llama2-7b"], TrainSpec(global_batch=512), resolve_cluster("8x8:h100-sxm"))
    best = res.candidates[0]

See docs/planner.md for the formulas, their sources and the validation table.
"""

from chipset.planner.assumptions import Assumptions
from chipset.planner.cluster import Cluster, parse_cluster_spec, resolve_cluster
from chipset.planner.comm import CommItem, communication, ring_bytes
from chipset.planner.flops import (
    forward_flops_per_token,
    model_flops_per_token,
    narayanan_flops,
    step_flops,
)
from chipset.planner.layout import Layout, TrainSpec
from chipset.planner.memory import MemoryBreakdown, memory_per_device, zero_model_state_bytes
from chipset.planner.model import (
    PRESETS,
    ModelSpec,
    apply_model_overrides,
    from_engine_model_config,
    get_preset,
)
from chipset.planner.model_file import load_model_toml
from chipset.planner.search import SearchResult, parse_fix, search
from chipset.planner.time import Prediction, bubble_fraction, evaluate

__all__ = [
    "Assumptions", "Cluster", "CommItem", "Layout", "MemoryBreakdown", "ModelSpec", "PRESETS", "Prediction",
    "SearchResult", "TrainSpec", "apply_model_overrides", "bubble_fraction", "communication", "evaluate",
    "forward_flops_per_token", "from_engine_model_config", "get_preset", "load_model_toml", "memory_per_device",
    "model_flops_per_token", "narayanan_flops", "parse_cluster_spec", "parse_fix", "resolve_cluster",
    "ring_bytes", "search", "step_flops", "zero_model_state_bytes",
]
