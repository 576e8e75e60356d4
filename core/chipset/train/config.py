"""Typed run configuration: TOML file + ``--set section.key=value`` overrides -> dataclasses.

The file, the command-line overrides and the Python API all land in the same
dataclasses (:class:`RunConfig` and its sections). Every problem found is collected and
raised together as one :class:`chipset.ConfigError` (exit code 2) that names the key,
the value found and what was expected.

TOML is read with the standard library's ``tomllib`` (Python >= 3.11) or the ``tomli``
package on Python 3.10.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

from chipset.errors import ConfigError
from chipset.models.config import ModelConfig
from chipset.models.family import family_pipeline_units
from chipset.models.registry import resolve_family
from chipset.parallel.context import CP_ATTENTION
from chipset.parallel.defaults import DEFAULT_CP_ATTENTION, DEFAULT_SEQUENCE_PARALLEL
from chipset.parallel.fp8 import FP8_MODES
from chipset.parallel.recompute import RECOMPUTE
from chipset.preflight import read_text_file, value_problems
from chipset.runtime.bf16_update import BF16_UPDATES
from chipset.runtime.optim import OPTIMIZERS, STATE_DTYPES
from chipset.runtime.precision import DTYPE_BY_NAME
from chipset.train.islands.config import (
    IslandsConfig,
    client_data_problems,
    client_paths,
    island_problems,
)

log = logging.getLogger(__name__)

__all__ = [
    "ModelConfig",
    "ParallelConfig",
    "TrainConfig",
    "DataConfig",
    "RLConfig",
    "IslandsConfig",
    "RunConfig",
    "load_config",
    "resolve_config",
    "parse_overrides",
    "to_toml",
    "DTYPES",
    "RECOMPUTE",
]

DTYPES = tuple(DTYPE_BY_NAME)  # declared once, with the torch dtypes (runtime/precision.py)
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}
DATA_SOURCES = ("synthetic", "text", "tokens", "hf", "images")
LR_SCHEDULES = ("constant", "linear", "cosine", "wsd")
MASTER_WEIGHTS = ("float32", "none")


@dataclass
class ParallelConfig:
    """How the job is split across ranks: dp (with zero 0..3), tp (+ sequence parallel), pp, cp and ep in any combination (dp*tp*pp*cp is the world size; ep groups are carved out of dp*cp)."""

    dp: int = 0
    """Data-parallel degree; 0 means world size / (tp*pp*cp)."""
    tp: int = 1
    """Tensor-parallel degree: attention heads, kv heads and the MLP width are split over tp ranks; must divide each."""
    pp: int = 1
    """Pipeline-parallel degree: the model is cut into pp stages (embedding first, head+loss last), see schedule."""
    ep: int = 1
    """Expert-parallel degree: experts sharded over ep ranks carved out of dp x cp (needs model.num_experts divisible by ep)."""
    cp: int = 1
    """Context-parallel degree: each sequence is split over cp ranks (2*cp chunks, load-balanced causal attention)."""
    zero: int = 0
    """ZeRO stage: 0 replicate everything, 1 shard optimizer state, 2 also gradients, 3 also parameters."""
    micro_batches: int = 1
    """Gradient-accumulation micro-batches per step; gradients are communicated after the last."""
    bucket_mb: float = 25.0
    """Gradient bucket size in MiB for zero 0..2 (zero 3 uses one bucket per layer)."""
    offload_optimizer: bool = False
    """Keep the fp32 master weights and Adam state on the host (ZeRO-Offload style)."""
    sequence_parallel: bool = DEFAULT_SEQUENCE_PARALLEL
    """With tp > 1: split norm regions along the sequence over tp (reduce-scatter/all-gather instead of all-reduce)."""
    cp_attention: str = DEFAULT_CP_ATTENTION
    """With cp > 1: allgather (all-gather K/V over cp), ring (pass K/V blocks around the cp ring, one fused attention block per step merged by log-sum-exp), ulysses (all-to-all from a sequence split to a head split and back; heads/tp must divide by cp) or hybrid (Ulysses inside groups of cp_ulysses adjacent cp ranks, ring across them). docs/long-context.md says which to use."""
    cp_ulysses: int = 0
    """With cp_attention = "hybrid": the Ulysses degree inside the cp group (adjacent cp ranks; heads/tp must divide by it); the ring runs over cp/cp_ulysses groups. 0 = not hybrid."""
    schedule: str = "1f1b"
    """With pp > 1: pipeline schedule gpipe, 1f1b, interleaved_1f1b, zero_bubble or zbv (with virtual_stages = 2) (docs/engine.md, `chipset train --print-schedule`)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank; > 1 only with schedule interleaved_1f1b (bubble (pp-1)/(v*m)) and zbv (exactly 2)."""
    pipeline_split: str = ""
    """Blocks per virtual stage, e.g. "3,1" (pp*virtual_stages entries); empty = balanced by parameter count."""


@dataclass
class TrainConfig:
    """The optimisation loop."""

    steps: int = 20
    """Optimizer steps to run."""
    global_batch: int = 8
    """Sequences per optimizer step across all data-parallel ranks and micro-batches."""
    seq_len: int = 16
    """Tokens per sequence."""
    lr: float = 1e-2
    """Peak AdamW learning rate."""
    warmup_steps: int = 0
    """Linear warm-up steps (from lr/warmup_steps to lr) before the schedule."""
    lr_schedule: str = "constant"
    """After warm-up: constant, linear (to min_lr at the last step), cosine (to min_lr) or wsd (stable at lr, then linear to min_lr over the last decay_fraction of the steps)."""
    min_lr: float = 0.0
    """The learning rate the linear, cosine and wsd schedules end at."""
    decay_fraction: float = 0.2
    """wsd: fraction of the post-warm-up steps spent decaying."""
    weight_decay: float = 0.0
    """Decoupled AdamW weight decay."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW epsilon."""
    optimizer: str = "adamw"
    """adamw, sgd (SGD with momentum; train.momentum, train.nesterov, train.weight_decay) or muon (Muon on hidden matrices, AdamW elsewhere; train.muon_*): docs/engine.md, "Optimizers"."""
    momentum: float = 0.9
    """SGD momentum (0: plain SGD, which keeps no optimizer state)."""
    nesterov: bool = False
    """SGD: Nesterov momentum."""
    optimizer_state_dtype: str = "float32"
    """The dtype optimizer state (Adam moments, momentum) is stored in: float32, bfloat16 (half the bytes; updated in float32, rounded to nearest) or int8 (blockwise-quantised, about a quarter of the bytes: 256-element blocks with a float32 absmax scale each, the second moment stored as its square root; docs/engine.md, "Lighter optimizer state")."""
    master_weights: str = "float32"
    """float32: the optimizer updates float32 master weights and copies them into the parameters; none (train.dtype = "bfloat16", layouts of dp and ZeRO 0-3 only): the bfloat16 parameters are the only copy, updated as train.bf16_update says, 4 bytes per parameter lighter (docs/engine.md, "Training without master weights")."""
    bf16_update: str = "stochastic"
    """With master_weights = "none": how each float32 update is written into the bfloat16 parameters: stochastic (rounded up or down, exact on average; seeded by train.seed), kahan (a bfloat16 compensation buffer per parameter keeps what rounding dropped: 2 bytes per parameter, checkpointed) or nearest (plain rounding: updates below half a bfloat16 step are lost; for comparison)."""
    muon_momentum: float = 0.95
    """Muon: momentum of the hidden matrices' update (their AdamW half uses beta1/beta2)."""
    muon_nesterov: bool = True
    """Muon: Nesterov momentum."""
    muon_ns_steps: int = 5
    """Muon: Newton-Schulz iterations orthogonalising each matrix's update."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    seed: int = 1234
    """Seed of parameter initialisation and data."""
    dtype: str = "float32"
    """Compute dtype: float32, bfloat16 or float16 (master weights stay float32 unless train.master_weights = "none"); auto = the backend's default compute dtype (bfloat16 on cuda and ascend devices with bf16, float32 on the CPU backends, where bf16 is about 6x slower): `chipset info` shows it."""
    fp8: str = "off"
    """FP8 training: off, tensorwise or rowwise (the scaling of the FP8 GEMMs): the attention and MLP projections run their forward and backward GEMMs in FP8 through the backend's fp8_matmul kernel; weights, gradients and optimizer stay in train.dtype. Only on a backend declaring the scaling (Capabilities.fp8): docs/engine.md, "FP8 training"."""
    fp8_all_gather: bool = True
    """With train.fp8 = tensorwise and parallel.zero = 3: gather the FP8 projections' weights in FP8 (1 byte a parameter; each rank quantises its shard with the whole weight's scale, the GEMMs read the gathered bytes as they are: the same run bit for bit). False gathers them in train.dtype. No effect otherwise (rowwise, zero < 3): docs/engine.md, "FP8 all-gather under ZeRO-3"."""
    loss_scale: float = 0.0
    """float16 only: 0 = dynamic loss scaling, > 0 = this fixed scale."""
    initial_loss_scale: float = 2.0**16
    """float16 dynamic scaling: the starting scale."""
    loss_scale_window: int = 1000
    """float16 dynamic scaling: clean steps before the scale doubles."""
    hysteresis: int = 2
    """float16 dynamic scaling: overflows tolerated before the scale halves."""
    min_loss_scale: float = 1.0
    """float16 dynamic scaling: the floor of the scale."""
    recompute: str = "none"
    """Activation recompute: none, selective (attention core) or full (whole blocks)."""
    loss_chunk: int = 0
    """Tokens per chunk of the output head and loss: the logits of at most this many tokens exist at once (forward and backward), so [tokens x vocab] is never materialised whole; 0 = all tokens at once. Built-in transformer, pp = 1."""
    offload_activations: bool = False
    """Keep the activations each block saves for backward in host memory (copied back when backward needs them; on a side stream where the backend has streams), trading transfer time for device memory on long sequences. Built-in transformer, pp = 1."""
    compile: bool = False
    """Compile each transformer block with torch.compile (regional compilation) using the compile backend the backend plugin declares; refused (exit 2) where it declares none."""
    eval_every: int = 0
    """Evaluate on held-out data every N steps and after the last step (0 = never); see data.eval_path / data.eval_fraction."""
    eval_steps: int = 10
    """Batches of train.global_batch sequences per evaluation. More sequences than the held-out data has windows: the windows repeat and the run starts with a warning naming the eval_steps that fits."""
    log_every: int = 1
    """Print a progress line every N steps on rank 0."""
    checkpoint_every: int = 500
    """Write a checkpoint to RUN_DIR/checkpoints every N steps and after the last step (0 = never).

    On by default so a crash loses at most N steps; see docs/fault-tolerance.md for why 500."""
    keep_checkpoints: int = 3
    """Keep only the newest N complete checkpoints (0 = keep all)."""
    async_checkpoint: bool = False
    """Write checkpoints in a background thread so training continues (the state is copied to host first)."""
    profile_steps: str = ""
    """Steps FIRST:LAST (1-based, inclusive) to record a torch.profiler Chrome trace per rank into RUN_DIR/traces; empty = off."""
    metrics_sinks: str = "auto"
    """Where rank 0 also sends each step's metrics, comma-separated: tensorboard, wandb, mlflow or a chipset.metrics_sinks entry point's name; auto = tensorboard when it is installed; none = metrics.jsonl only."""
    max_nonfinite_steps: int = 20
    """Stop the run (exit 1) after this many consecutive steps with a NaN/inf loss or a skipped (overflowed) update; 0 = never."""
    replica_check_every: int = 1
    """Every N steps each rank records a checksum of its parameters (metrics.jsonl param_sum) so chipset diagnose can tell when data-parallel replicas stop being bit-identical; one read of the local parameters per check; 0 = off. Not computed where there is nothing to compare: under parallel.zero = 3 (no replica holds whole parameters) and where no rank has a data-parallel replica (one process; pp, tp or cp without dp)."""


