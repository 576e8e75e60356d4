"""``chipset plan --write-config``: the planner's best layout as a ``chipset train`` config.

Every field of the planner's candidate is mapped explicitly onto a key ``chipset train`` reads;
a field train cannot express is refused (ConfigError, exit 2) rather than dropped, so the file
never describes a different job from the one the planner predicted.
"""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

from chipset.errors import ConfigError

_ARCH_KEYS = frozenset({
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "max_position_embeddings", "tie_word_embeddings", "num_experts",
    "num_experts_per_tok", "top_k", "moe_every", "shared_expert_intermediate_size", "head_dim",
    "preset", "layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "seq_len", "shared_ffn",
    "tied_embeddings", "name",
})
"""Keys the planner's spec restates (HF and planner spellings): written from the spec, not copied."""


def check_target(path: str, force: bool) -> None:
    """Refuse before any work is done when ``path`` exists and ``--force`` was not given."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"--write-config {path!r} is a directory; expected a file name such as plan.toml")
    if not p.parent.is_dir():
        raise ConfigError(f"--write-config {path!r}: folder {str(p.parent)!r} does not exist; create it first")
    if p.exists() and not force:
        raise ConfigError(f"--write-config {path!r} already exists; pass --force to overwrite it "
                          "or choose another file name")


def check_buildable(spec) -> None:
    """Refuse (before the search) a model ``chipset train`` cannot build: a config for it would not run."""
    refused = [f"{name} = {getattr(spec, name)!r} ({why})" for name, want, why in (
        ("mlp", "swiglu", "chipset train builds SwiGLU MLPs only"),
        ("norm", "rmsnorm", "chipset train builds RMSNorm only"),
        ("bias", False, "chipset train has no biases on its linear layers"),
        ("position", "rope", "chipset train uses rotary positions only"),
        ("dropout", False, "chipset train has no dropout"),
    ) if getattr(spec, name) != want]
    if refused:
        raise ConfigError(f"--write-config: model {spec.name!r} is not one chipset train can build: "
                          + "; ".join(refused) + ". Plan a reference-family model (--preset llama3-8b, "
                          "a chipset train config or a Hugging Face config.json) to write a config")


def _model_table(args, spec) -> dict[str, Any]:
    """The [model] table: the source's Hugging Face reference carried through, else the spec's shape."""
    check_buildable(spec)
    src: dict[str, Any] = {}
    if args.model:
        from chipset.planner.hf import is_hf_config

        p = Path(args.model).expanduser().resolve()
        if is_hf_config(args.model):
            folder = p if p.is_dir() else p.parent
            if p.is_dir() and any(folder.glob("*.safetensors")):
                src = {"init_from": str(folder)}
            else:
                src = {"hf_config": str(p / "config.json" if p.is_dir() else p)}
        else:
            src = _source_tables(p).get("model") or {}
    hf_ref = {k: v for k, v in src.items() if k in ("init_from", "hf_config") and v}
    if hf_ref and args.overrides:
        raise ConfigError("--write-config: the model comes from a Hugging Face config "
                          f"({', '.join(f'{k} = {v}' for k, v in hf_ref.items())}), so --set "
                          f"{' '.join(args.overrides)} cannot be carried into the train config; drop --set or "
                          "write the architecture keys in a [model] table instead")
    out = {k: v for k, v in src.items() if k not in _ARCH_KEYS}
    if hf_ref:  # chipset train reads the architecture from config.json; restating it could only disagree
        return out
    arch = {
        "vocab_size": spec.vocab, "hidden_size": spec.hidden, "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads, "num_key_value_heads": spec.kv,
        "intermediate_size": spec.ffn,
        "max_position_embeddings": max(spec.seq_len, int(src.get("max_position_embeddings", 0) or 0)),
        "tie_word_embeddings": spec.tied_embeddings,
    }
    if spec.is_moe:
        arch.update(num_experts=spec.num_experts, num_experts_per_tok=spec.top_k, moe_every=spec.moe_every,
                    shared_expert_intermediate_size=spec.shared_ffn)
    return {**arch, **out}


_PATH_KEYS = {"model": ("init_from", "hf_config"), "data": ("path", "eval_path", "tokenizer")}
"""Keys chipset train resolves against the config file's folder: made absolute when carried over."""


