"""Model-agnostic parallel transforms: the layout (``ParallelDims``), tensor, sequence, context and
expert parallelism, pipeline splits, recompute and regional compilation.

Each transform takes a model and what its family declares (a plan, its attention modules, its
pipeline units) and never names a module of a particular model.
"""