@dataclass
class DataConfig:
    """Where tokens come from."""

    source: str = "synthetic"
    """Token source: synthetic (a seeded, learnable token stream), text (bytes of local text files, vocab 256) tokens (a folder made by `chipset data prepare`, or a flat uint16 .bin file) or hf (a local Hugging Face dataset saved with save_to_disk, tokenized once with data.tokenizer into a cache; needs the datasets package). Image families: synthetic, or images (data.path: one sub-folder of images per class; needs Pillow)."""
    path: str = ""
    """text: a file or folder of .py/.txt/.md/.rst files (empty = the Python standard library's sources); tokens: the prepared folder or .bin file; hf: the saved dataset folder; images: a folder of class sub-folders. Relative paths in a config file are resolved against the file's folder."""
    max_bytes: int = 1 << 20
    """text: read at most this many bytes."""
    tokenizer: str = ""
    """hf: the tokenizer.json (or a model directory holding one) that tokenizes the dataset."""
    field: str = "text"
    """hf: the dataset column holding the text."""
    seed: int = 0
    """Seed of the data stream (independent of train.seed)."""
    eval_path: str = ""
    """Held-out data for evaluation, in the same form as data.path (tokens: a prepared folder or .bin file); empty = use data.eval_fraction."""
    eval_fraction: float = 0.0
    """tokens: hold out this fraction of the data.path windows for evaluation (the end of the stream, never trained on); synthetic: evaluate on sequences of the same walk that training never reads."""
    blend: str = ""
    """tokens: several sources mixed by weight, one string of WEIGHT:PATH entries separated by commas, the weights summing to 1 (e.g. "0.7:wiki, 0.3:/data/code_text_document"); each PATH is a prepared folder, a .bin file or a Megatron PREFIX, a relative one resolved against data.path (then the folder of the sources). Deterministic: a step's batch is the same on every layout and after a resume. Empty = data.path alone."""
    eos_id: int = -1
    """tokens, Megatron indexed datasets (PREFIX.bin + PREFIX.idx): the end-of-document id; -1 = the id every document already ends with (data preprocessed with --append-eod); an id the documents do not end with is inserted after each one. With data.document_mask (any source): the id that ends a document."""
    streaming: bool = False
    """hf: stream the records (datasets' streaming mode) and tokenize them on the fly with data.tokenizer instead of preparing a cached token folder, for corpora that do not fit on disk; data.path: local JSONL, Parquet or text files (a file, a folder or a glob), or data.dataset."""
    dataset: str = ""
    """hf with data.streaming: a Hugging Face Hub dataset to stream, "owner/name" or "owner/name:config" (split train); empty = the local files of data.path."""
    document_mask: bool = False
    """Packed windows keep their document boundaries: a token attends only within its document (ended by the end-of-document id: data.eos_id, else the one a tokens folder records) and rotary positions restart at each document's first token. Built-in transformer, pp = 1; works with cp."""