def _source_tables(path: Path) -> dict[str, dict[str, Any]]:
    """The source train config's tables, relative paths made absolute (the new file may live elsewhere)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    data = tomllib.loads(path.read_text())
    out = {k: dict(v) for k, v in data.items() if isinstance(v, dict)}
    for section, keys in _PATH_KEYS.items():
        table = out.get(section, {})
        for k in keys:
            if isinstance(table.get(k), str) and table[k]:
                ref = Path(table[k]).expanduser()
                table[k] = str(ref if ref.is_absolute() else (path.parent / ref).resolve())
    return out


def train_config_text(args, spec, train, cluster, pred) -> str:
    """TOML text of a ``chipset train`` config running ``pred``'s layout; ConfigError if it cannot."""
    from chipset.train.config import DTYPE_ALIASES, DTYPES, _toml_value

    lay = pred.layout
    if not pred.fits:
        raise ConfigError("--write-config: the layout does not fit in device memory "
                          f"({pred.memory.total / 2**30:.1f} GiB needed, {pred.memory_limit_bytes / 2**30:.1f} GiB "
                          "usable); no config written. Relax --fix or use a larger cluster")
    dtype = DTYPE_ALIASES.get(train.dtype, train.dtype)
    if dtype not in DTYPES:
        raise ConfigError(f"--write-config: --dtype {train.dtype!r} is not a chipset train dtype "
                          f"({', '.join(DTYPES)})")
    if lay.dp * lay.micro_batch * pred.micro_batches != train.global_batch:
        raise ConfigError(f"--write-config: global batch {train.global_batch} is not dp {lay.dp} x micro-batch "
                          f"{lay.micro_batch} x {pred.micro_batches} micro-batches; chipset train splits "
                          "train.global_batch exactly, so this layout cannot be written")
    parallel = {
        "dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "ep": lay.ep, "zero": lay.zero,
        # train.global_batch / (dp * micro_batches) = the planner's micro_batch sequences per rank
        "micro_batches": pred.micro_batches,
        "sequence_parallel": lay.sp,
        "schedule": lay.schedule,  # the planner plans chipset train's schedules by their names
        "virtual_stages": lay.v,
        "cp_attention": lay.cp_attention,
        "cp_ulysses": lay.cp_ulysses,
    }
    from chipset.planner.stages import pipeline_split

    split = pipeline_split(spec.layers, lay.pp, lay.v)
    if split:  # an uneven split: the one the planner costed, not chipset train's parameter balance
        parallel["pipeline_split"] = split
    planned = {"global_batch": train.global_batch, "seq_len": spec.seq_len, "dtype": dtype,
               "recompute": lay.recompute}
    src: dict[str, dict[str, Any]] = {}
    from chipset.planner.hf import is_hf_config

    if args.model and not is_hf_config(args.model):  # a chipset train config: keep its run settings
        src = _source_tables(Path(args.model).expanduser())
    tables = {
        "model": _model_table(args, spec),
        "parallel": parallel,
        "train": {**planned, **{k: v for k, v in (src.get("train") or {}).items() if k not in planned}},
    }
    if src.get("data"):
        tables["data"] = src["data"]
    n = cluster.world_size
    launch = (f"--nproc {n}" if cluster.nodes == 1 else
              f"--nnodes {cluster.nodes} --nproc {cluster.devices_per_node} (on each node, with --node-rank)")
    cmd = " ".join(shlex.quote(a) for a in ["chipset", "plan", *sys.argv[2:]]) if sys.argv[1:2] == ["plan"] \
        else "chipset plan"
    lines = [
        f"# Written by: {cmd}",
        f"# Cluster {cluster.nodes}x{cluster.devices_per_node} {cluster.profile} = {n} devices; "
        f"model {spec.name}, {spec.num_params() / 1e9:.3g}B parameters.",
        f"# Predicted (the planner's best layout): {pred.step_time_s:.4g} s/step, "
        f"{pred.tokens_per_s:.4g} tokens/s, MFU {pred.mfu:.1%}, {pred.memory.total / 2**30:.1f} GiB per device.",
        f"# Launch with world size {n}: chipset train {shlex.quote(args.write_config)} {launch}",
        ("# Other [train] keys and [data] are the source config's." if src else
         "# Add steps, lr and a [data] table before a real run (defaults: docs/config.md)."),
        "",
    ]
    for section, body in tables.items():
        lines.append(f"[{section}]")
        for k, v in body.items():
            try:
                lines.append(f"{k} = {_toml_value(v)}")
            except TypeError:
                raise ConfigError(f"--write-config: {section}.{k} = {v!r} in {args.model} is not a scalar "
                                  "chipset train reads; fix the source config") from None
        lines.append("")
    text = "\n".join(lines)
    _validate(text, n)
    return text


def _validate(text: str, world_size: int) -> None:
    """Read ``text`` back exactly as ``chipset train`` reads a config file (Hugging Face references
    resolved, every cross-field rule checked at ``world_size``)."""
    from chipset.train.config import resolve_config

    with tempfile.TemporaryDirectory(prefix="chipset-plan-") as d:
        f = Path(d) / "plan.toml"
        f.write_text(text)
        try:
            resolve_config(f, None, world_size=world_size)
        except ConfigError as exc:
            raise ConfigError(f"--write-config: the planner's layout is not a valid chipset train config, "
                              f"nothing written:\n{exc}") from None


def write_atomic(path: str, text: str, force: bool) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and os.replace."""
    check_target(path, force)
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent or ".")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
