"""The engine as a library: what ``chipset train`` does, one function per piece (docs/library.md).

A script launched with ``torchrun`` (or run as one process) calls, in order::

    cfg = api.config(...)                         # the run's settings (the [model] ... [data] tables)
    backend = api.init(cfg)                       # backend, device, process group; checks cfg
    engine = api.parallelize(cfg, backend, model) # this rank's share of the model, wrapped
    ckpt = api.checkpointer(cfg, backend, engine, run_dir); start = ckpt.resume("auto")
    loss, stats = api.step(engine, batches, lr)   # per step: forward, backward, reduce, update
    ckpt.save(step); ckpt.finish(); api.finish_rank(backend)

For objectives other than cross-entropy (DPO, KTO, a policy gradient), :func:`per_token_loss`
scores each micro-batch by a function of its per-token log-probabilities; :func:`logprobs` is
the forward-only pass, :func:`stream_weights` the full weights by Hugging Face name for an
external rollout engine (docs/rl.md).

These are the functions ``chipset train`` itself runs (train/worker.py and train/loop.py
call the same pieces), so a custom loop gets the same gradient reduction, ZeRO sharding, tensor
parallelism and checkpoints, and the same numbers as the CLI.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import torch
from torch import nn

from chipset.errors import ConfigError, UsageError
from chipset.models.family import ModelFamily, family_data
from chipset.models.registry import resolve_family
from chipset.rl.logprobs import forward_logprobs, per_token_loss
from chipset.rl.rollout import stream_weights as _stream_weights
from chipset.train import lr as lr_schedule
from chipset.train.config import (
    RunConfig,
    _apply,
    _format,
    load_config,
    parse_overrides,
    resolve_dtype,
)
from chipset.train.loop import (
    build_model,
    make_dims,
    params_digest,
    rank_batches,
    train_step,
    wrap,
)
from chipset.train.rank import start, stop

if TYPE_CHECKING:
    from chipset.loader import Backend

__all__ = [
    "ModelFamily",
    "RunConfig",
    "batches",
    "checkpointer",
    "config",
    "dataset",
    "init",
    "logprobs",
    "lr_at",
    "per_token_loss",
    "params_digest",
    "parallelize",
    "shutdown",
    "finish_rank",
    "step",
    "stream_weights",
]

log = logging.getLogger(__name__)


def config(path: str | Path | None = None, overrides: list[str] | None = None, **sections: dict) -> RunConfig:
    """The run's configuration: defaults, then the TOML file ``path``, then ``sections`` (one dict
    per table: ``parallel={"zero": 3}``), then ``overrides`` (``"section.key=value"`` strings, as
    ``chipset train --set`` takes them, e.g. from ``sys.argv[1:]``). Every key is the one of
    docs/config.md; an unknown key or a bad value raises :class:`chipset.ConfigError` listing all."""
    cfg = load_config(path)
    problems: list[str] = []
    _apply(cfg, sections, "chipset.api.config", problems)
    if overrides:
        _apply(cfg, parse_overrides(list(overrides)), "overrides", problems)
    if problems:
        raise ConfigError(_format(problems, "chipset.api.config"))
    return cfg


def init(cfg: RunConfig | None = None, backend: str | None = None):
    """Select the backend (``backend``, else ``CHIPSET_BACKEND``, else the best one installed),
    set this rank's device (``LOCAL_RANK``) and join the process group (``RANK``/``WORLD_SIZE``
    from torchrun; without a launcher, a world of one). With ``cfg``, validates it for this world
    size and the backend's dtypes and fills ``parallel.dp``. Returns the
    :class:`chipset.loader.Backend`: ``backend.collective.rank()``, ``backend.device`` and so on."""
    b = start(backend)
    if cfg is not None:
        resolve_dtype(cfg, b.capabilities.default_dtype)
        try:
            cfg.validate(world_size=b.collective.world_size(), dtypes=b.capabilities.dtypes)
        except ConfigError:
            stop(b)
            raise
    return b


class ModuleFamily(ModelFamily):
    """A plain ``nn.Module`` given to :func:`parallelize`, seen as a model family: its weights as
    built (rank 0's, broadcast), ``plan`` as its tensor-parallel plan, and the family defaults for
    ZeRO-3 units and loss unless ``loss`` is given."""

    def __init__(self, module: nn.Module, plan: dict[str, str] | None = None, loss=None):
        self.module = module
        self.name = type(module).__name__
        self.tp_plan = dict(plan or {})
        self.layouts = ModelFamily.layouts | ({"tp"} if self.tp_plan else set())
        self._loss = loss

    def build(self, cfg) -> nn.Module:
        return self.module

    def loss(self, model, inputs, targets):
        return self._loss(model, inputs, targets) if self._loss is not None else super().loss(model, inputs, targets)


def _broadcast_from_rank0(module: nn.Module, backend: Backend) -> None:
    """Give every rank rank 0's parameters and floating buffers (one collective, on the device)."""
    col = backend.collective
    ts = [t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()]
    if col.world_size() == 1 or not ts:
        return
    flat = torch.cat([t.detach().reshape(-1).float() for t in ts]).to(backend.device.torch_device())
    col.broadcast(flat, 0)
    flat = flat.cpu()
    with torch.no_grad():
        off = 0
        for t in ts:
            t.copy_(flat[off:off + t.numel()].view_as(t))
            off += t.numel()


def parallelize(cfg: RunConfig, backend: Backend, model: nn.Module | ModelFamily | None = None, *,
                plan: dict[str, str] | None = None, loss=None):
    """This rank's engine for ``model`` under ``cfg.parallel`` (dp, ZeRO 0-3, tp, ...).

    ``model`` is one of: ``None`` (the family ``cfg.model.family`` names: the built-in
    transformer by default); a :class:`ModelFamily` (docs/models.md); or a plain ``nn.Module``,
    float32 on the CPU, whose weights rank 0 gives every rank, with ``plan`` as its
    tensor-parallel plan (``{"name pattern": "colwise" | "rowwise" | "replicated"}``, needed for
    ``parallel.tp > 1``) and ``loss(model, inputs, targets)`` (default: cross-entropy of
    ``model(inputs)``). A layout the model does not support raises :class:`chipset.ConfigError`.

    The engine (``DataParallel``, or the pipeline engine when pp > 1) owns the model from here:
    ``engine.model`` is this rank's shard; use :func:`step` to train it and
    ``engine.full_parameters()`` (collective) for the whole model's weights.
    """
    if isinstance(model, nn.Module) and not plan and cfg.parallel.tp > 1:
        raise ConfigError(f"parallel.tp = {cfg.parallel.tp} splits the model by a tensor-parallel plan, and "
                          f"parallelize got none for this {type(model).__name__}; pass plan={{module name "
                          "pattern: 'colwise' | 'rowwise' | 'replicated'}} (docs/models.md) or use parallel.tp = 1")
    dims = make_dims(cfg, backend.collective.world_size())
    if model is None:
        family = resolve_family(cfg.model.family)
    elif isinstance(model, nn.Module):
        _broadcast_from_rank0(model, backend)
        family = ModuleFamily(model, plan, loss)
    elif callable(getattr(model, "build", None)):
        family = model
    else:
        raise UsageError(f"parallelize: model is {type(model).__name__}; expected an nn.Module, a model "
                         "family (chipset.models.family.ModelFamily) or None for cfg.model.family")
    if plan is not None and not isinstance(model, nn.Module):
        raise UsageError("parallelize: plan= is for a plain nn.Module; a model family has its own tp_plan")
    return wrap(build_model(cfg, backend, dims, family), cfg, backend, dims)


def dataset(cfg: RunConfig, model: ModelFamily | None = None):
    """The data ``chipset train`` would read: ``model.data(cfg)`` for a family, else that of
    ``cfg.model.family`` (token sequences from ``data.*`` for the transformer)."""
    family = model if model is not None else resolve_family(cfg.model.family)
    return family_data(family, cfg)


def batches(data, step: int, engine, cfg: RunConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's ``parallel.micro_batches`` micro-batches of ``step`` from ``data`` (see
    :func:`dataset`; any object with the family contract's ``batch()``), on the engine's device."""
    return rank_batches(data, step, engine, cfg.parallel.micro_batches)


def step(engine, batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float) -> tuple[float, dict]:
    """One training step: forward and backward of each micro-batch in ``batches`` (this rank's
    ``(inputs, targets)``, exactly ``parallel.micro_batches`` of them), gradients reduced over dp
    and sharded as ZeRO says, then AdamW at ``lr`` (with clipping and loss scaling from ``cfg``).
    Returns the global batch's loss (the same on every rank) and ``{"grad_norm", "skipped",
    "loss_scale"}``."""
    return train_step(engine, batches, lr)


def logprobs(engine, tokens: torch.Tensor, with_entropy: bool = False):
    """``[b, s-1]`` log-probabilities of ``tokens[:, 1:]`` under the engine's model, forward only,
    on any dp/ZeRO/tp layout (every tp rank passes the same tokens); with ``with_entropy`` also
    each position's entropy. For evaluation, distillation and the reference terms of a loss."""
    return forward_logprobs(engine, tokens, with_entropy)


def stream_weights(engine, cfg: RunConfig | None = None):
    """``(name, tensor)`` for every parameter, unsharded, float32 on the host, one at a time, in
    memory (collective: every rank iterates to the end). With ``cfg`` of the built-in transformer
    the names are Hugging Face's, as an external rollout engine (vLLM's ``load_weights``) takes them."""
    return _stream_weights(engine, cfg)


def lr_at(cfg: RunConfig, step: int) -> float:
    """The learning rate of 0-based ``step`` under ``train.lr``, warmup and ``train.lr_schedule``."""
    return lr_schedule.lr_at(cfg.train, step)


def checkpointer(cfg: RunConfig, backend: Backend, engine, run_dir: str | Path):
    """The run directory's checkpoints for ``engine`` (:class:`chipset.train.checkpoint.Checkpointer`,
    the same as ``chipset train``'s; docs/fault-tolerance.md). Collective: every rank calls every
    method. ``resume("auto" | "none" | path)`` loads one and returns the step to start at (0 for a
    fresh run), resharding to this layout; ``due(step)`` says whether ``train.checkpoint_every``
    asks for one after ``step`` completed steps; ``save(step)`` writes it (DCP, atomic, verified);
    ``finish()`` waits for an asynchronous save."""
    from chipset.train.checkpoint import Checkpointer

    return Checkpointer(cfg, backend, engine, run_dir)


def shutdown(backend: Backend) -> None:
    """Leave the process group (idempotent), for a script that goes on afterwards; a rank's
    script that is done should end with :func:`finish_rank` instead."""
    stop(backend)


def finish_rank(backend: Backend, code: int = 0) -> NoReturn:
    """Leave the process group and end this rank's process now with ``code``, skipping the
    interpreter's teardown: the last line of a rank's script.

    Why: torch's gloo state is sometimes destroyed in the wrong order at interpreter exit,
    aborting a finished rank ("terminate called without an active exception", exit -6: seen in
    3 of 36 two-rank resumes of examples/custom_loop.py with no step left), which turns a
    complete run into a failed job. ``chipset train`` ends its ranks the same way."""
    from chipset._process import exit_rank

    stop(backend)
    exit_rank(code)