ADVANTAGES = ("grpo", "rloo", "reinforce++")
LOSS_AVERAGING = ("token", "sequence")


@dataclass
class RLConfig:
    """Reinforcement learning with verifiable rewards (`chipset rl`, docs/rl.md): where prompts come from, how completions are sampled and scored, and the GRPO loss. train.global_batch counts completions per step (prompts x rl.group_size)."""

    task: str = "addition"
    """A built-in verifiable task giving prompts and its reward: addition, sort or target_sum (docs/rl.md); empty = prompts from rl.prompts."""
    prompts: str = ""
    """A JSONL file of prompts, one object per line with a "prompt" string; its other fields reach the rewards as keyword arguments. Used when rl.task is empty; relative paths are resolved against the config file's folder."""
    rewards: str = ""
    """Reward functions, comma-separated, each "[WEIGHT*]module:function" or the name of a chipset.rewards entry point, called as f(prompts, completions, **metadata) -> list[float]; the reward is their weighted sum. Empty = the task's own reward."""
    group_size: int = 4
    """Completions sampled per prompt (G); advantages compare the completions of one prompt."""
    max_new_tokens: int = 8
    """At most this many tokens per completion."""
    temperature: float = 1.0
    """Sampling temperature (> 0)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1 = all)."""
    stop_ids: str = "10"
    """Token ids that end a completion (kept in it), comma-separated; the default 10 is a newline in the byte vocabulary of the built-in tasks."""
    advantage: str = "grpo"
    """grpo (reward minus the group mean, over the group standard deviation), rloo (reward minus the mean of the other completions of the prompt) or reinforce++ (reward minus the group mean, normalised over the whole batch); formulas in docs/rl.md."""
    scale_rewards: bool = True
    """grpo: divide by the group's standard deviation (false: reward minus the group mean only)."""
    clip_eps: float = 0.2
    """The policy ratio is clipped to [1 - clip_eps, 1 + clip_eps]."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the frozen reference model (the starting weights); 0 = no reference model is built."""
    loss_averaging: str = "token"
    """token: the mean over every completion token of the batch; sequence: the mean over completions of each completion's token mean."""
    updates_per_batch: int = 1
    """Optimizer updates on each step's rollouts (> 1: the ratio to the sampling policy moves and clipping acts)."""


@dataclass
class RunConfig:
    """One training run: every section plus where it writes."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    islands: IslandsConfig = field(default_factory=IslandsConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Section -> keys; a model family's own keys (``model.family_options``) sit in
        ``model`` beside the shared ones, as in the TOML table."""
        out = {f.name: dataclasses.asdict(getattr(self, f.name)) for f in fields(self)}
        out["model"].update(out["model"].pop("family_options"))
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "config") -> RunConfig:
        problems: list[str] = []
        cfg = cls()
        _apply(cfg, raw, where, problems)
        if problems:
            raise ConfigError(_format(problems, where))
        return cfg

    def validate(self, world_size: int | None = None, dtypes: tuple[str, ...] | None = None) -> RunConfig:
        """Check cross-field rules; fill ``parallel.dp`` when 0. Raises ConfigError listing every problem.

        ``world_size``: the job's number of ranks (None: skip the degree product check).
        ``dtypes``: dtype names the backend supports (None: skip).
        """
        problems = validate(self, world_size, dtypes)
        if problems:
            raise ConfigError(_format(problems, "config"))
        return self


# --- parsing ---------------------------------------------------------------------

SECTIONS = {f.name: f.default_factory for f in fields(RunConfig)}  # type: ignore[misc]

KEY_ALIASES = {
    "model.top_k": "model.num_experts_per_tok",
    "model.aux_loss_coef": "model.router_aux_loss_coef",
}
"""Old chipset key -> its Hugging Face name. The old names are still read (config files, ``--set``,
a run directory's saved config) with a deprecation warning, for one release after 0.1."""


def canonical_key(full: str) -> str:
    """``section.key`` under its current name (an alias maps to the key it stands for)."""
    return KEY_ALIASES.get(full, full)


def _alias_clashes(section: str, body: dict[str, Any]) -> list[str]:
    """One key given under both its old and its new name in the same table: which one wins is a guess."""
    return [f"{old} and {new} both given ({body[old.split('.', 1)[1]]!r} and {body[new.split('.', 1)[1]]!r}): "
            f"{old} is the deprecated name of {new}; keep only {new}"
            for old, new in KEY_ALIASES.items()
            if old.startswith(section + ".") and old.split(".", 1)[1] in body and new.split(".", 1)[1] in body]


def _field_types(obj: Any) -> dict[str, type]:
    return get_type_hints(type(obj))


def _coerce(value: Any, typ: type, key: str, problems: list[str]) -> Any:
    """Check ``value`` against ``typ`` (int/float/bool/str), accepting ints for floats."""
    ok = False
    if typ is bool:
        ok = isinstance(value, bool)
    elif typ is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif typ is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok:
            value = float(value)
    elif typ is str:
        ok = isinstance(value, str)
    if not ok:
        problems.append(f"{key} = {value!r}: expected {typ.__name__}, found {type(value).__name__}")
        return None
    return value


