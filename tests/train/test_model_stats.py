"""The replica checksum (``param_sum``, train/model_stats.py) is computed only where a replica can
compare it: ranks that differ only along dp (and hold the same experts) exist. Elsewhere no rank
reads its parameters or syncs with the device for it."""

from __future__ import annotations

import math

import pytest
from torch import nn

from chipset.parallel.dims import ParallelDims
from chipset.train.config import RunConfig
from chipset.train.model_stats import ModelStats


@pytest.mark.parametrize(("layout", "compared"), [
    ({"dp": 1}, False),  # one process
    ({"dp": 1, "pp": 2, "world_size": 2}, False),
    ({"dp": 1, "tp": 2, "world_size": 2}, False),
    ({"dp": 1, "cp": 2, "world_size": 2}, False),
    ({"dp": 2, "ep": 2, "world_size": 2}, False),  # each rank holds other experts
    ({"dp": 2, "zero": 3, "world_size": 2}, False),  # no rank holds whole parameters
    ({"dp": 2, "world_size": 2}, True),
    ({"dp": 2, "pp": 2, "world_size": 4}, True),
    ({"dp": 4, "ep": 2, "world_size": 4}, True),
])
def test_param_sum_is_computed_only_where_a_replica_can_compare_it(layout, compared):
    dims = ParallelDims(**layout)
    assert any(len(g) > 1 for g in dims.dp_replicas()) == (compared or dims.zero == 3)
    got = ModelStats(RunConfig(), dims, nn.Linear(3, 2)).param_sum(1)
    assert math.isfinite(got) if compared else math.isnan(got)
