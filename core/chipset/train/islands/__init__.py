"""Training across islands: DiLoCo / local SGD, mixed-backend islands and federated learning.

An island is a group of ranks with its own job world and backend; islands meet only over a
host-side gloo link every ``islands.sync_every`` steps (docs/islands.md). ``config``: the
``[islands]`` and ``[federated]`` tables; ``link``: the store, quorum and groups between
islands; ``outer``: the outer step; ``launch``: starting the islands; ``federated``: clients,
the aggregator, secure aggregation and differential privacy; ``accountant``: the RDP accountant.
"""