def _did_you_mean(word: str, choices) -> str:
    import difflib

    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _apply(cfg: RunConfig, raw: dict[str, Any], where: str, problems: list[str]) -> None:
    if not isinstance(raw, dict):
        problems.append(f"expected a table of sections, found {type(raw).__name__}")
        return
    for section, body in raw.items():
        if section not in SECTIONS:
            problems.append(
                f"[{section}]: unknown section{_did_you_mean(section, SECTIONS)}; expected one of {', '.join(SECTIONS)}"
            )
            continue
        if not isinstance(body, dict):
            problems.append(f"[{section}] = {body!r}: expected a table of keys, found {type(body).__name__}")
            continue
        target = getattr(cfg, section)
        types = _field_types(target)
        clashes = _alias_clashes(section, body)
        problems += clashes
        if clashes:
            continue
        own = _FamilyKeys(body.get("family", target.family)) if section == "model" else None
        for key, value in body.items():
            full = f"{section}.{key}"
            if own is not None and key not in types and own.has(key):  # the family's own [model] key
                v = _coerce(value, own.types[key], full, problems)
                if v is not None:
                    target.family_options[key] = v
                continue
            if full in KEY_ALIASES:
                full = KEY_ALIASES[full]
                log.warning("%s: %s.%s is deprecated and will be removed in the next release; use %s "
                            "(the Hugging Face name)", where, section, key, full)
                key = full.split(".", 1)[1]
            if key not in types:
                valid = [k for k in types if k != "family_options"] + (list(own.types) if own else [])
                problems.append(
                    f"{full}: unknown key (value {value!r}){_did_you_mean(key, valid)}; "
                    f"valid keys in [{section}]: {', '.join(valid)}" + (own.note if own else "")
                )
                continue
            if full == "train.dtype" and value in DTYPE_ALIASES:
                value = DTYPE_ALIASES[value]
            v = _coerce(value, types[key], full, problems)
            if v is not None:
                setattr(target, key, v)


class _FamilyKeys:
    """The ``[model]`` keys model family ``spec`` declares (``ModelFamily.config_class``), found
    only when a key is not a shared one (a family import can cost)."""

    def __init__(self, spec: str):
        self.spec, self._types, self.note = spec, None, ""

    @property
    def types(self) -> dict[str, type]:
        if self._types is None:
            self._types = {}
            from chipset.models.registry import resolve_family

            try:
                cls = getattr(resolve_family(self.spec), "config_class", None)
            except ConfigError as exc:  # reported again, in full, by validation
                self.note = f" (model family {self.spec!r} could not be loaded to read its own keys: {exc})"
                return self._types
            if cls is not None:
                self._types = {k: t for k, t in get_type_hints(cls).items()
                               if k in {f.name for f in dataclasses.fields(cls)}}
                self.note = f" (of which {', '.join(self._types)} are model family {self.spec!r}'s own)"
        return self._types

    def has(self, key: str) -> bool:
        return key in self.types


def _parse_scalar(text: str) -> Any:
    """A ``--set`` value: TOML scalar syntax, or a bare string."""
    try:
        return _toml_loads(f"v = {text}")["v"]
    except Exception:
        return text


def parse_overrides(items: list[str] | None) -> dict[str, dict[str, Any]]:
    """``["train.steps=5", "parallel.zero=3"]`` -> ``{"train": {"steps": 5}, "parallel": {"zero": 3}}``."""
    out: dict[str, dict[str, Any]] = {}
    problems = []
    for item in items or []:
        key, sep, value = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not section or not name:
            problems.append(f"--set {item!r}: expected section.key=value (e.g. --set train.steps=20)")
            continue
        out.setdefault(section, {})[name] = _parse_scalar(value.strip())
    if problems:
        raise ConfigError(_format(problems, "--set"))
    return out


def _toml_loads(text: str) -> dict:
    try:
        import tomllib  # Python >= 3.11
    except ModuleNotFoundError:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise ConfigError(
                "reading TOML configs on Python 3.10 needs the 'tomli' package: pip install tomli "
                "(or use Python >= 3.11, whose standard library has tomllib)"
            ) from None
    return tomllib.loads(text)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Defaults, then the TOML file at ``path`` (if any), then ``--set`` overrides."""
    cfg, problems = _load(path, overrides)
    if problems:
        raise ConfigError(_format(problems, _where(path, overrides)))
    return cfg


def resolve_config(path: str | Path | None, overrides: list[str] | None, *, world_size: int,
                   dtypes: tuple[str, ...] | None = None, default_dtype: str | None = None) -> RunConfig:
    """:func:`load_config` plus :meth:`RunConfig.validate`, reporting every problem of both at once.

    ``default_dtype``: what ``train.dtype = "auto"`` becomes (the backend's
    ``Capabilities.default_dtype``); None leaves it for :func:`resolve_dtype`."""
    cfg, problems = _load(path, overrides)
    if default_dtype is not None:
        resolve_dtype(cfg, default_dtype)
    problems += validate(cfg, world_size, dtypes)
    if problems:
        raise ConfigError(_format(problems, _where(path, overrides)))
    for warning in _tokenizer_warnings(cfg):  # here, once per launch: the ranks validate without it
        log.warning(warning)
    return cfg


def resolve_dtype(cfg: RunConfig, default_dtype: str) -> RunConfig:
    """``train.dtype = "auto"`` becomes ``default_dtype`` (a backend's ``Capabilities.default_dtype``;
    the planner passes bfloat16, the dtype of the accelerators it plans for). Done once, where the
    backend is chosen, so the run directory's config.toml and every rank hold the dtype used."""
    if cfg.train.dtype == "auto":
        cfg.train.dtype = default_dtype
    return cfg


def _where(path, overrides) -> str:
    parts = ([str(path)] if path else []) + (["--set"] if overrides else [])
    return " + ".join(parts) or "defaults"


def _load(path: str | Path | None, overrides: list[str] | None) -> tuple[RunConfig, list[str]]:
    problems: list[str] = []
    cfg = RunConfig()
    if path is not None:
        p = Path(path)
        text = read_text_file(p, "config file", "a TOML config file (docs/config.md)")
        try:
            raw = _toml_loads(text)
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(f"{p}: not valid TOML: {exc}") from None
        _apply(cfg, raw, str(p), problems)
        # A relative data path in a file means "next to this file", wherever chipset is run from.
        _absolute_data_paths(cfg, p.parent)
    _apply(cfg, parse_overrides(overrides), "--set", problems)
    # ... and one given with --set means "from here": stored absolute, so the run directory's
    # config.toml (read again by the ranks and by a rerun) points at the same data.
    _absolute_data_paths(cfg, Path.cwd())
    hf_paths = [p for p in (cfg.model.hf_config, cfg.model.init_from) if p]
    if hf_paths and all(isinstance(p, str) and p.isprintable() for p in hf_paths):  # else validation refuses
        from chipset.models.hf.config import apply_hf_config  # late: models import this module

        problems += apply_hf_config(cfg.model)
    return cfg, problems


