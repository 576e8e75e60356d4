"""Data parallelism with ZeRO stages 0-3, gradient bucketing, accumulation, clipping and AdamW.

How it works (one mechanism for every stage):

* Parameters are grouped into buckets; each bucket owns one flat buffer in the compute
  dtype, padded to a multiple of dp, and every parameter becomes a view into it. Rank
  ``r`` *owns* the slice ``[r*S, (r+1)*S)`` (``S = padded/dp``) of every bucket.
* Stages 0-2 bucket by size (``parallel.bucket_mb``) in reverse parameter order, which is
  roughly the order backward produces gradients. Stage 3 uses one bucket per model unit
  (the bound model's ``units()``: embedding, each block, output head).
* A post-accumulate-grad hook per parameter counts ready gradients; on the last
  micro-batch, as soon as a bucket is complete its communication is launched
  asynchronously, overlapping with the rest of backward. Earlier micro-batches only
  accumulate locally (no communication).
    - stage 0: all-reduce the bucket's gradient buffer (gradients are views of it).
    - stage 1: the same all-reduce; only the owned slice feeds the optimizer.
    - stage 2/3: the gradients are flattened and reduce-scattered into the owned slice; the
      unsharded gradients are freed.
* The optimizer is injected (``runtime/optim.py``: AdamW through ``backend.kernels.fused_adamw``
  by default, or SGD with momentum) and declares its state; the engine keeps float32 master
  weights and that state for the owned slice only (stage >= 1) or for everything (stage 0),
  optionally on the host (``offload_optimizer``). Without masters (``bf16_update``,
  runtime/bf16_update.py) the bfloat16 parameters are updated in place: the optimizer sees a
  float32 copy of the owned slice, written back with stochastic rounding or Kahan compensation.
* Frozen parameters (``requires_grad=False``) live in buckets of their own that hold and shard
  the values only: no gradient buffer, no hooks, no master weights or optimizer state, left out
  of the gradient norm. ZeRO-3 still shards and gathers them, so a frozen base costs 1/dp.
* After the update: stage 0 copies masters into the parameters; stages 1/2 all-gather the
  updated slices; stage 3 keeps only its slice and gathers a unit just in time (forward
  pre-hook, or during backward when autograd unpacks a saved weight) and frees it after
  use (forward hook, or once every gradient of the unit has arrived).
* ZeRO-3 with FP8 all-gather (``fp8_all_gather``: ``train.fp8 = "tensorwise"``): the weights the
  FP8 projections read get a bucket of their own per unit, gathered in FP8. Each rank takes the
  amax of its part of each weight, one all-reduce MAX per bucket gives every rank the whole
  weight's amax, hence its tensorwise scale; each rank quantises its shard with it and the FP8
  bytes are all-gathered (1 byte a parameter instead of 2 or 4). The layer's ``fp8_matmul``
  then reads those bytes as they are (``parallel/fp8.py``): exactly the quantisation of the
  gathered weight, so the run is bit for bit the one that gathers in ``train.dtype``.
* Global-norm clipping: each rank sums squares over the gradient it owns (stage 0: the
  whole, already-reduced gradient; stage >= 1: its slice, then an all-reduce over dp), so
  the norm equals the unsharded norm under every stage.
* MoE with ep > 1 (``parallel/experts.py``): expert weights get buckets of their own,
  sharded and reduced over the expert-data-parallel group (``Bucket.group``) instead of dp,
  still divided by the whole dp degree; their squared norm is summed over the ep group.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from chipset.errors import UsageError
from chipset.interfaces import Group, Handle
from chipset.kernels.fp8 import Fp8Weight, quantize_with, tensorwise_scale
from chipset.parallel.dims import ParallelDims
from chipset.parallel.fp8 import GATHERED, gathered_weights
from chipset.parallel.tensor import is_tp_sharded
from chipset.runtime.bf16_update import Bf16Update
from chipset.runtime.digest import combine, param_hash
from chipset.runtime.int8_state import SQUARED_STATES, Int8Blocks
from chipset.runtime.matrices import BucketMatrices, hidden_matrix_names
from chipset.runtime.optim import AdamW, Optimizer
from chipset.runtime.precision import LossScaler, compute_input
from chipset.runtime.trace import trace_range

if TYPE_CHECKING:
    from chipset.loader import Backend

__all__ = ["DataParallel", "Bucket"]


class Bucket:
    """Parameters sharing one flat buffer, sharded over the dp group."""

    def __init__(self, index: int, params: list[tuple[str, nn.Parameter]], engine: DataParallel,
                 group: Group | None = None):
        self.index = index
        self.frozen = not params[0][1].requires_grad  # a bucket is all frozen or all trainable
        self.fp8 = id(params[0][1]) in engine.fp8_ids  # all gathered in FP8, or none (stage 3)
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.engine = engine
        e = engine
        self.shapes = [p.shape for p in self.params]
        self.numels = [p.numel() for p in self.params]
        self.offsets = [0]
        for n in self.numels[:-1]:
            self.offsets.append(self.offsets[-1] + n)
        total = sum(self.numels)
        # The group this bucket is sharded and reduced over: dp, or for MoE expert weights
        # the expert-data-parallel group (parallel/experts.py).
        self.expert = group is not None
        self.group = group or e.group
        self.n = self.group.size
        self.padded = math.ceil(total / self.n) * self.n
        self.shard = self.padded // self.n
        self.lo = self.group.ranks.index(e.collective.rank()) * self.shard
        self.hi = self.lo + self.shard
        self.norm_segments = self._norm_segments() if e.tp_group is not None else None
        self.ready = 0
        self.done = False
        self.handle: Handle | None = None
        self._inflight: torch.Tensor | None = None  # keeps a reduce-scatter input alive

        with torch.no_grad():
            flat = torch.zeros(self.padded, dtype=e.dtype, device=e.device)
            for p, off, n in zip(self.params, self.offsets, self.numels, strict=True):
                if not p.__dict__.pop("_chipset_unfilled", False):  # placeholders of a meta build stay zero
                    flat[off:off + n].copy_(p.detach().reshape(-1))
        # Parameters: full flat buffer (stage < 3) or only the owned slice (stage 3).
        self.full: torch.Tensor | None = None
        self.full8: torch.Tensor | None = None  # stage 3, FP8 all-gather: the gathered FP8 bytes
        if e.zero == 3:
            self.param_shard = flat[self.lo:self.hi].clone()
            del flat
            self._release_params()
        else:
            self.full = flat
            self._bind_params(flat)
        # Gradients: persistent flat buffer for stage 0/1; owned slice for stage 2/3.
        self.state: dict[str, torch.Tensor] = {}
        self.master_aliases_params = False
        if self.frozen:  # values only: no gradient, no optimizer state (see the module docstring)
            self.grad = self.grad_shard_buf = self.master = None
            self.done = True
            return
        if e.zero <= 1:
            self.grad = torch.zeros(self.padded, dtype=e.dtype, device=e.device)
            self._bind_grads()
            self.grad_shard_buf = None
        else:
            self.grad = None
            self.grad_shard_buf = torch.zeros(self.shard, dtype=e.dtype, device=e.device)
        # Optimizer state: fp32 master + Adam moments of what this rank updates.
        opt_dev = e.host if e.offload else e.device
        if e.zero == 0:
            src = self.full
        elif e.zero == 3:
            src = self.param_shard
        else:
            src = self.full[self.lo:self.hi]
        # Without masters (bf16_update) the owned parameters are what the optimizer updates; at
        # ZeRO 1/2 they are a view of the full buffer, so checkpoints still load "model" there.
        self.master_free = e.bf16_update is not None
        self.master_aliases_params = (e.dtype == torch.float32 or self.master_free) and not e.offload and e.zero in (0, 3)
        with e.host_scope():
            if self.master_aliases_params or self.master_free:
                self.master = src  # the parameters are their own master weights
            else:
                self.master = e.place_host(src.detach().float().to(opt_dev).clone())
            sd = getattr(e.optimizer, "state_dtype", torch.float32)
            self.state = {n: self._new_state(n, sd) for n in e.optimizer.state_names}
            if self.master_free:  # kahan's compensation: bfloat16 whatever the moments' dtype
                self.state |= {n: torch.zeros_like(src) for n in e.bf16_update.state_names}
        self.matrices = BucketMatrices(self, e.matrix_names) if e.matrix_names is not None else None

    def _new_state(self, name: str, dtype: torch.dtype):
        """One zero optimizer state tensor shaped like the master (int8: blockwise codes and scales)."""
        if dtype == torch.int8:
            return Int8Blocks(self.master.numel(), self.master.device, squared=name in SQUARED_STATES)
        return self.engine.place_host(torch.zeros_like(self.master, dtype=dtype))

    def _norm_segments(self) -> list[tuple[int, int, float]]:
        """(start, end, weight) over the owned gradient for the global-norm sum under tp:
        weight 1 for tp-sharded parameters, 1/tp for replicated ones (their squares are then
        summed over tp, so each replicated element counts once)."""
        e = self.engine
        lo, hi = (0, self.padded) if e.zero == 0 else (self.lo, self.hi)
        out = []
        for p, off, n in zip(self.params, self.offsets, self.numels, strict=True):
            a, b = max(lo, off), min(hi, off + n)
            if a < b:
                out.append((a - lo, b - lo, 1.0 if is_tp_sharded(p) else 1.0 / e.tp_group.size))
        return out

    def owned_sq(self) -> torch.Tensor:
        """Sum of squares of the owned gradient (weighted under tp, see ``_norm_segments``)."""
        g = self.grad_owned().float()
        if self.norm_segments is None:
            return g.pow(2).sum()
        total = torch.zeros((), dtype=torch.float32, device=g.device)
        for a, b, w in self.norm_segments:
            total += g[a:b].pow(2).sum() * w
        return total

    # --- parameter storage ---------------------------------------------------------
    def _bind_params(self, flat: torch.Tensor) -> None:
        for p, off, n, shape in zip(self.params, self.offsets, self.numels, self.shapes, strict=True):
            p.data = flat[off:off + n].view(shape)

    def _bind_grads(self) -> None:
        for p, off, n, shape in zip(self.params, self.offsets, self.numels, self.shapes, strict=True):
            p.grad = self.grad[off:off + n].view(shape)

    def _release_params(self) -> None:
        # A one-element placeholder expanded to the right shape keeps autograd's shape
        # checks happy while the real storage is freed.
        e = self.engine
        for p, shape in zip(self.params, self.shapes, strict=True):
            p.data = torch.zeros((), dtype=e.dtype, device=e.device).expand(shape)

    def gather(self) -> None:
        """Stage 3: materialise the full parameters of this bucket (no-op when present)."""
        if self.full is not None:
            return
        e = self.engine
        full = torch.empty(self.padded, dtype=e.dtype, device=e.device)
        e.collective.all_gather(full, self.param_shard, group=self.group)
        self.full = full
        self._bind_params(full)
        e._live[full.untyped_storage().data_ptr()] = self

    def gather_compute(self) -> None:
        """Stage 3: what a forward or backward reads: the full parameters, or (an FP8 bucket)
        their FP8 form alone (:meth:`gather_fp8`)."""
        if self.fp8:
            self.gather_fp8()
        else:
            self.gather()

    @torch.no_grad()
    def gather_fp8(self) -> None:
        """Stage 3, FP8 bucket: all-gather the weights quantised tensorwise, each with the scale of
        the whole weight (module docstring); each weight then carries its ``Fp8Weight``
        (``parallel/fp8.py``'s ``GATHERED``). No-op when gathered."""
        if self.full8 is not None:
            return
        e, fmt = self.engine, Fp8Weight.fmt
        spans = [(i, max(self.lo, off) - self.lo, min(self.hi, off + n) - self.lo)
                 for i, (off, n) in enumerate(zip(self.offsets, self.numels, strict=True))]
        spans = [(i, a, b) for i, a, b in spans if a < b]  # the parts of weights this rank owns
        amax = torch.zeros(len(self.params), dtype=torch.float32, device=e.device)
        for i, a, b in spans:
            amax[i] = self.param_shard[a:b].float().abs().amax()
        if self.n > 1:
            e.collective.all_reduce(amax, "max", group=self.group)
        scales = tensorwise_scale(amax, fmt)
        mine = torch.zeros(self.shard, dtype=torch.uint8, device=e.device)  # bytes: what every backend gathers
        for i, a, b in spans:
            mine[a:b].view(fmt).copy_(quantize_with(self.param_shard[a:b], scales[i], fmt))
        full = torch.empty(self.padded, dtype=torch.uint8, device=e.device)
        e.collective.all_gather(full, mine, group=self.group)
        self.full8 = full.view(fmt)
        for i, (p, off, n, shape) in enumerate(zip(self.params, self.offsets, self.numels, self.shapes, strict=True)):
            setattr(p, GATHERED, Fp8Weight(self.full8[off:off + n].view(shape), scales[i], p))
        e._live[full.untyped_storage().data_ptr()] = self

    def release(self) -> None:
        """Stage 3: free the full parameters (the owned slice stays)."""
        if self.engine.zero != 3:
            return
        if self.full8 is not None:
            self.engine._live.pop(self.full8.untyped_storage().data_ptr(), None)
            self.full8 = None
            for p in self.params:
                p.__dict__.pop(GATHERED, None)
        if self.full is None:
            return
        self.engine._live.pop(self.full.untyped_storage().data_ptr(), None)
        self.full = None
        self._release_params()

    # --- gradients ------------------------------------------------------------------
    def reset(self) -> None:
        """Before a micro-batch's backward: no gradient has arrived yet (frozen: never any)."""
        self.ready, self.done = 0, self.frozen
        if self.grad is not None and any(p.grad is None for p in self.params):
            # Someone ran model.zero_grad(set_to_none=True): honour it, re-attach the views.
            self.grad.zero_()
            self._bind_grads()

    def on_grad_ready(self) -> None:
        self.ready += 1
        if self.ready < len(self.params):
            return
        self.ready = 0
        self.done = True
        e = self.engine
        if e.sync:
            self.launch_reduce()
        if e.zero == 3:
            self.release()

    @torch.no_grad()
    def launch_reduce(self) -> None:
        e = self.engine
        # Record how many buckets were still waiting for gradients: > 0 means this
        # communication overlaps with the rest of backward.
        e.launch_log.append((self.index, sum(1 for b in e.buckets if not b.done)))
        if e.zero <= 1:
            # Divide by the whole dp degree even for expert buckets: an expert's gradient
            # already sums the tokens of its ep group.
            if e.dp > 1:
                self.grad.div_(e.dp)
            if self.n > 1:
                self.handle = e.collective.all_reduce(self.grad, "sum", group=self.group, async_op=True)
            return
        parts = [p.grad.reshape(-1) for p in self.params]
        if self.padded > sum(self.numels):
            parts.append(torch.zeros(self.padded - sum(self.numels), dtype=e.dtype, device=e.device))
        flat = torch.cat(parts)
        for p in self.params:
            p.grad = None
        if e.dp > 1:
            flat.div_(e.dp)
        if self.n > 1:
            self._inflight = flat
            self.handle = e.collective.reduce_scatter(self.grad_shard_buf, flat, "sum", group=self.group, async_op=True)
        else:
            self.grad_shard_buf.copy_(flat)

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
        self._inflight = None

    def grad_owned(self) -> torch.Tensor:
        """The reduced gradient this rank's optimizer consumes."""
        e = self.engine
        if e.zero == 0:
            return self.grad
        if e.zero == 1:
            return self.grad[self.lo:self.hi]
        return self.grad_shard_buf

    def zero_grad(self) -> None:
        if self.frozen:
            return
        if self.grad is not None:
            self.grad.zero_()
        else:
            self.grad_shard_buf.zero_()
            for p in self.params:
                p.grad = None

    # --- update ---------------------------------------------------------------------------
    @torch.no_grad()
    def apply_update(self, step: int, grad_scale: float, lr: float) -> None:
        e = self.engine
        if self.frozen:
            return
        with e.host_scope():
            g = self.grad_owned()
            if g.dtype != torch.float32 or g.device != self.master.device:
                g = g.to(self.master.device, torch.float32)
            # Scaled in place: the owned gradient is zeroed right after the update, so a
            # float32 gradient on the optimizer's device needs no copy (it took one per step).
            if grad_scale != 1.0:
                g.mul_(grad_scale)
            for term in e.grad_terms:  # extra loss terms on the weights (FedProx: train/islands/outer.py)
                term(self, g)
            # A lighter state (train.optimizer_state_dtype) is updated as float32 and rounded back.
            state = {n: self.state[n].float() for n in e.optimizer.state_names}
            w = e.bf16_update.widen(self.master, self.state) if self.master_free else self.master
            if self.matrices is not None:
                e.optimizer.update(w, g, state, step, lr, e.kernels, matrices=self.matrices)
            else:
                e.optimizer.update(w, g, state, step, lr, e.kernels)
            for n, t in state.items():
                if t is not self.state[n]:
                    self.state[n].copy_(t)
            if self.master_free:
                e.bf16_update.write_back(self.master, w, self.state, step=step,
                                         key=(self.index, 0 if e.zero == 0 else self.lo))
            del g, w
        if self.master_aliases_params or self.master_free:
            pass
        elif e.zero == 0:
            self.full.copy_(self.master)
        elif e.zero == 3:
            self.param_shard.copy_(self.master)
        else:
            self.full[self.lo:self.hi].copy_(self.master)
        if e.zero in (1, 2) and self.n > 1:
            send = self.full[self.lo:self.hi].clone()
            self.handle = e.collective.all_gather(self.full, send, group=self.group, async_op=True)
            self._inflight = send


def _placeholders_for_meta(model: nn.Module, dtype: torch.dtype, device: torch.device, allowed: bool) -> None:
    """Replace every meta-device parameter of ``model`` with a zero-storage placeholder of its
    shape (same Parameter attributes, tied parameters kept tied), marked for the bucket that
    takes it. Why: ``Parameter.data`` cannot be re-pointed from the meta device to a real
    one, and allocating the whole tensor would defeat building on the meta device."""
    made: dict[int, nn.Parameter] = {}
    for prefix, mod in model.named_modules():
        for name, p in list(mod._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if not allowed:
                # the class the user built, not the layer chipset swapped in for it (a KernelLinear for
                # an nn.Linear, parallel/linear.py; a tensor-parallel split, parallel/tensor.py)
                given = next(c for c in type(mod).__mro__ if not c.__module__.startswith("chipset.parallel"))
                where = f"{prefix}.{name}" if prefix else name
                raise UsageError(
                    f"parameter {where!r} of {given.__name__} is on the meta device (it has no values); "
                    "build the model on a real device, or let chipset fill it from a file (model.init_from)")
            if id(p) not in made:
                kind = dtype if p.is_floating_point() else p.dtype
                new = nn.Parameter(torch.zeros((), dtype=kind, device=device).expand(p.shape),
                                   requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)
                new._chipset_unfilled = True
                made[id(p)] = new
            mod._parameters[name] = made[id(p)]


def _each(buckets: list[Bucket], fn) -> None:
    """Module hooks must return None (a value would replace the module's input or output)."""
    for b in buckets:
        fn(b)


def _notify(ref: weakref.ref) -> None:
    bucket = ref()
    if bucket is not None:  # None once the engine is gone and the model trains without it
        bucket.on_grad_ready()


class DataParallel:
    """Wraps a model for data-parallel training with ZeRO stage ``dims.zero``.

    Use: ``loss = dp.forward_backward(tokens, targets, last=...)`` per micro-batch, then
    ``dp.step(lr)``. ``dp.full_parameters()`` returns every parameter unsharded, float32.

    ``model``: what to train, bound to what describes it: an object with ``module`` (the
    ``nn.Module`` whose parameters are trained), ``units()`` (ZeRO-3's gather units) and
    ``loss(inputs, targets)`` (a :class:`chipset.models.family.BoundModel`), or a module that
    has ``units()`` and ``loss()`` methods of its own (a pipeline rank's
    :class:`~chipset.parallel.stages.UnitStageModel`, the built-in transformer).
    """

    def __init__(self, model, backend: Backend, dims: ParallelDims, *, dtype: torch.dtype = torch.float32,
                 bucket_mb: float = 25.0, micro_batches: int = 1, grad_clip: float = 0.0,
                 optimizer: Optimizer | None = None, scaler: LossScaler | None = None,
                 offload_optimizer: bool = False, weights_to_load: bool = False,
                 bf16_update: Bf16Update | None = None, fp8_all_gather: bool = False):
        self.bound = model
        """Where units and the loss come from (``model`` as given)."""
        model = self.model = model if isinstance(model, nn.Module) else model.module
        """This rank's share of the model (the ``nn.Module``)."""
        self.backend = backend
        self.collective = backend.collective
        self.kernels = backend.kernels
        self.dims = dims
        self.zero = dims.zero
        self.dtype = dtype
        self.device = backend.device.torch_device()
        self.host = torch.device("cpu")
        self.offload = offload_optimizer
        # Gradients are averaged over the ranks holding replicas: dp x cp, never tp or pp.
        self.group: Group = dims.replica_group(self.collective)
        # Clipping sums squares of tp-sharded gradients over tp (replicated ones count once).
        self.tp_group: Group | None = dims.group("tp", self.collective) if dims.tp_enabled else None
        self.dp = self.group.size
        self.dp_rank = self.group.ranks.index(self.collective.rank())
        # MoE with ep > 1: expert weights are sharded over "ep" and reduced over "edp".
        self.ep_group: Group | None = dims.group("ep", self.collective) if dims.ep_enabled else None
        self.edp_group: Group | None = dims.group("edp", self.collective) if dims.ep_enabled else None
        self.micro_batches = micro_batches
        self.grad_clip = grad_clip
        self.optimizer: Optimizer = optimizer if optimizer is not None else AdamW()
        if bf16_update is not None and (dtype != torch.bfloat16 or offload_optimizer
                                        or max(dims.tp, dims.pp, dims.cp, dims.ep) > 1):
            raise UsageError(f"training without float32 master weights needs bfloat16 parameters on the device "
                             f"under dp and ZeRO only (found dtype {dtype}, offload_optimizer={offload_optimizer}, "
                             f"layout {dims.layout()}); use dtype bfloat16 without offload, tp, pp, cp and ep, or "
                             "keep the masters (bf16_update=None)")
        self.bf16_update = bf16_update
        """None: float32 master weights; else how the bfloat16 parameters take each update (runtime/bf16_update.py)."""
        # Optimizers that update whole matrices (Muon) get each bucket's matrices (runtime/matrices.py).
        self.matrix_names = hidden_matrix_names(model) if getattr(self.optimizer, "uses_matrices", False) else None
        self.scaler = scaler or LossScaler(scale=1.0, dynamic=False)
        self.sync = True
        """Whether a bucket whose gradients are complete launches its reduction (the last
        micro-batch of a step); False accumulates locally (:meth:`begin_accumulation`)."""
        self._no_sync = False
        self.step_count = 0
        self._live: dict[int, Bucket] = {}
        self.launch_log: list[tuple[int, int]] = []
        """(bucket index, buckets still computing gradients) per gradient launch of the last step."""
        self.grad_terms: list = []
        """Gradients of extra loss terms that depend on the weights alone: each ``term(bucket, grad)`` adds
        its gradient to ``grad``, the bucket's owned float32 gradient (shaped like ``bucket.master``),
        after unscaling and clipping and before the optimizer reads it. Empty: nothing is added."""
        self.norm_groups: list[Group] = []
        """Extra groups whose ranks hold disjoint parts of the model (pipeline stages): the squared
        gradient norm and the overflow flag are summed over each, so clipping sees the whole model."""

        # Parameters on the meta device (a model built to be filled from a file afterwards:
        # model.init_from) get zero-storage placeholders; their buckets start at zero.
        _placeholders_for_meta(model, dtype, self.device, weights_to_load)
        model.to(device=self.device, dtype=dtype)
        self.fp8_ids = {id(p) for p in gathered_weights(model)} if fp8_all_gather and self.zero == 3 else set()
        """ZeRO-3: the weights gathered in FP8 (``fp8_all_gather``, module docstring); empty otherwise."""
        named = list(model.named_parameters())
        self.buckets = self._make_buckets(named, bucket_mb)
        # Hooks hold their bucket weakly: a tensor's hooks live in C++, where Python's
        # garbage collector cannot see the cycle param -> hook -> bucket -> param.
        for b in self.buckets:
            if b.frozen:
                continue
            ref = weakref.ref(b)
            for p in b.params:
                p.register_post_accumulate_grad_hook(lambda _p, ref=ref: _notify(ref))
        if self.zero == 3:
            for i, unit in enumerate(self.bound.units()):
                # One bucket per unit; two when ep splits a MoE block into dense and expert weights.
                bs = [b for b, u in zip(self.buckets, self._bucket_units, strict=True) if u == i]
                unit.register_forward_pre_hook(lambda _m, _a, bs=bs: _each(bs, Bucket.gather_compute))
                unit.register_forward_hook(lambda _m, _a, _o, bs=bs: _each(bs, Bucket.release))

    def host_scope(self):
        """Offload: allocations inside are host memory (``Memory.host_allocations``)."""
        return self.backend.memory.host_allocations() if self.offload else contextlib.nullcontext()

    def place_host(self, t: torch.Tensor) -> torch.Tensor:
        return self.backend.memory.pin_memory(t) if self.offload else t

    def _make_buckets(self, named, bucket_mb: float) -> list[Bucket]:
        if self.zero == 3:
            if not callable(getattr(self.bound, "units", None)):
                raise UsageError(
                    f"ZeRO stage 3 needs the model to list its gather units (units()); "
                    f"{type(self.model).__name__} has none. Add units() or use parallel.zero <= 2"
                )
            by_id = {id(p): n for n, p in named}
            groups = [[(by_id[id(p)], p) for p in unit.parameters()] for unit in self.bound.units()]
            covered = sum(len(g) for g in groups)
            if covered != len(named):
                raise UsageError(f"units() cover {covered} of {len(named)} parameters; ZeRO-3 needs all of them")
            experts = self._expert_names()

            def kind(x):  # ep: expert weights are sharded over edp; frozen ones get value-only buckets;
                # weights gathered in FP8 get buckets of their own
                return (x[0] in experts, not x[1].requires_grad, id(x[1]) in self.fp8_ids)

            # One bucket per unit, split by kind (kinds in a fixed order, so every rank agrees).
            split = [[[x for x in g if kind(x) == k] for k in sorted({kind(x) for x in g})] for g in groups]
            self._bucket_units = [u for u, parts in enumerate(split) for part in parts if part]
            parts = [part for parts in split for part in parts if part]
        else:
            limit = max(1, int(bucket_mb * 2**20 / torch.tensor([], dtype=self.dtype).element_size()))
            parts, cur, size = [], [], 0
            experts = self._expert_names()

            def kind(x):
                return (x[0] in experts, not x[1].requires_grad)

            for n, p in reversed(named):
                if cur and (size + p.numel() > limit or kind((n, p)) != kind(cur[0])):
                    parts.append(cur)  # expert and other weights, frozen and trainable, never share a bucket
                    cur, size = [], 0
                cur.append((n, p))
                size += p.numel()
            if cur:
                parts.append(cur)
        return [Bucket(i, part, self, self.edp_group if part[0][0] in experts else None)
                for i, part in enumerate(parts)]

    def _expert_names(self) -> set[str]:
        if self.ep_group is None:
            return set()
        from chipset.parallel.experts import expert_param_names

        return expert_param_names(self.model)

    # --- gradient synchronisation (public: the pipeline runtime and custom loops use it) ---
    def begin_accumulation(self, sync: bool) -> None:
        """Before the backward passes of a micro-batch: no gradient has arrived yet. ``sync``:
        each bucket launches its reduction as soon as its gradients are complete (overlapping
        the rest of backward); else gradients only accumulate locally."""
        self.sync = sync
        if sync:
            self.launch_log = []
        for b in self.buckets:
            b.reset()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, whatever ``last`` says (like
        DistributedDataParallel.no_sync); reduce them later with :meth:`start_grad_sync`."""
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    def start_grad_sync(self) -> None:
        """Launch the reduction of every trainable bucket now (after backward passes that ran
        without sync); :meth:`finish_grad_sync` or :meth:`step` waits for them."""
        self.launch_log = []
        for b in self.buckets:
            if not b.frozen:
                b.launch_reduce()

    def finish_grad_sync(self) -> None:
        """Wait for every launched reduction: gradients are then reduced (the owned slice)."""
        for b in self.buckets:
            b.wait()

    def release_units(self) -> None:
        """ZeRO-3: free every gathered unit's full parameters (no-op at stages 0-2)."""
        if self.zero == 3:
            for b in self.buckets:
                b.release()

    # --- training ---------------------------------------------------------------------
    @contextlib.contextmanager
    def gathered_saved_weights(self, split_backward: bool = False) -> Iterator[None]:
        """Stage 3: saved weights are stored as references and re-gathered when backward needs them.

        ``split_backward``: the graph's backward runs in two halves (zero-bubble schedules), the
        input half with ``retain_graph``. Every other saved tensor is then packed detached: a node
        that saves its own output (softmax, sigmoid, a product, an unsafe view) would otherwise
        hold that output, whose grad_fn is the node itself, a cycle no collector sees. A whole
        backward breaks it by freeing what each node saved; the weight half runs only part of the
        graph, so the rest stayed alive, every step (the last stage's peak grew by 20 MiB a step
        in the suite's dp2 x pp2 run). Unsplit, the tensors go in as they are (no extra op)."""
        if self.zero != 3:
            yield
            return

        def pack(t: torch.Tensor):
            b = self._live.get(t.untyped_storage().data_ptr()) if t.numel() else None
            if b is None:
                return t.detach() if split_backward else t
            return (b, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)

        def unpack(x):
            if not isinstance(x, tuple):
                return x
            b, off, shape, stride, dtype = x
            if dtype == Fp8Weight.fmt and b.fp8:  # the FP8 bytes of a weight (fp8_all_gather)
                b.gather_fp8()
                return b.full8.as_strided(shape, stride, off)
            b.gather()
            return b.full.as_strided(shape, stride, off)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def forward_backward(self, tokens: torch.Tensor, targets: torch.Tensor, *, last: bool = True,
                         loss_factor: float = 1.0) -> float:
        """Forward and backward of one micro-batch; returns its loss (not loss-scaled; times
        ``loss_factor``, 1.0 but for an injected loss spike).

        ``last=False`` accumulates gradients locally; ``last=True`` launches the gradient
        communication bucket by bucket during backward.
        """
        self.begin_accumulation(sync=last and not self._no_sync)
        with self.gathered_saved_weights(), trace_range("chipset::forward"):
            loss = self.bound.loss(compute_input(tokens, self.dtype), targets)
        if loss_factor != 1.0:
            loss = loss * loss_factor
        scaled = loss.float() * (self.scaler.scale / self.micro_batches)
        with trace_range("chipset::backward"):
            scaled.backward()
        self.release_units()
        return float(loss.detach())

    def forward_backward_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]], *,
                              loss_factor: float = 1.0) -> list[float]:
        """Forward and backward of every micro-batch of a step (``(inputs, targets)`` each); the
        last launches the gradient reduction during its backward. Returns the micro-batch losses
        (the :class:`chipset.runtime.engine.Engine` protocol, shared with the pipeline engine)."""
        return [self.forward_backward(x, y, last=m == len(batches) - 1, loss_factor=loss_factor)
                for m, (x, y) in enumerate(batches)]

    @torch.no_grad()
    def step(self, lr: float) -> dict:
        """Finish communication, unscale, check overflow, clip and update. Returns step stats."""
        self.finish_grad_sync()
        inv_scale = 1.0 / self.scaler.scale
        # Sum of squares and an overflow flag over what this rank owns, in one all-reduce.
        sq = torch.zeros(2, dtype=torch.float32, device=self.device)
        ep_sum = self.ep_group is not None and self.zero == 0
        for b in self.buckets:
            if not (ep_sum and b.expert or b.frozen):
                sq[0] += b.owned_sq()
        if ep_sum:
            # Each ep rank holds only its experts' (already edp-reduced) gradients.
            esq = torch.zeros(1, dtype=torch.float32, device=self.device)
            for b in self.buckets:
                if b.expert and not b.frozen:
                    esq += b.owned_sq()
            self.collective.all_reduce(esq, "sum", group=self.ep_group)
            sq[0] += esq[0]
        if not torch.isfinite(sq[0]):
            sq[1] = 1.0
            sq[0] = 0.0
        if self.zero >= 1 and self.dp > 1:
            self.collective.all_reduce(sq, "sum", group=self.group)
        if self.tp_group is not None:
            self.collective.all_reduce(sq, "sum", group=self.tp_group)
        for g in self.norm_groups:  # pipeline stages: each holds a different part of the model
            self.collective.all_reduce(sq, "sum", group=g)
        found_inf = bool(sq[1] > 0)
        norm = math.sqrt(float(sq[0])) * inv_scale
        self.scaler.update(found_inf)
        stats = {"grad_norm": float("nan") if found_inf else norm, "skipped": found_inf,
                 "loss_scale": self.scaler.scale}
        if not found_inf:
            coef = inv_scale
            if self.grad_clip > 0 and norm > self.grad_clip:
                coef *= self.grad_clip / (norm + 1e-6)
            self.step_count += 1
            for b in self.buckets:
                b.apply_update(self.step_count, coef, lr)
            for b in self.buckets:
                b.wait()
        for b in self.buckets:
            b.zero_grad()
        return stats

    # --- inspection -------------------------------------------------------------------
    @torch.no_grad()
    def iter_full_parameters(self):
        """``(name, tensor)`` for every parameter, unsharded, float32 on the host, by its
        single-process name: one bucket's worth at a time, so host memory holds one bucket, not
        the model. Collective for ZeRO-3 and under tp and ep (tp slices gathered, vocabulary
        padding dropped; expert shards gathered): every rank of the job iterates to the end."""
        order = {n: i for i, (n, _) in enumerate(self.model.named_parameters())}
        tp = None
        if self.tp_group is not None:
            from chipset.parallel.tensor import TPContext, gather_full_parameters

            tp = TPContext(self.collective, self.tp_group)
        for b in self.buckets:
            was = b.full is not None
            b.gather()
            part = {n: b.full[off:off + k].view(shape).float().to(self.host).clone()
                    for n, off, k, shape in zip(b.names, b.offsets, b.numels, b.shapes, strict=True)}
            if not was:
                b.release()
            part = {n: part[n] for n in sorted(part, key=order.__getitem__)}  # the same order on every rank
            if tp is not None:
                part = gather_full_parameters(part, self.model, tp, self.device)
            if self.ep_group is not None:
                from chipset.parallel.experts import gather_expert_params

                part = gather_expert_params(part, self.model, dims=self.dims, collective=self.collective)
            yield from part.items()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, unsharded, as float32 on the host, by its single-process name
        (collective, as :meth:`iter_full_parameters`). Holds the whole model: for a digest use
        :meth:`params_digest`, which holds one bucket."""
        return dict(self.iter_full_parameters())

    def param_hashes(self) -> dict[str, bytes]:
        """Name -> :func:`chipset.runtime.digest.param_hash` of every parameter (collective)."""
        return {n: param_hash(n, t) for n, t in self.iter_full_parameters()}

    def params_digest(self) -> str:
        """The layout-independent digest of the whole model (collective; runtime/digest.py)."""
        return combine(self.param_hashes())

    def state_dict(self) -> dict:
        """This rank's training state: what it owns of parameters and optimizer, plus the layout.

        Each bucket entry says which parameters (names, shapes, offsets) its flat buffer
        holds and which slice ``[lo, hi)`` this rank owns, so a checkpoint writer can map
        shards to parameters (checkpoint/layout.py reshards across layouts). Tensors are copies on
        the host. :meth:`load_state_dict` restores it under the same layout.
        """
        buckets = []
        for b in self.buckets:
            b.wait()
            if self.zero == 0:
                owned = b.full
            elif self.zero == 3:
                owned = b.param_shard
            else:
                owned = b.full[b.lo:b.hi]
            buckets.append({
                "names": list(b.names), "shapes": [tuple(x) for x in b.shapes], "offsets": list(b.offsets),
                "padded": b.padded, "lo": 0 if self.zero == 0 else b.lo, "hi": b.padded if self.zero == 0 else b.hi,
                # "edp": MoE expert weights, this rank's ep block sharded over the expert-data-parallel group
                "group": "edp" if b.expert else "dp",
                "params": owned.detach().to(self.host, copy=True),
                **({} if b.frozen else {"master": b.master.detach().to(self.host, copy=True)}),
                **{n: (t.float() if isinstance(t, Int8Blocks) else t.detach()).to(self.host, copy=True)
                   for n, t in b.state.items()},
            })
        return {"step": self.step_count, "scaler": self.scaler.state_dict(), "zero": self.zero,
                "optimizer": self.optimizer.name,
                "dp": self.dp, "dp_rank": self.dp_rank, "dtype": str(self.dtype).removeprefix("torch."),
                "buckets": buckets}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output written under the same layout (collective for zero 1/2)."""
        mine = {"zero": self.zero, "dp": self.dp, "dp_rank": self.dp_rank,
                "dtype": str(self.dtype).removeprefix("torch."), "buckets": len(self.buckets)}
        mine["optimizer"] = self.optimizer.name
        theirs = {k: state.get(k) for k in ("zero", "dp", "dp_rank", "dtype")}
        theirs["optimizer"] = state.get("optimizer", "adamw")  # written before optimizers were injected
        theirs["buckets"] = len(state.get("buckets", []))
        if mine != theirs or any(
            sb["names"] != b.names or sb["padded"] != b.padded for sb, b in zip(state["buckets"], self.buckets, strict=True)
        ):
            raise UsageError(
                f"training state was written under layout {theirs}, this engine is {mine} (or its buckets "
                "hold different parameters); to continue under another layout, save and resume through a "
                "checkpoint (chipset.train.checkpoint.Checkpointer, `chipset train --resume`), which reshards"
            )
        for sb, b in zip(state["buckets"], self.buckets, strict=True):
            if self.zero == 0:
                b.full.copy_(sb["params"])
            elif self.zero == 3:
                b.param_shard.copy_(sb["params"])
            else:
                b.full[b.lo:b.hi].copy_(sb["params"])
            if not (b.master_aliases_params or b.frozen):
                b.master.copy_(sb["master"])
            for n, t in b.state.items():
                t.copy_(sb[n])
            if self.zero in (1, 2) and b.n > 1:
                send = b.full[b.lo:b.hi].clone()
                self.collective.all_gather(b.full, send, group=b.group)
        self.step_count = int(state["step"])
        self.scaler.load_state_dict(state["scaler"])
