"""The model-family contract: what the engine needs from a model, and nothing more.

A *family* is an object with the attributes and methods of :class:`ModelFamily`. The engine
builds the model through it, shards it for the layout of ``parallel.*`` and trains it; no
engine code names a family's modules. The built-in decoder is the family ``transformer``
(:class:`TransformerFamily`); others come from the entry-point group ``chipset.models`` or from
``model.family = "package.module:factory"`` (docs/models.md). A factory is called with no
arguments and returns a family (an instance of a :class:`ModelFamily` subclass, usually).

Why a family object and not methods on the module: a user's ``nn.Module`` stays what it is
(its parameter names are the checkpoint's names), and the family adds what the engine needs
beside it: the engine trains a :class:`BoundModel` (:func:`bind`), the module paired with its
family, and patches no method onto the module.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from chipset.parallel.meta import on_meta
from chipset.parallel.plan import LAYOUTS, PLAN_STYLES, plan_matches
from chipset.parallel.tensor import vocab_parallel_loss

__all__ = ["LAYOUTS", "BoundModel", "ModelFamily", "TransformerFamily", "bind", "build_for_run", "family_data", "layout_problems", "meta_model"]

class ModelFamily:
    """Base class of a model family; override what your model needs.

    Subclasses set :attr:`name` and implement :meth:`build`; the defaults of the other
    methods fit a module that maps a batch of inputs to class logits.
    """

    name: str = "custom"
    """Shown by ``chipset models`` and in errors."""

    layouts: frozenset[str] = frozenset({"dp", "zero1", "zero2", "zero3"})
    """Layouts this family supports (names from :data:`LAYOUTS`). Any other degree > 1 (or
    ZeRO stage) in ``parallel.*`` is refused before launch with exit 2."""

    config_class: type | None = None
    """A dataclass of this family's own ``[model]`` keys, each with a default (resnet's
    ``num_classes``). They are read in the same table as the shared keys (``family``,
    ``init_from``, ...), validated against this dataclass's fields and types when the config is
    read (an unknown key or a wrong type: exit 2 before launch), and read with :meth:`options`.
    Value rules (ranges) belong in the dataclass's ``__post_init__`` (raise ``ValueError``) or in
    :meth:`config_problems`. None: the family reads the built-in decoder's keys only."""

    def options(self, cfg):
        """This run's values of :attr:`config_class` (its defaults for the keys not set)."""
        if self.config_class is None:
            raise TypeError(f"model family {self.name!r} declares no config_class")
        return self.config_class(**cfg.model.family_options)

    tp_plan: dict[str, str] = {}
    """Tensor-parallel plan: module-name pattern (``fnmatch``, e.g. ``"mlp.*.fc1"``) to a style
    of :data:`PLAN_STYLES`; the first matching pattern wins. The usual pair: ``colwise``
    (output features split over tp; input enters the tp region) followed, through element-wise
    ops only, by the ``rowwise`` layer that consumes its split output (input features split,
    outputs summed over tp, bias added once after the sum), as in Megatron-LM's MLP. Needed
    when ``"tp"`` is in :attr:`layouts`; :meth:`plan` returns it."""

    def plan(self, cfg) -> dict[str, str]:
        """The tensor-parallel plan for ``cfg`` (override when it depends on the config, e.g.
        which layers are mixture-of-experts). Default: :attr:`tp_plan`."""
        return dict(self.tp_plan)

    def attention(self, model: nn.Module) -> list[nn.Module]:
        """Attention modules whose core context parallelism replaces: each has an ``attend``
        attribute (None: its own causal attention over ``(q, k, v)`` of shape ``[b, heads,
        s, d]``; the engine sets a callable computing the same over the cp-sharded sequence).
        Needed when ``"cp"`` is in :attr:`layouts`. Default: every submodule with ``attend``."""
        return [m for m in model.modules() if hasattr(m, "attend")]

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The repeated blocks ``train.compile`` compiles one by one (regional compilation) and
        ``train.recompute = "full"`` recomputes one by one in backward. Default: :meth:`units`."""
        return self.units(model)

    recompute_modes: frozenset[str] = frozenset({"none", "full"})
    """``train.recompute`` modes this family supports (others are refused before launch)."""

    def apply_recompute(self, model: nn.Module, mode: str) -> None:
        """Make ``model`` recompute activations in backward instead of keeping them: ``full``
        runs each of :meth:`blocks` under ``torch.utils.checkpoint`` (only its input is kept;
        its forward runs again, through the module's hooks, when backward reaches it)."""
        if mode == "full":
            for block in self.blocks(model):
                recompute_block(block)

    def build(self, cfg) -> nn.Module:
        """The model for ``cfg`` (a :class:`chipset.train.config.RunConfig`), float32, on the CPU.

        The engine seeds torch's generator with ``train.seed`` before calling, so every rank
        builds the same weights. Before launch it calls ``build`` inside
        ``torch.device("meta")`` to check the layout without allocating: build must not read
        parameter values (create them only).
        """
        raise NotImplementedError(f"model family {self.name!r} does not implement build(cfg)")

    def units(self, model: nn.Module) -> list[nn.Module]:
        """Submodules gathered one at a time under ZeRO-3; together they must hold every
        parameter exactly once. Default: ``model.units()`` if the module has it, else its
        top-level children with parameters."""
        own = getattr(type(model), "units", None)
        if callable(own):
            return list(own(model))
        return [m for m in model.children() if any(True for _ in m.parameters())]

    def pipeline_units(self, model: nn.Module) -> list[nn.Module]:
        """The model as a chain for pipeline parallelism: submodules that, applied one after
        another, compute ``model(inputs)`` (``units[-1](...units[0](inputs))``), each taking and
        returning one tensor. Pipeline stages are contiguous runs of them, balanced by
        parameter count or given by ``parallel.pipeline_split`` (units per virtual stage); the
        last stage applies :meth:`output_loss`. Needed when ``"pp"`` is in :attr:`layouts`.
        Default: :meth:`units`, so a family whose ZeRO-3 units already chain needs nothing more."""
        return self.units(model)

    def pipeline_counts(self, model: nn.Module, text: str, parts: int) -> list[int]:
        """Units per virtual stage for ``parallel.pipeline_split = text`` (``parts`` =
        pp x virtual_stages entries), ConfigError when it does not fit. Default: the text
        counts pipeline units, at least one per stage, summing to the chain's length."""
        from chipset.parallel.stages import parse_unit_split

        return parse_unit_split(text, parts, len(self.pipeline_units(model)))

    def aux_loss(self, model: nn.Module, units: list[nn.Module]) -> torch.Tensor | None:
        """Extra loss terms the modules ``units`` added in their last forward (a mixture of
        experts' load-balancing loss, say), weighted and summed; None when there are none. A
        pipeline stage adds those of its own units to its backward. Default: ``model.aux_loss
        (units)`` if the module has it, else None."""
        own = getattr(type(model), "aux_loss", None)
        return own(model, units) if callable(own) else None

    def unit_shapes(self, cfg, inputs: torch.Tensor) -> list[torch.Size]:
        """The output shape of each of :meth:`pipeline_units` for a micro-batch shaped like
        ``inputs`` (whole sequences: the engine divides dimension 1 under context and sequence
        parallelism); the tensors pipeline stages exchange are allocated from it. Default:
        found by building the model for ``cfg`` and running the chain on the meta device (no
        memory, no communication). Override it when a unit cannot run there (data-dependent
        shapes such as a mixture of experts' routing)."""
        return meta_unit_shapes(self, cfg, inputs)

    def output_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Scalar mean loss of a micro-batch from the model's outputs. The default :meth:`loss`
        and the last pipeline stage use it. Default: cross-entropy of the logits (classes last)
        against ``targets``, in float32."""
        return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]).float(), targets.reshape(-1))

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Scalar mean loss of one micro-batch. Default: ``model.loss`` if the module has it,
        else :meth:`output_loss` of ``model(inputs)`` (the vocabulary-parallel cross-entropy
        instead when the plan's ``vocab_head`` split the logits). Under pp the engine computes
        the same from the last unit's output: keep the two consistent."""
        own = getattr(type(model), "loss", None)
        if callable(own):
            return own(model, inputs, targets)
        return model_output_loss(self, model)(model(inputs), targets)

    def data(self, cfg):
        """The training data: an object with ``batch(step, dp_rank, dp, micro, micro_batches,
        device=None) -> (inputs, targets)`` returning this rank's share of the global batch
        (``train.global_batch // dp // micro_batches`` samples), the same for a given step on
        every layout. Default: token sequences (``data.*``, docs/data.md)."""
        from chipset.data.datasets import make_dataset

        return make_dataset(cfg)

    def eval_data(self, cfg):
        """Held-out data for ``train.eval_every``, with the interface of :meth:`data`; batch ``i``
        must be the same at every evaluation. Default: the held-out part of the token data
        (``data.eval_path`` / ``data.eval_fraction``) when the family trains on the default
        token data; a family with its own :meth:`data` overrides this to evaluate."""
        from chipset.data.datasets import make_eval_dataset

        return make_eval_dataset(cfg)

    def eval_metrics(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """Scalar tensors of one held-out batch, averaged over the evaluation's batches and the dp
        ranks and logged as ``eval_<name>``; ``loss`` is required. Default: the training loss; a
        classifier adds ``accuracy`` (:func:`classifier_metrics`)."""
        return {"loss": self.loss(model, inputs, targets)}

    def throughput(self, cfg) -> tuple[str, int]:
        """``(unit, per sample)`` of the throughput the console and metrics report: ``("tokens",
        train.seq_len)`` for token sequences (the default), ``("samples", 1)`` for a family whose
        sample is not a sequence (images), so its rate is not a meaningless tokens/s. Default:
        tokens for the default token data, samples for a family with its own :meth:`data`."""
        return ("tokens", cfg.train.seq_len) if type(self).data is ModelFamily.data else ("samples", 1)

    @property
    def evaluates(self) -> bool:
        """Whether ``train.eval_every`` can evaluate this family: it has held-out data, its own
        :meth:`eval_data` or the default one of the default token data."""
        cls = type(self)
        return cls.eval_data is not ModelFamily.eval_data or cls.data is ModelFamily.data

    described_by_planner: bool = False
    """Whether the planner's decoder spec (planner/model.py, read from ``cfg.model``) describes this
    family's models: the memory preflight before launch and the MFU of a run then use it; else
    MFU comes from :meth:`flops_per_sample` and the run has no memory estimate before launch."""

    def pipeline_unit_count(self, cfg) -> int | None:
        """How many pipeline units the model of ``cfg`` has, when known without building it (lets
        config validation skip building a schedule that cannot fit). Default: unknown."""
        return None

    def config_problems(self, cfg) -> list[str]:
        """Rules of this family's ``[model]`` keys, alone and with the layout, checked by the run
        configuration's validation (before launch, with exit 2). Default: none."""
        return []

    def layout_problems(self, cfg) -> list[str]:
        """Why this family cannot run ``cfg``'s layout beyond the layout names (see
        :func:`layout_problems`): :meth:`problems`, recompute modes, evaluation, and the
        tensor-parallel plan and pipeline chain checked on the model built on the meta device."""
        return _layout_checks(self, cfg)

    def problems(self, cfg) -> list[str]:
        """What this family cannot run in ``cfg`` beyond the layout (for example a data source
        it does not read): each a sentence saying what was found and what to do. Checked with
        the layout before launch, so a bad config exits 2 before any rank starts. Default: none,
        except that the default token data cannot read ``data.source = "images"``."""
        if cfg.data.source == "images":
            return [f"data.source = 'images': model family {self.name!r} reads token sequences (data.*); "
                    "images are for an image family such as resnet"]
        return []

    def flops_per_sample(self, cfg) -> float:
        """Training FLOPs (forward + backward) of one sample, for MFU and the planner.
        Default: 6 x parameters, the dense rule of thumb, counted on the meta device."""
        with on_meta():
            model = self.build(cfg)
        return 6.0 * sum(p.numel() for p in model.parameters())


def classifier_metrics(family: ModelFamily, model: nn.Module, inputs: torch.Tensor,
                       targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Loss and top-1 accuracy of a model whose output is class logits ``(batch, classes)``."""
    logits = model(inputs)
    loss = model_output_loss(family, model)(logits, targets)
    return {"loss": loss, "accuracy": (logits.argmax(-1) == targets).float().mean()}


def recompute_block(block: nn.Module) -> None:
    """Run ``block`` under non-reentrant activation checkpointing whenever gradients are on.

    The checkpointed function calls the module again (``block(...)``), so its forward hooks
    (ZeRO-3's gather and release) run in the forward and again in the recomputation; a flag
    makes that inner call run the original forward."""
    from torch.utils.checkpoint import checkpoint

    forward = block.forward
    inside = [False]

    def run(*args, **kwargs):
        inside[0] = True
        try:
            return block(*args, **kwargs)
        finally:
            inside[0] = False

    def checkpointed(*args, **kwargs):
        if inside[0] or not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(run, *args, use_reentrant=False, **kwargs)

    block.forward = checkpointed


def model_output_loss(family: ModelFamily, model: nn.Module):
    """``family.output_loss``, or the engine's vocabulary-parallel cross-entropy once a tensor-
    parallel plan split ``model``'s logits over the vocabulary (held by the split ``vocab_head``:
    :func:`chipset.parallel.tensor.vocab_parallel_loss`): logits that are one rank's slice need
    the loss that sums over tp ranks. A module with its own ``output_loss`` method computes it itself."""

    own = getattr(type(model), "output_loss", None)
    if callable(own):  # the module computes it itself (the built-in transformer)
        return lambda outputs, targets: own(model, outputs, targets)

    def output_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        split = vocab_parallel_loss(model)
        if split is not None:
            return split(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))
        return family.output_loss(outputs, targets)

    return output_loss


class BoundModel:
    """A model and the family that describes it: everything the engine asks of a model.

    The engine trains :attr:`module` and calls these methods for what it needs beyond the
    module's forward (ZeRO-3's gather units, the loss, the pipeline chain). The module itself is
    left as the user built it: chipset adds no attribute to it, its class and parameter names
    (the checkpoint's names) stay unchanged. Each method is the family's method of the same
    name applied to :attr:`module`; :meth:`loss` is the one place the engine computes a
    micro-batch's loss from (the pipeline's last stage: :meth:`output_loss` of the last unit's
    output, which the family keeps consistent with :meth:`loss`).
    """

    def __init__(self, family: ModelFamily, module: nn.Module, cfg=None, *, loss=None):
        self.family = family
        self.module = module
        """The user's model (this rank's share once the engine split it)."""
        self.cfg = cfg
        """The run configuration (:meth:`unit_shapes` needs it; None: no pipeline shapes)."""
        self._loss = loss  # None: the family's (see with_loss)

    def units(self) -> list[nn.Module]:
        """Submodules ZeRO-3 gathers one at a time (``family.units``)."""
        return list(self.family.units(self.module))

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor, **kwargs) -> torch.Tensor:
        """Scalar mean loss of one micro-batch (``family.loss``, or the objective :meth:`with_loss` gave)."""
        if self._loss is not None:
            return self._loss(inputs, targets)
        return self.family.loss(self.module, inputs, targets, **kwargs)

    def output_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss from the model's outputs (``family.output_loss``, or the vocabulary-parallel
        cross-entropy once a tensor-parallel plan split the logits): the last pipeline stage's."""
        return model_output_loss(self.family, self.module)(outputs, targets)

    def pipeline_units(self) -> list[nn.Module]:
        """The model as a chain for pipeline parallelism (``family.pipeline_units``)."""
        return list(self.family.pipeline_units(self.module))

    def pipeline_counts(self, text: str, parts: int) -> list[int]:
        """Units per virtual stage for ``parallel.pipeline_split = text`` (``family.pipeline_counts``)."""
        return self.family.pipeline_counts(self.module, text, parts)

    def aux_loss(self, units: list[nn.Module]) -> torch.Tensor | None:
        """Extra loss terms ``units`` added in their last forward (``family.aux_loss``)."""
        return self.family.aux_loss(self.module, units)

    def unit_shapes(self, inputs: torch.Tensor) -> list[torch.Size]:
        """Each pipeline unit's output shape for a micro-batch shaped like ``inputs``
        (``family.unit_shapes(cfg, inputs)``)."""
        if self.cfg is None:
            raise TypeError("unit_shapes needs the run configuration: bind(family, model, cfg)")
        own = getattr(self.family, "unit_shapes", None)  # a duck-typed family may lack it
        return own(self.cfg, inputs) if callable(own) else meta_unit_shapes(self.family, self.cfg, inputs)

    def with_loss(self, loss) -> BoundModel:
        """The same model and family with ``loss(inputs, targets)`` as the micro-batch loss (an
        objective other than the family's, e.g. ``chipset.api.per_token_loss``)."""
        return BoundModel(self.family, self.module, self.cfg, loss=loss)


def bind(family: ModelFamily, model: nn.Module, cfg=None) -> BoundModel:
    """``model`` paired with ``family`` (and the run's ``cfg``): what the engine trains."""
    return BoundModel(family, model, cfg)


def build_for(family: ModelFamily, cfg, kernels=None) -> nn.Module:
    """``family.build(cfg)`` (the built-in transformer also takes its kernel set)."""
    if isinstance(family, TransformerFamily):
        return family.build(cfg, kernels)
    return family.build(cfg)


def meta_model(family: ModelFamily, cfg, kernels=None) -> nn.Module:
    """``family``'s model for ``cfg`` on the meta device (shapes and names only, nothing
    allocated); ``kernels`` is the built-in transformer's kernel set. :func:`bind` it for the
    pipeline chain."""
    with on_meta():
        return build_for(family, cfg, kernels)


@torch.no_grad()
def meta_unit_shapes(family: ModelFamily, cfg, inputs: torch.Tensor) -> list[torch.Size]:
    """The output shape of each of ``family.pipeline_units`` for a micro-batch shaped like
    ``inputs``, from the unsplit model built and run on the meta device."""
    with on_meta():
        model = family.build(cfg)
    x = torch.empty(inputs.shape, dtype=inputs.dtype, device="meta")
    shapes = []
    for unit in family.pipeline_units(model):
        x = unit(x)
        shapes.append(x.shape)
    return shapes


def requested_layouts(cfg) -> list[str]:
    """The layout names ``cfg.parallel`` asks for (dp is always there)."""
    par = cfg.parallel
    out = ["dp"]
    if par.zero:
        out.append(f"zero{par.zero}")
    out += [k for k in ("tp", "pp", "ep", "cp") if getattr(par, k) > 1]
    if par.sequence_parallel and par.tp > 1:
        out.append("sp")
    return out


def layout_problems(family: ModelFamily, cfg) -> list[str]:
    """Why ``cfg``'s layout cannot run ``family`` (empty: it can). Checked before launch."""
    problems = []
    missing = [x for x in requested_layouts(cfg) if x not in family.layouts]
    if missing:
        problems.append(f"model family {family.name!r} does not support {', '.join(missing)} "
                        f"(it supports {', '.join(x for x in LAYOUTS if x in family.layouts)}); "
                        "change parallel.* or use a family that does")
    own = getattr(family, "layout_problems", None)  # ModelFamily subclasses; a duck-typed family gets the checks
    problems += own(cfg) if callable(own) else _layout_checks(family, cfg)
    if not problems and getattr(cfg.model, "lora_rank", 0) > 0:
        from chipset.parallel.lora import target_patterns, target_problems

        problems += target_problems(meta_model(family, cfg), target_patterns(cfg, family))
    return problems


def _layout_checks(family, cfg) -> list[str]:
    """The checks every family gets unless it declares its own (ModelFamily.layout_problems)."""
    problems = []
    if getattr(family, "config_class", None) is not None:
        try:
            family.options(cfg)
        except (TypeError, ValueError) as exc:  # the dataclass's own rules (__post_init__)
            problems.append(f"[model]: model family {family.name!r} refuses its keys: {exc}")
    problems += list(family.problems(cfg)) if callable(getattr(family, "problems", None)) else []
    modes = getattr(family, "recompute_modes", frozenset({"none"}))
    if cfg.train.recompute not in modes:
        problems.append(f"train.recompute = {cfg.train.recompute!r}: model family {family.name!r} supports "
                        f"{', '.join(sorted(modes))}; use one of those")
    if cfg.train.eval_every and not getattr(family, "evaluates", False):
        problems.append(f"train.eval_every = {cfg.train.eval_every}: model family {family.name!r} has its own data() "
                        "but no eval_data(cfg) for held-out data; define eval_data (docs/models.md) or use 0")
    if not problems and "tp" in family.layouts and cfg.parallel.tp > 1:
        problems += plan_problems(family, cfg)
    if not problems and "pp" in family.layouts and cfg.parallel.pp > 1:
        from chipset.parallel.stages import chain_problems

        problems += chain_problems(bind(family, meta_model(family, cfg), cfg), cfg.parallel)
    return problems


def family_pipeline_units(family, cfg) -> int | None:
    """``family.pipeline_unit_count(cfg)`` (None for a duck-typed family without it)."""
    own = getattr(family, "pipeline_unit_count", None)
    return own(cfg) if callable(own) else None


def family_data(family, cfg):
    """The family's training data (``family.data(cfg)``; a duck-typed family without ``data`` reads
    token sequences, as :meth:`ModelFamily.data` does)."""
    own = getattr(family, "data", None)
    if callable(own):
        return own(cfg)
    from chipset.data.datasets import make_dataset

    return make_dataset(cfg)


def build_for_run(family, cfg, kernels=None) -> nn.Module:
    """The model a run trains, with ``train.seed`` seeding torch's generator (the same weights on
    every rank; the generator's state is restored after). With ``model.init_from`` it is built on
    the meta device: the weights come from the files into each rank's shards, so no rank holds
    or initialises the whole model."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.train.seed)
        with on_meta() if cfg.model.init_from else contextlib.nullcontext():
            return build_for(family, cfg, kernels)


def plan_problems(family: ModelFamily, cfg) -> list[str]:
    """Problems of ``family.plan(cfg)`` on the model of ``cfg``, built on the meta device."""
    tp = cfg.parallel.tp
    plan = family.plan(cfg)
    bad = [f"{p} = {s!r}" for p, s in plan.items() if s not in PLAN_STYLES]
    if bad:
        return [f"model family {family.name!r}: tp_plan entries {', '.join(bad)}: expected "
                f"{', '.join(PLAN_STYLES)}"]
    with on_meta():
        model = family.build(cfg)
    modules = dict(model.named_modules())
    matched = plan_matches(model, plan)
    problems = []
    if not any(s in ("colwise", "colwise_in_region", "rowwise", "vocab_head", "vocab_head_in_region",
                     "vocab_embedding") for s in matched.values()):
        problems.append(f"model family {family.name!r}: tp_plan splits no module of the model; "
                        "name its nn.Linear layers colwise/rowwise or use parallel.tp = 1")
    for name, style in matched.items():
        mod = modules[name]
        need = {"colwise": nn.Linear, "colwise_in_region": nn.Linear, "rowwise": nn.Linear,
                "vocab_head": nn.Linear, "vocab_head_in_region": nn.Linear,
                "vocab_embedding": nn.Embedding}.get(style)
        if need is not None and type(mod) is not need:
            problems.append(f"tp_plan: {name} is {type(mod).__name__}; only nn.{need.__name__} can be {style}")
            continue
        if style in ("colwise", "colwise_in_region", "rowwise"):
            size = mod.out_features if style != "rowwise" else mod.in_features
            if size % tp:
                what = "out_features" if style != "rowwise" else "in_features"
                problems.append(f"tp_plan: {name} ({style}) has {what} = {size}, not divisible by "
                                f"parallel.tp = {tp}; choose a tp that divides it")
    return problems


class TransformerFamily(ModelFamily):
    """The built-in decoder (chipset.models.transformer), with MoE and Hugging Face configs.

    It goes through the same contract as any family: its tensor-parallel plan, attention
    modules, blocks and pipeline chain (``Transformer.units``: embedding, blocks, head). It
    supports every layout; expert parallelism finds its MoE layers by type.
    """

    name = "transformer"
    layouts = frozenset(LAYOUTS)
    described_by_planner = True

    def pipeline_unit_count(self, cfg) -> int:
        return cfg.model.num_hidden_layers + 2  # embedding, each block, head

    def config_problems(self, cfg) -> list[str]:
        """The decoder's rules (models/transformer_rules.py) and those of a Hugging Face config
        it was translated from (models/hf/config.py); data.source = 'images' is refused."""
        from chipset.models.hf.config import model_problems
        from chipset.models.transformer_rules import (
            attention_problems,
            moe_problems,
            pipeline_split_problems,
            tp_cp_problems,
        )

        m, par, tr = cfg.model, cfg.parallel, cfg.train
        problems = attention_problems(m, tr) + tp_cp_problems(m, par, tr)
        if par.pp > 1:
            problems += pipeline_split_problems(m, par)
        if cfg.data.source == "images":
            problems.append("data.source = 'images' is for an image model family (model.family = \"resnet\"); "
                            "the built-in transformer reads synthetic, text, tokens or hf")
        return problems + moe_problems(m, par) + model_problems(m, tr.seq_len, par.pp, par.zero)

    def layout_problems(self, cfg) -> list[str]:
        """None beyond :meth:`config_problems`: its rules already cover the layout (the plan and
        the chain are the decoder's own, so they fit whenever those rules pass)."""
        return []

    def build(self, cfg, kernels=None) -> nn.Module:
        from chipset.models.transformer import Transformer

        return Transformer(cfg.model, kernels, seed=cfg.train.seed)

    def plan(self, cfg) -> dict[str, str]:
        """Megatron-LM's split, one tp region per norm: the norm in front of q, k, v (gate, up;
        the logits) enters the region once for all of them. Vocabulary-parallel embedding and
        logits (with their loss). Mixture-of-experts layers are replicated over tp (with
        sequence parallelism they see whole sequences): parallel/moe.py says why."""
        from chipset.layers.moe import is_moe_layer

        m = cfg.model
        out = {"embed_tokens": "vocab_embedding", "head.norm": "region_norm", "head.lm_head": "vocab_head_in_region"}
        for i in range(m.num_hidden_layers):
            b = f"layers.{i}"
            out[f"{b}.input_layernorm"] = "region_norm"
            for x in ("q_proj", "k_proj", "v_proj"):
                out[f"{b}.self_attn.{x}"] = "colwise_in_region"
            out[f"{b}.self_attn.o_proj"] = "rowwise"
            if m.qk_norm:  # per-head norms see this rank's heads
                out[f"{b}.self_attn.q_norm"] = out[f"{b}.self_attn.k_norm"] = "head_norm"
            if is_moe_layer(m, i):
                out[f"{b}.post_attention_layernorm"] = "sequence_norm"
                out[f"{b}.mlp"] = "sequence_gathered"
            else:
                out[f"{b}.post_attention_layernorm"] = "region_norm"
                out[f"{b}.mlp.gate_proj"] = out[f"{b}.mlp.up_proj"] = "colwise_in_region"
                out[f"{b}.mlp.down_proj"] = "rowwise"
        return out

    recompute_modes = frozenset({"none", "selective", "full"})

    def apply_recompute(self, model: nn.Module, mode: str) -> None:
        """``selective``: each attention module recomputes its core (the s x s scores) in
        backward; ``full``: each block is recomputed, as for any family."""
        for m in model.modules():
            if hasattr(m, "recompute_core"):
                m.recompute_core = mode == "selective"
        super().apply_recompute(model, mode)

    def loss(self, model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, aux: bool = True) -> torch.Tensor:
        """The decoder's own loss; ``aux = False`` (evaluation) leaves out the MoE balancing loss."""
        return type(model).loss(model, tokens, targets, aux)

    def eval_metrics(self, model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """The language-model cross-entropy alone (no MoE balancing term), so exp(loss) is the perplexity."""
        return {"loss": self.loss(model, tokens, targets, aux=False)}

    def unit_shapes(self, cfg, inputs: torch.Tensor) -> list[torch.Size]:
        """Hidden states ``(batch, seq, hidden)`` out of the embedding and every block, logits out
        of the head (a MoE layer's routing cannot run on the meta device)."""
        b, s = inputs.shape
        m = cfg.model
        return [torch.Size((b, s, m.hidden_size))] * (m.num_hidden_layers + 1) + [torch.Size((b, s, m.vocab_size))]

    def pipeline_counts(self, model: nn.Module, text: str, parts: int) -> list[int]:
        """``parallel.pipeline_split`` counts blocks here (``"3,2,2,1"``): the embedding joins
        the first virtual stage and the head the last, which may hold no block."""
        from chipset.parallel.split import parse_split

        counts = parse_split(text, parts, len(model.layers))
        counts[0] += 1
        counts[-1] += 1
        return counts

    def attention(self, model: nn.Module) -> list[nn.Module]:
        return [block.self_attn for block in model.layers]

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(model.layers)