def _lora_problems(m) -> list[str]:
    """model.lora_*: the values alone (the targets are matched against the model in layout_problems)."""
    out = []
    if m.lora_rank < 0:
        out.append(f"model.lora_rank = {m.lora_rank!r}: expected an integer >= 0 (0 = no LoRA)")
    if not (math.isfinite(m.lora_alpha) and m.lora_alpha > 0):
        out.append(f"model.lora_alpha = {m.lora_alpha!r}: expected a positive number (scale = alpha / rank)")
    if not (math.isfinite(m.lora_dropout) and 0 <= m.lora_dropout < 1):
        out.append(f"model.lora_dropout = {m.lora_dropout!r}: expected a probability in [0, 1)")
    if m.lora_targets and not m.lora_rank:
        out.append(f"model.lora_targets = {m.lora_targets!r} with model.lora_rank = 0: LoRA is off; "
                   "set model.lora_rank (e.g. 8) or drop lora_targets")
    return out


def _absolute_data_paths(cfg: RunConfig, base: Path) -> None:
    for key in ("path", "eval_path"):
        value = getattr(cfg.data, key)
        if isinstance(value, str) and value and value.isprintable() and not Path(value).is_absolute():
            setattr(cfg.data, key, str((base / value).resolve()))
    isl = cfg.islands
    if isinstance(isl.client_data, str) and isl.client_data.isprintable() and isl.client_data.strip():
        isl.client_data = ", ".join(p if Path(p).is_absolute() else str((base / p).resolve())
                                    for p in client_paths(isl))
    value = cfg.rl.prompts
    if isinstance(value, str) and value and value.isprintable() and not Path(value).is_absolute():
        cfg.rl.prompts = str((base / value).resolve())


def parse_profile_steps(text: str) -> tuple[int, int] | None:
    """``train.profile_steps``: ``"a:b"`` -> (a, b), 1-based inclusive; ``""`` -> None; ValueError if malformed."""
    if not text:
        return None
    a, sep, b = text.partition(":")
    try:
        first, last = int(a), int(b if sep else a)
    except ValueError:
        raise ValueError(f"expected FIRST:LAST step numbers such as 3:5, found {text!r}") from None
    if first < 1 or last < first:
        raise ValueError(f"expected 1 <= FIRST <= LAST, found {text!r}")
    return first, last


def validate(cfg: RunConfig, world_size: int | None = None, dtypes: tuple[str, ...] | None = None) -> list[str]:
    """Every cross-field problem of ``cfg`` as a list of messages (fills ``parallel.dp`` when 0)."""
    bad_values, bad_keys = value_problems(cfg)
    if any(isinstance(getattr(getattr(cfg, k.split(".")[0]), k.split(".")[1]), int) for k in bad_keys):
        return bad_values  # cross-field rules would build tables sized by an int beyond int64
    checked = _validate_ranges(cfg, world_size, dtypes, [])
    # Keys already refused as non-finite, too large or not one line of text are reported once.
    return bad_values + [p for p in checked if p.split(" ", 1)[0] not in bad_keys]


