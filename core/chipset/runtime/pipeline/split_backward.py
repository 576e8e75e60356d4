"""A backward in two halves, for zero-bubble schedules: input gradient now, weight gradients later.

:func:`backward_input` runs the part of a stage's backward that leads to the stage's input
(what the previous stage waits for) and returns a :class:`WeightGrad`; its :meth:`WeightGrad.run`
later runs the rest, accumulating the parameters' gradients exactly as one whole backward would
(the same autograd nodes compute them, on the same incoming gradients, into ``.grad``, with the
parameters' post-accumulate hooks firing as usual).

How, with autograd's public graph API only:

1. Walk the graph from the roots and mark every node from which the input ``x`` is reachable
   (the input path). A node on the path with a child off the path (a child that leads only to
   parameters: a matmul's weight, a norm's scale) is a *frontier* node.
2. Hook every frontier node (``Node.register_prehook``) and run ``torch.autograd.grad(roots,
   x, retain_graph=True)``: autograd executes only the input path and, in each node, computes
   only the outputs that lead to ``x`` (a matmul skips its weight gradient); the hooks keep the
   gradients arriving at the frontier nodes.
3. Later, :meth:`WeightGrad.run` calls ``torch.autograd.backward`` from the frontier nodes'
   outputs (``GradientEdge``) with the kept gradients and ``inputs=`` the parameters: each
   frontier node runs again, now computing only its parameter-side outputs, and so do the
   parameter-only nodes below it.

A node implemented as a custom ``torch.autograd.Function`` computes all of its outputs each
time it runs (its ``needs_input_grad`` does not know which half is running), so such a node on
the frontier does its work twice; torch's own operators do not.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = ["WeightGrad", "backward_input"]


class WeightGrad:
    """The deferred half of a backward: ``run()`` accumulates the parameters' gradients.

    ``groups``: (edges, incoming gradients, parameters), each run as one
    ``torch.autograd.backward`` whose ``inputs`` are only the parameters below those edges.
    """

    def __init__(self, groups: list[tuple[list, list, list[torch.Tensor]]]):
        self._groups = groups

    def run(self) -> None:
        groups, self._groups = self._groups, []  # drop the graph once its weights are done
        for edges, grads, params in groups:
            torch.autograd.backward(edges, grads, inputs=params)


def _walk(roots: list, target) -> dict:
    """Every node reachable from ``roots`` -> whether ``target`` is reachable from it."""
    reaches: dict = {}
    stack = [(n, False) for n in roots if n is not None]
    while stack:
        node, expanded = stack.pop()
        if node in reaches:
            continue
        children = [c for c, _ in node.next_functions if c is not None]
        if not expanded:
            stack.append((node, True))
            stack.extend((c, False) for c in children if c not in reaches)
            continue
        reaches[node] = node is target or any(reaches[c] for c in children)
    return reaches


def _leaves_below(nodes: list) -> list:
    """The AccumulateGrad nodes reachable from ``nodes`` (off the input path: parameters only)."""
    seen, stack, out = set(), list(nodes), []
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if hasattr(n, "variable"):
            out.append(n)
        stack.extend(c for c, _ in n.next_functions if c is not None)
    return out


def backward_input(roots: list[torch.Tensor], grads: list[torch.Tensor | None],
                   x: torch.Tensor | None) -> tuple[torch.Tensor | None, WeightGrad]:
    """The gradient of ``x`` (the stage's input; None on the first stage, which has none to
    send) through ``roots`` with incoming ``grads`` (None for a scalar root: ones), and the
    weight half for later. Nothing accumulates into any ``.grad`` here."""
    grads = [torch.ones_like(r) if g is None else g for r, g in zip(roots, grads, strict=True)]

    def whole() -> WeightGrad:  # every parameter, from the roots (only where it is needed: a walk)
        params = [leaf.variable for leaf in _leaves_below([r.grad_fn for r in roots])]
        return WeightGrad([(list(roots), grads, params)])

    if x is None:  # the first stage: everything is weight gradient
        return None, whole()
    target = get_gradient_edge(x).node
    reaches = _walk([r.grad_fn for r in roots], target)
    # Frontier: nodes on the input path with a child off it; each is deferred with the parameters
    # below its off-path children (each parameter must have one owner, else ``shared``).
    frontier, owners, deferred = [], Counter(), []
    for node, on_path in reaches.items():
        off = [c for c, _ in node.next_functions if c is not None and not reaches[c]] if on_path else []
        if off:
            leaves = _leaves_below(off)
            owners.update(leaves)
            frontier.append((node, [leaf.variable for leaf in leaves]))
    on_path = [i for i, r in enumerate(roots) if reaches.get(r.grad_fn)]
    for i, r in enumerate(roots):  # roots off the input path (an aux loss of the weights alone)
        if i not in on_path and r.grad_fn is not None:
            leaves = _leaves_below([r.grad_fn])
            owners.update(leaves)
            deferred.append(([r], [grads[i]], [leaf.variable for leaf in leaves]))
    shared = any(n > 1 for n in owners.values())
    kept: dict = {}
    handles = [] if shared else [n.register_prehook(lambda g, n=n: kept.__setitem__(n, g)) for n, _ in frontier]
    try:
        if on_path:
            (dx,) = torch.autograd.grad([roots[i] for i in on_path], [x], [grads[i] for i in on_path],
                                        retain_graph=True)
        else:
            dx = torch.zeros_like(x)
    finally:
        for h in handles:
            h.remove()
    if shared:
        # A parameter below two frontier nodes (a weight used twice on the path): one group
        # per node would count it from both; the weight half is then the whole backward again,
        # restricted to the parameters (correct, at the cost of the input path once more).
        return dx, whole()
    for node, ps in frontier:
        g = kept.get(node)
        if g is None:
            continue  # never reached with a gradient (a branch the loss does not depend on)
        edges = [(GradientEdge(node, k), gk) for k, gk in enumerate(g) if gk is not None]
        if edges:
            deferred.append(([e for e, _ in edges], [gk for _, gk in edges], ps))
    return dx, WeightGrad(deferred)
