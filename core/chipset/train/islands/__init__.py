"""Training across islands: DiLoCo / local SGD, with each island on its own backend.

An island is a group of ranks with its own job world and backend; islands meet only over a
host-side gloo link every ``islands.sync_every`` steps (docs/islands.md). ``config``: the
``[islands]`` table; ``link``: the store, quorum and groups between islands; ``outer``: the
outer step; ``launch``: starting the islands.
"""