def _validate_ranges(cfg: RunConfig, world_size: int | None, dtypes: tuple[str, ...] | None,
                     problems: list[str]) -> list[str]:
    """The range and cross-field rules of :func:`validate`."""
    m, par, tr, da = cfg.model, cfg.parallel, cfg.train, cfg.data
    try:
        family = resolve_family(m.family)
    except ConfigError as exc:  # an unknown or broken family: said once, its own rules cannot run
        problems.append(str(exc))
        family = None

    def positive(section: str, obj: Any, *names: str) -> None:
        for n in names:
            v = getattr(obj, n)
            if not v > 0:
                problems.append(f"{section}.{n} = {v!r}: expected a positive number")

    positive("model", m, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "intermediate_size", "max_position_embeddings", "rms_norm_eps", "rope_theta", "init_std")
    positive("parallel", par, "tp", "pp", "ep", "cp", "micro_batches", "bucket_mb")
    positive("train", tr, "steps", "global_batch", "seq_len", "lr", "eps", "log_every")
    for name in ("checkpoint_every", "keep_checkpoints"):
        if getattr(tr, name) < 0:
            problems.append(f"train.{name} = {getattr(tr, name)!r}: expected an integer >= 0 (0 = {'never' if name == 'checkpoint_every' else 'keep all'})")
    if tr.replica_check_every < 0:
        problems.append(f"train.replica_check_every = {tr.replica_check_every!r}: expected an integer >= 0 (0 = off)")
    if tr.max_nonfinite_steps < 0:
        problems.append(f"train.max_nonfinite_steps = {tr.max_nonfinite_steps!r}: expected an integer >= 0 (0 = never stop)")
    try:
        parse_profile_steps(tr.profile_steps)
    except ValueError as exc:
        problems.append(f"train.profile_steps = {tr.profile_steps!r}: {exc}")
    if par.zero not in (0, 1, 2, 3):
        problems.append(f"parallel.zero = {par.zero!r}: expected a ZeRO stage 0, 1, 2 or 3")
    problems += _lora_problems(m)
    if par.dp < 0:
        problems.append(f"parallel.dp = {par.dp!r}: expected a positive degree, or 0 for world size / (tp*pp*cp)")
    if par.cp_attention not in CP_ATTENTION:
        problems.append(f"parallel.cp_attention = {par.cp_attention!r}: expected "
                        f"{', '.join(CP_ATTENTION[:-1])} or {CP_ATTENTION[-1]}")
    if par.cp_attention == "hybrid" and not (1 < par.cp_ulysses < par.cp and par.cp % par.cp_ulysses == 0):
        problems.append(f"parallel.cp_attention = 'hybrid' needs parallel.cp_ulysses, the Ulysses degree, to be a "
                        f"divisor of cp ({par.cp}) between 2 and cp/2 (found {par.cp_ulysses!r}); set it, or use "
                        "cp_attention = 'ulysses' or 'ring' for one kind alone")
    elif par.cp_attention != "hybrid" and par.cp_ulysses:
        problems.append(f"parallel.cp_ulysses = {par.cp_ulysses!r} applies only with cp_attention = 'hybrid' "
                        f"(found {par.cp_attention!r}); remove it or set cp_attention = 'hybrid'")
    # The schedule is built to check it: only for degrees the rules below do not refuse anyway
    # (pp beyond the world, more micro-batches than sequences).
    if 1 < par.pp <= (world_size or par.pp) and par.micro_batches <= max(tr.global_batch, 1):
        # schedule, split and combinations: runtime/pipeline/__init__.py
        from chipset.runtime.pipeline import pipeline_problems

        problems += pipeline_problems(cfg, units=family_pipeline_units(family, cfg))
    if tr.dtype not in DTYPES and tr.dtype != "auto":
        problems.append(f"train.dtype = {tr.dtype!r}: expected auto or one of {', '.join(DTYPES)}")
    elif dtypes is not None and tr.dtype != "auto" and tr.dtype not in dtypes:
        problems.append(
            f"train.dtype = {tr.dtype!r}: the backend does not support it (supported: {', '.join(dtypes)}); choose another dtype"
        )
    if tr.optimizer not in OPTIMIZERS:
        problems.append(f"train.optimizer = {tr.optimizer!r}: expected one of {', '.join(OPTIMIZERS)}")
    if not (math.isfinite(tr.momentum) and 0 <= tr.momentum < 1):
        problems.append(f"train.momentum = {tr.momentum!r}: expected a value in [0, 1)")
    if tr.optimizer_state_dtype not in STATE_DTYPES:
        problems.append(f"train.optimizer_state_dtype = {tr.optimizer_state_dtype!r}: expected one of {', '.join(STATE_DTYPES)}")
    problems += _master_weight_problems(cfg)
    if not (math.isfinite(tr.muon_momentum) and 0 <= tr.muon_momentum < 1):
        problems.append(f"train.muon_momentum = {tr.muon_momentum!r}: expected a value in [0, 1)")
    if not (isinstance(tr.muon_ns_steps, int) and 1 <= tr.muon_ns_steps <= 20):
        problems.append(f"train.muon_ns_steps = {tr.muon_ns_steps!r}: expected an integer in [1, 20] (5 is usual)")
    if tr.lr_schedule not in LR_SCHEDULES:
        problems.append(f"train.lr_schedule = {tr.lr_schedule!r}: expected one of {', '.join(LR_SCHEDULES)}")
    if not (math.isfinite(tr.min_lr) and 0 <= tr.min_lr <= tr.lr):
        problems.append(f"train.min_lr = {tr.min_lr!r}: expected a finite value in [0, train.lr ({tr.lr})]")
    if not 0 < tr.decay_fraction <= 1:
        problems.append(f"train.decay_fraction = {tr.decay_fraction!r}: expected a fraction in (0, 1]")
    if tr.fp8 not in FP8_MODES:
        problems.append(f"train.fp8 = {tr.fp8!r}: expected one of {', '.join(FP8_MODES)}")
    if tr.recompute not in RECOMPUTE:
        problems.append(f"train.recompute = {tr.recompute!r}: expected one of {', '.join(RECOMPUTE)}")
    if da.source not in DATA_SOURCES:
        problems.append(f"data.source = {da.source!r}: expected one of {', '.join(DATA_SOURCES)}")
    elif da.source == "text" and m.vocab_size < 256:
        problems.append(
            f"model.vocab_size ({m.vocab_size}) must be >= 256 for data.source = 'text' (one token per byte); "
            "set --set model.vocab_size=256"
        )
    elif da.source == "tokens":
        # blend: data/sources.py; a path per client: islands.client_data, below
        skip = da.blend or (client_paths(cfg.islands) and not da.path)
        problems += [] if skip else _token_data_problems(da.path, m.vocab_size)
    elif da.source == "hf":
        from chipset.data import hf, streaming

        hf_problems = streaming.problems(da) if da.streaming else hf.problems(da.path, da.tokenizer, da.field)
        problems += hf_problems or _tokenizer_vocab_problems(da.tokenizer, m.vocab_size)
    if da.source in DATA_SOURCES:  # data.blend, data.eos_id (Megatron), data.streaming, data.dataset
        from chipset.data import sources

        problems += sources.problems(da, m.vocab_size)
    problems += _eval_problems(cfg) + _long_context_problems(cfg)
    if da.max_bytes < 1:
        problems.append(f"data.max_bytes = {da.max_bytes!r}: expected a positive number of bytes")
    for name in ("grad_clip", "weight_decay", "loss_scale", "warmup_steps"):
        v = getattr(tr, name)
        if v < 0 or (isinstance(v, float) and not math.isfinite(v)):
            problems.append(f"train.{name} = {v!r}: expected a finite number >= 0")
    if not (0 <= tr.beta1 < 1 and 0 <= tr.beta2 < 1):
        problems.append(f"train.beta1/beta2 = {tr.beta1!r}/{tr.beta2!r}: expected values in [0, 1)")
    if tr.dtype == "float16":
        if not tr.initial_loss_scale >= tr.min_loss_scale > 0:
            problems.append(
                f"train.initial_loss_scale ({tr.initial_loss_scale}) must be >= train.min_loss_scale ({tr.min_loss_scale}) > 0"
            )
        if tr.loss_scale_window < 1 or tr.hysteresis < 1:
            problems.append(
                f"train.loss_scale_window ({tr.loss_scale_window}) and train.hysteresis ({tr.hysteresis}) must be >= 1"
            )
    islands = cfg.islands.count if cfg.islands.count > 1 else 1
    whole_world = world_size
    if islands > 1 and world_size is not None and world_size % islands == 0:
        world_size //= islands  # each island runs the [parallel] layout on its own ranks
    elif islands > 1:
        world_size = None  # island_problems says the count does not divide the world
    if world_size is not None and par.dp >= 0 and all(getattr(par, n) > 0 for n in ("tp", "pp", "cp")):
        other = par.tp * par.pp * par.cp
        if par.dp == 0:
            if world_size % other:
                problems.append(f"tp*pp*cp ({other}) must divide world size ({world_size}); run with a multiple of "
                                f"{other} ranks, e.g. --nproc {other * max(1, round(world_size / other))}")
            else:
                par.dp = world_size // other
        elif par.dp * other != world_size:
            problems.append(f"dp*tp*pp*cp ({par.dp * other}) must equal world size ({world_size}); "
                            f"run with --nproc {par.dp * other} (or set parallel.dp = 0 to use every rank)")
    dp = par.dp if par.dp > 0 else None
    problems += island_problems(cfg.islands, whole_world,
                                dp or 0, par.micro_batches, tr.global_batch)
    problems += client_data_problems(cfg.islands, da)
    if dp and par.micro_batches > 0 and tr.global_batch > 0 and islands == 1:
        if tr.global_batch % (dp * par.micro_batches):
            problems.append(
                f"train.global_batch ({tr.global_batch}) must be divisible by dp*micro_batches "
                f"({dp}*{par.micro_batches} = {dp * par.micro_batches})"
            )
    problems += _rl_problems(cfg.rl)
    # The family's own rules on the [model] keys and their combination with the layout
    # (the built-in transformer's: heads, kv heads, rotary, tp/cp/sp divisibility, MoE, HF).
    if family is not None and callable(getattr(family, "config_problems", None)):
        problems += family.config_problems(cfg)
    return problems


def _master_weight_problems(cfg: RunConfig) -> list[str]:
    """train.master_weights and train.bf16_update (runtime/bf16_update.py): without masters only
    bfloat16 parameters, and only the layouts whose updates are tested (dp x ZeRO 0-3)."""
    tr, par = cfg.train, cfg.parallel
    if tr.master_weights not in MASTER_WEIGHTS:
        return [f"train.master_weights = {tr.master_weights!r}: expected one of {', '.join(MASTER_WEIGHTS)}"]
    if tr.bf16_update not in BF16_UPDATES:
        return [f"train.bf16_update = {tr.bf16_update!r}: expected one of {', '.join(BF16_UPDATES)}"]
    if tr.master_weights == "float32":
        if tr.bf16_update != BF16_UPDATES[0]:
            return [f"train.bf16_update = {tr.bf16_update!r} applies only with train.master_weights = 'none' "
                    "(found 'float32'); remove it or set train.master_weights = 'none'"]
        return []
    problems = []
    if tr.dtype not in ("bfloat16", "auto"):
        problems.append(f"train.master_weights = 'none' needs train.dtype = 'bfloat16' (found {tr.dtype!r}): "
                        "float32 parameters are their own masters and float16 needs loss scaling with masters; "
                        "set train.dtype = 'bfloat16' or train.master_weights = 'float32'")
    untested = [f"{k} = {v}" for k, v in (("parallel.tp", par.tp), ("parallel.pp", par.pp), ("parallel.cp", par.cp),
                                          ("parallel.ep", par.ep), ("islands.count", cfg.islands.count)) if v > 1]
    if par.offload_optimizer:
        untested.append("parallel.offload_optimizer = true")
    if untested:
        problems.append(f"train.master_weights = 'none' supports dp with ZeRO 0-3 only (found {', '.join(untested)}); "
                        "set those to 1 (false), or keep train.master_weights = 'float32'")
    return problems


def _long_context_problems(cfg: RunConfig) -> list[str]:
    """train.loss_chunk, train.offload_activations and data.document_mask: the built-in
    transformer's, without pipeline stages (which run the blocks and the head themselves)."""
    problems = []
    tr, da = cfg.train, cfg.data
    if tr.loss_chunk < 0:
        problems.append(f"train.loss_chunk = {tr.loss_chunk!r}: expected a number of tokens >= 0 (0 = no chunking)")
    used = [k for k, on in (("train.loss_chunk", tr.loss_chunk > 0), ("train.offload_activations", tr.offload_activations),
                            ("data.document_mask", da.document_mask)) if on]
    for key in used:
        if cfg.model.family != "transformer":
            problems.append(f"{key} is a feature of the built-in transformer; model.family = {cfg.model.family!r} "
                            "does not support it: leave it off")
        elif cfg.parallel.pp > 1:
            problems.append(f"{key} needs parallel.pp = 1 (found {cfg.parallel.pp}): pipeline stages run the "
                            "blocks and the head themselves; turn it off or use cp instead of pp")
    if tr.loss_chunk > 0 and cfg.parallel.sequence_parallel:
        problems.append("train.loss_chunk does not combine with parallel.sequence_parallel (the head gathers the "
                        "sequence over tp): turn one of them off")
    if da.document_mask and da.eos_id < 0 and da.source != "tokens":
        problems.append(f"data.document_mask needs the end-of-document id: set data.eos_id (data.source = "
                        f"{da.source!r} records none)")
    return problems


def _rl_problems(rl: RLConfig) -> list[str]:
    """Range rules of the [rl] keys (the rules tied to the layout: chipset.rl.loop.check)."""
    problems = []
    for name in ("group_size", "max_new_tokens", "updates_per_batch"):
        if getattr(rl, name) < 1:
            problems.append(f"rl.{name} = {getattr(rl, name)!r}: expected an integer >= 1")
    if not rl.temperature > 0:
        problems.append(f"rl.temperature = {rl.temperature!r}: expected a number > 0")
    if not 0 < rl.top_p <= 1:
        problems.append(f"rl.top_p = {rl.top_p!r}: expected a number in (0, 1]")
    if not rl.clip_eps > 0:
        problems.append(f"rl.clip_eps = {rl.clip_eps!r}: expected a number > 0")
    if not rl.kl_coef >= 0:
        problems.append(f"rl.kl_coef = {rl.kl_coef!r}: expected a number >= 0")
    if rl.advantage not in ADVANTAGES:
        problems.append(f"rl.advantage = {rl.advantage!r}: expected one of {', '.join(ADVANTAGES)}")
    if rl.loss_averaging not in LOSS_AVERAGING:
        problems.append(f"rl.loss_averaging = {rl.loss_averaging!r}: expected one of {', '.join(LOSS_AVERAGING)}")
    try:
        ids = [int(x) for x in rl.stop_ids.split(",") if x.strip()]
        if any(i < 0 for i in ids):
            raise ValueError
    except ValueError:
        problems.append(f"rl.stop_ids = {rl.stop_ids!r}: expected comma-separated token ids >= 0, e.g. \"10\"")
    if not rl.task and not rl.prompts:
        problems.append("rl.task and rl.prompts are both empty: name a built-in task (addition, sort, target_sum) "
                        "or a JSONL prompt file")
    return problems


def _eval_problems(cfg: RunConfig) -> list[str]:
    tr, da, par = cfg.train, cfg.data, cfg.parallel
    problems = []
    if tr.eval_every < 0 or tr.eval_steps < 1:
        problems.append(f"train.eval_every/eval_steps = {tr.eval_every!r}/{tr.eval_steps!r}: expected eval_every >= 0 "
                        "(0 = never) and eval_steps >= 1")
    if not (isinstance(da.eval_fraction, float | int) and 0 <= da.eval_fraction <= 0.5):
        problems.append(f"data.eval_fraction = {da.eval_fraction!r}: expected a fraction in [0, 0.5]")
    if da.eval_path and da.source not in ("tokens", "images"):
        problems.append(f"data.eval_path is set but data.source = {da.source!r}; eval_path needs data.source = "
                        "'tokens' (a prepared folder) or 'images' (a folder of class sub-folders)")
    if da.eval_fraction and da.eval_path:
        problems.append("data.eval_fraction and data.eval_path are both set; choose one source of held-out data")
    if tr.eval_every > 0:
        if da.source == "text":
            problems.append("train.eval_every needs held-out data: data.source = 'text' has none; "
                            "prepare the text with `chipset data prepare` and use data.source = 'tokens'")
        elif da.source in ("tokens", "hf") and not (da.eval_path or da.eval_fraction):
            problems.append("train.eval_every needs held-out data: set data.eval_path or data.eval_fraction (e.g. 0.05)")
        elif da.source == "images" and not da.eval_path:
            problems.append("train.eval_every needs held-out data: set data.eval_path to a folder of class sub-folders")
        if par.pp > 1:
            problems.append("train.eval_every with parallel.pp > 1 is not supported yet (the pipeline schedules "
                            "always run backward); evaluate with the same model on a layout without pp")
        elif da.source == "tokens" and da.eval_path:
            problems += [p.replace("data.path", "data.eval_path") for p in _token_data_problems(da.eval_path, cfg.model.vocab_size)]
    return problems


def _tokenizer_vocab_problems(tokenizer: str, vocab_size: int) -> list[str]:
    try:
        from tokenizers import Tokenizer

        from chipset.data.prepare import tokenizer_file

        vocab = Tokenizer.from_file(str(tokenizer_file(tokenizer))).get_vocab_size(with_added_tokens=True)
    except Exception as exc:  # noqa: BLE001 - missing package or bad file: say which
        return [f"data.tokenizer = {tokenizer!r}: cannot be loaded ({exc}); pip install 'chipset[data]' "
                "and give a tokenizers tokenizer.json"]
    if vocab > vocab_size:
        return [f"model.vocab_size ({vocab_size}) is smaller than data.tokenizer's vocabulary ({vocab}); "
                f"set --set model.vocab_size={vocab}"]
    return []


def client_data_path_problems(cfg: RunConfig, islands: list[int]) -> list[str]:
    """Whether the ``islands.client_data`` entries of ``islands`` (those run on this node: a
    client's data need not exist anywhere else) can be read as data.source reads data.path."""
    paths = client_paths(cfg.islands)
    problems = []
    for i in islands:
        if i >= len(paths):
            continue  # the count mismatch is validate()'s
        path = paths[i]
        if cfg.data.source == "tokens":
            found = _token_data_problems(path, cfg.model.vocab_size)
        else:
            found = [] if Path(path).exists() else [f"{path!r}: no such file or directory; give a text file or a folder of them"]
        problems += [f"islands.client_data entry {i} (island {i}): {msg}" for msg in found]
    return problems


def _token_data_problems(path: str, vocab_size: int) -> list[str]:
    if not path:
        return ["data.path is empty: data.source = 'tokens' needs a folder made by `chipset data prepare` "
                "or a flat uint16 .bin file"]
    from chipset.data import open_tokens

    try:
        store = open_tokens(path)
    except ConfigError as exc:
        return [str(exc)]
    if store.vocab_size is not None and store.vocab_size > vocab_size:
        return [f"model.vocab_size ({vocab_size}) is smaller than the tokenizer's vocabulary "
                f"({store.vocab_size}, data.path = {path!r}); set --set model.vocab_size={store.vocab_size}"]
    return []


def _tokenizer_warnings(cfg: RunConfig) -> list[str]:
    """Data whose token ids may mean other tokens than model.init_from's vocabulary: a warning, not an
    error (a model may pad its vocabulary past its tokenizer's; a tokenizer may be a copy)."""
    m, da = cfg.model, cfg.data
    if not m.init_from or da.source not in ("text", "tokens"):
        return []
    fix = (f"prepare the data with the model's own tokenizer: chipset data prepare INPUTS --tokenizer {m.init_from} "
           "--out DIR, then set data.source = 'tokens' and data.path = DIR (docs/hf.md)")
    if da.source == "text":
        return [f"data.source = 'text' feeds each byte as a token id (0-255) to the pretrained model of "
                f"model.init_from = {m.init_from!r}, whose ids mean its own tokenizer's tokens; {fix}"]
    found = (_tokenizer_warning(key, path, Path(m.init_from), m.vocab_size, fix)
             for key, path in (("data.path", da.path), ("data.eval_path", da.eval_path)) if path)
    return [w for w in found if w]


def _tokenizer_warning(key: str, path: str, model_dir: Path, vocab_size: int, fix: str) -> str:
    """The tokenizer ``chipset data prepare`` recorded in ``path``'s meta.json against the model's
    tokenizer.json (same sha256), or, when the model has none, against its vocabulary size."""
    import hashlib
    import json

    from chipset.data.store import META

    try:
        meta = json.loads((Path(path) / META).read_text()) if Path(path).is_dir() else None
    except (OSError, ValueError):
        meta = None
    if not isinstance(meta, dict):
        return ""  # a flat .bin file says nothing about its tokenizer
    tok = meta.get("tokenizer") if isinstance(meta.get("tokenizer"), dict) else {}
    own = model_dir / "tokenizer.json"
    if own.is_file() and tok.get("sha256"):
        if hashlib.sha256(own.read_bytes()).hexdigest() == tok["sha256"]:
            return ""
        return (f"{key} = {path!r} was tokenized with {tok.get('file', 'another tokenizer')}, not with "
                f"model.init_from's tokenizer ({own}): the same ids mean other tokens to the model; {fix}")
    vocab = meta.get("vocab_size")
    if isinstance(vocab, int) and vocab != vocab_size:
        return (f"{key} = {path!r} was tokenized with a vocabulary of {vocab} tokens "
                f"({tok.get('file', 'no tokenizer recorded')}) and model.init_from's model has model.vocab_size = "
                f"{vocab_size}: unless that is the model's own tokenizer (models may pad their vocabulary), the ids "
                f"mean other tokens to the model; {fix}")
    return ""


def _format(problems: list[str], where: str) -> str:
    head = f"invalid configuration ({where}), {len(problems)} problem{'s' if len(problems) != 1 else ''}:"
    tail = "Fix the config file or the --set overrides; `chipset train --help` lists the options and docs/config.md every key."
    return "\n".join([head, *(f"  - {p}" for p in problems), tail])


# --- writing ------------------------------------------------------------------------


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def to_toml(cfg: RunConfig) -> str:
    """The resolved config as TOML text that :func:`load_config` reads back to an equal config."""
    lines = []
    for section, body in cfg.to_dict().items():
        lines.append(f"[{section}]")
        lines.extend(f"{k} = {_toml_value(v)}" for k, v in body.items())
        lines.append("")
    return "\n".join(lines)
