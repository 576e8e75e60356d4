"""A chipset checkpoint (any layout) to a Hugging Face directory or one torch state-dict file.

Checkpoints store every parameter under its logical, single-process name and shape
(:mod:`chipset.train.checkpoint.layout`), whatever layout wrote them, so export needs no
ranks: DCP reads the logical tensors in this one process (``no_dist``), a shard's worth
at a time, from the fp32 masters. The output is written into a temporary sibling folder
and renamed into place, so a failed export leaves nothing behind; the folder and its files get
the default modes (0o777 / 0o666 less the umask), as ``mkdir`` and ``cp`` would give them.

An HF export also carries what the weights alone do not say (:func:`carry_tokenizer`): the
special-token ids, ``generation_config.json`` and the tokenizer files of ``model.init_from``
and of the tokenizer the run's prepared tokens were made with (recorded in their meta.json).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from chipset.errors import ConfigError
from chipset.models.hf.config import SUPPORTED_ARCHITECTURES, to_hf_config
from chipset.models.hf.names import expert_names, to_hf
from chipset.parallel.lora import ADAPTER_NAMES, is_adapter, merge
from chipset.runtime.precision import DTYPE_BY_NAME
from chipset.train.config import RunConfig

__all__ = ["FORMATS", "Carried", "Exported", "carry_tokenizer", "export", "find_checkpoint"]

log = logging.getLogger(__name__)

FORMATS = ("hf", "torch", "peft")
DTYPES = DTYPE_BY_NAME  # the export's --dtype names: the same as train.dtype's
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "added_tokens.json", "chat_template.jinja")
"""A Hugging Face tokenizer's files, copied when present (tokenizer.json or tokenizer.model is the tokenizer)."""


@dataclass
class Carried:
    """What an HF export writes beside the weights: special ids for config.json, files to copy, and
    one line per item for the printed summary (what was carried from where, or that nothing was)."""

    ids: dict[str, object] = field(default_factory=dict)
    files: dict[str, Path] = field(default_factory=dict)
    tokenizer_config: dict | None = None
    """Written as tokenizer_config.json when a bare tokenizer.json comes without one."""
    notes: list[str] = field(default_factory=list)


@dataclass
class Exported:
    """The result of :func:`export`: the checkpoint read and the summary lines of what was carried."""

    checkpoint: Path
    notes: list[str] = field(default_factory=list)


def find_checkpoint(run_dir: Path, step: int | None) -> Path:
    """The complete checkpoint of ``run_dir`` at ``step`` (None: the newest); ConfigError if none."""
    from chipset.train.checkpoint import store

    if step is None:
        chosen, skipped = store.select(run_dir)
        if chosen is None:
            why = "; ".join(f"{p.name}: {w}" for p, w in skipped) or "none written"
            raise ConfigError(f"{run_dir}: no complete checkpoint to export ({why}); train with "
                              "train.checkpoint_every > 0 (docs/fault-tolerance.md)")
        return chosen.path
    path = store.checkpoint_dir(run_dir, step)
    why = store.verify(path) if path.is_dir() else "no such checkpoint"
    if why is not None:
        have = ", ".join(str(c.step) for c in store.list_checkpoints(run_dir)) or "none"
        raise ConfigError(f"--step {step}: {path}: {why}; steps with checkpoints: {have}")
    return path


def _read(reader, keys: dict[str, tuple[list[int], torch.Tensor]]) -> None:
    """Fill each tensor of ``keys`` (checkpoint key -> (shape, target)) from the checkpoint, in this process."""
    import torch.distributed.checkpoint as dcp

    from chipset.train.checkpoint.layout import read_planner

    chunks = {k: [([0] * len(shape), list(shape), t)] for k, (shape, t) in keys.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({}, storage_reader=reader, planner=read_planner(chunks), no_dist=True)


def _groups(shapes: dict[str, list[int]], max_bytes: int, esize: int) -> list[list[str]]:
    """Parameter names in order, cut into output files of at most ``max_bytes`` (one tensor may exceed it)."""
    out, cur, size = [], [], 0
    for name, shape in shapes.items():
        n = esize
        for d in shape:
            n *= d
        if cur and size + n > max_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(name)
        size += n
    return out + ([cur] if cur else [])


def export(run_dir: str | Path, out: str | Path, *, step: int | None = None, fmt: str = "hf",
           dtype: str = "float32", max_shard_mb: float = 2048.0) -> Exported:
    """Write checkpoint ``step`` of ``run_dir`` to the new folder ``out``; returns the checkpoint used
    and, for ``hf``, what was carried beside the weights."""
    from chipset.train.checkpoint import store

    run_dir, out = Path(run_dir), Path(out)
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out}: exists and is not an empty folder; chipset export never overwrites, "
                          "choose a new path")
    ckpt = find_checkpoint(run_dir, step)
    state = json.loads((ckpt / store.STATE).read_text())
    cfg = RunConfig.from_dict(state["config"], where=str(ckpt / store.STATE))
    shapes = {n: list(s) for n, s in state["shapes"].items()}
    hf_cfg, carried = None, Carried()
    if fmt == "peft" and not cfg.model.lora_rank:
        raise ConfigError(f"--format peft: {ckpt} was trained without LoRA (model.lora_rank = 0); export it "
                          "with --format hf or torch")
    if fmt in ("hf", "peft"):
        try:
            hf_cfg = to_hf_config(cfg.model)
        except ValueError as exc:
            raise ConfigError(f"cannot export {ckpt} as a Hugging Face model: {exc}") from None
        hf_cfg["torch_dtype"] = dtype
    if fmt == "hf":
        carried = carry_tokenizer(cfg)
        hf_cfg.update(carried.ids)
    reader = store.safe_reader(ckpt)
    md = reader.read_metadata().state_dict_metadata
    # fp32 masters where they exist; a frozen parameter (LoRA's base) has none: its value.
    kinds = {n: "optim.master" if f"optim.master.{n}" in md else "model" for n in shapes}
    out.parent.mkdir(parents=True, exist_ok=True)
    # mkdir, not mkdtemp: the folder gets the default mode (mkdtemp's is 0o700, readable by its owner only).
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        family = SUPPORTED_ARCHITECTURES[hf_cfg["architectures"][0]] if hf_cfg else ""
        weights = _Weights(reader, kinds, shapes, cfg)
        if fmt == "hf":
            _write_hf(weights, hf_cfg, tmp, DTYPES[dtype], int(max_shard_mb * 2**20), family)
            _write_carried(carried, tmp)
        elif fmt == "peft":
            _write_peft(weights, cfg, tmp, DTYPES[dtype], family)
        else:
            _write_torch(weights, cfg, tmp, DTYPES[dtype])
        # safetensors writes its files 0o600; the JSON files, written with open(), have the default mode.
        mode = (tmp / ("adapter_config.json" if fmt == "peft" else "config.json")).stat().st_mode & 0o777
        for f in tmp.iterdir():
            f.chmod(mode)
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("exported %s (%s) to %s", ckpt, fmt, out)
    return Exported(ckpt, carried.notes)


def load_weights(run_dir: str | Path, step: int | None = None) -> tuple[RunConfig, dict[str, torch.Tensor], Path]:
    """``(config, state dict, checkpoint)`` of checkpoint ``step`` of ``run_dir`` (None: the newest):
    the whole model's float32 weights under the family module's own names (tied weights under
    each name; LoRA adapters merged in, and the config's LoRA turned off to match), read in this
    process from any layout's shards. For ``chipset generate`` and
    scripts; :func:`export` writes the same to files."""
    from chipset.models.family import meta_model
    from chipset.models.registry import resolve_family
    from chipset.train.checkpoint import store

    ckpt = find_checkpoint(Path(run_dir), step)
    state = json.loads((ckpt / store.STATE).read_text())
    cfg = RunConfig.from_dict(state["config"], where=str(ckpt / store.STATE))
    shapes = {n: list(s) for n, s in state["shapes"].items()}
    reader = store.safe_reader(ckpt)
    md = reader.read_metadata().state_dict_metadata
    kinds = {n: "optim.master" if f"optim.master.{n}" in md else "model" for n in shapes}
    weights = _Weights(reader, kinds, shapes, cfg)
    sd = weights.read(weights.shapes)  # LoRA adapters merged in
    plain = RunConfig.from_dict(state["config"], where=str(ckpt / store.STATE))
    plain.model.lora_rank, plain.model.lora_targets = 0, ""  # the model the weights fit
    _tie(sd, meta_model(resolve_family(plain.model.family), plain))
    return plain, sd, ckpt


def _tie(sd: dict[str, torch.Tensor], model) -> None:
    """A module's state_dict lists a shared (tied) weight under each of its names; the
    checkpoint holds it once, under the first: add the other names."""
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first and name not in sd:
            sd[name] = sd[first[id(p)]]
        first.setdefault(id(p), name)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _data_tokenizer(cfg: RunConfig, notes: list[str]) -> tuple[Path | None, dict | None, Path | None]:
    """``(tokenizer file, meta, meta path)`` of the run's prepared tokens (``data.source = "tokens"``):
    the tokenizer ``chipset data prepare --tokenizer`` recorded in meta.json, when it is still the same file."""
    from chipset.data.store import META

    if cfg.data.source != "tokens" or not cfg.data.path or not Path(cfg.data.path).is_dir():
        return None, None, None  # a flat .bin file records no tokenizer
    where = Path(cfg.data.path) / META
    meta = _read_json(where)
    rec = (meta or {}).get("tokenizer")
    if not isinstance(rec, dict) or not isinstance(rec.get("file"), str):
        return None, meta, where
    f = Path(rec["file"])
    if not f.is_file():
        notes.append(f"the data's tokenizer {f} (recorded in {where}) no longer exists: not exported")
        return None, meta, where
    if rec.get("sha256") and _sha256(f) != rec["sha256"]:
        notes.append(f"the data's tokenizer {f} changed after `chipset data prepare` (its sha256 is not the one in "
                     f"{where}): not exported")
        return None, meta, where
    return f, meta, where


def _token_names(tokenizer_json: Path, ids: dict[str, object]) -> dict[str, str]:
    """``{"eos_token": "</s>", ...}`` for the special ids, from tokenizer.json's added tokens."""
    added = (_read_json(tokenizer_json) or {}).get("added_tokens") or []
    by_id = {t.get("id"): t.get("content") for t in added if isinstance(t, dict)}
    out = {}
    for key, value in ids.items():
        value = value[0] if isinstance(value, list) and value else value
        if isinstance(by_id.get(value), str):
            out[key.removesuffix("_id")] = by_id[value]
    return out


def carry_tokenizer(cfg: RunConfig) -> Carried:
    """What an HF export of a run with config ``cfg`` carries beside the weights.

    - special ids (``bos_token_id``, ``eos_token_id``, ``pad_token_id``): from the config.json of
      ``model.init_from`` (or ``model.hf_config``); an eos id they lack comes from the prepared
      tokens' meta.json (``eos_id``, the id that ends every document the run trained on);
    - ``generation_config.json``: copied from ``model.init_from``;
    - the tokenizer: the one the run's prepared tokens were made with (its file is recorded in their
      meta.json, with the files beside it when it is a model directory's tokenizer.json), else
      ``model.init_from``'s. A bare tokenizer.json gets a tokenizer_config.json naming its special tokens.

    When nothing is known, nothing is written and the notes say so.
    """
    c = Carried()
    model_dir = Path(cfg.model.init_from) if cfg.model.init_from else None
    model_cfg = model_dir / "config.json" if model_dir else Path(cfg.model.hf_config) if cfg.model.hf_config else None
    data_tok, meta, meta_path = _data_tokenizer(cfg, c.notes)
    hf = _read_json(model_cfg) if model_cfg is not None else None
    if hf is not None:
        c.ids = {k: hf[k] for k in SPECIAL_IDS if hf.get(k) is not None}
    sources = [f"from {model_cfg}"] if c.ids else []
    eos = (meta or {}).get("eos_id")
    if isinstance(eos, int) and not isinstance(eos, bool):
        if "eos_token_id" not in c.ids:
            c.ids["eos_token_id"] = eos
            sources.append(f"eos_token_id: the end-of-document id of {meta_path}")
        elif eos not in (c.ids["eos_token_id"] if isinstance(c.ids["eos_token_id"], list) else [c.ids["eos_token_id"]]):
            c.notes.append(f"note: the data's end-of-document id {eos} ({meta_path}) is not the model's "
                           f"eos_token_id {c.ids['eos_token_id']} ({model_cfg}); generate() stops at the latter")
    if c.ids:
        c.notes.insert(0, f"special-token ids: {', '.join(f'{k}={v}' for k, v in c.ids.items())} "
                          f"({'; '.join(sources)})")
    else:
        c.notes.insert(0, "no special-token ids known (no model.init_from or model.hf_config config.json with them, "
                          "no prepared token data with an eos id): config.json has no bos/eos/pad ids, transformers "
                          "will use its defaults and generate() may not stop; add them to the exported config.json")
    if model_dir is not None and (model_dir / "generation_config.json").is_file():
        c.files["generation_config.json"] = model_dir / "generation_config.json"
        c.notes.append(f"generation_config.json: copied from {model_dir}")
    if data_tok is not None:
        c.files["tokenizer.json"] = data_tok
        if data_tok.name == "tokenizer.json":  # a model directory's tokenizer: its companions too
            c.files.update({n: data_tok.parent / n for n in TOKENIZER_FILES[1:] if (data_tok.parent / n).is_file()})
        tok_from = f"{data_tok} (the tokenizer of data.path, {meta_path})"
    elif model_dir is not None and any((model_dir / n).is_file() for n in ("tokenizer.json", "tokenizer.model")):
        c.files.update({n: model_dir / n for n in TOKENIZER_FILES if (model_dir / n).is_file()})
        tok_from = str(model_dir)
    else:
        c.notes.append("no tokenizer known (neither model.init_from nor the prepared token data has one): "
                       "copy the model's tokenizer files into the exported folder")
        return c
    if "tokenizer.json" in c.files and "tokenizer_config.json" not in c.files:
        c.tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast",
                              **_token_names(c.files["tokenizer.json"], c.ids)}
    names = sorted([*c.files, *(["tokenizer_config.json"] if c.tokenizer_config else [])])
    c.notes.append(f"tokenizer: {', '.join(n for n in names if n != 'generation_config.json')} from {tok_from}")
    return c


def _write_carried(c: Carried, tmp: Path) -> None:
    """Copy the carried files into ``tmp`` (new files: the default mode, whatever the source's)."""
    for name, src in c.files.items():
        shutil.copyfile(src, tmp / name)
    if c.tokenizer_config is not None:
        (tmp / "tokenizer_config.json").write_text(json.dumps(c.tokenizer_config, indent=2) + "\n")


def _hf_tensors(name: str, t: torch.Tensor, family: str) -> dict[str, torch.Tensor]:
    """HF names and tensors of chipset's ``name``: stacked experts become one tensor per expert."""
    experts = expert_names(name, family, t.shape[0])
    if experts is None:
        return {to_hf(name, family): t.contiguous()}
    return {e: t[i].contiguous() for i, e in enumerate(experts)}


class _Weights:
    """The checkpoint's logical tensors, read a group at a time; with LoRA the model's names exclude the
    adapters and each adapted weight comes merged (``W + alpha/rank * B @ A``, parallel/lora.py)."""

    def __init__(self, reader, kinds: dict[str, str], shapes: dict[str, list[int]], cfg: RunConfig):
        self.reader, self.kinds, self.all = reader, kinds, shapes
        self.lora = cfg.model.lora_rank > 0
        self.scale = cfg.model.lora_alpha / cfg.model.lora_rank if self.lora else 0.0
        self.shapes = {n: s for n, s in shapes.items() if not is_adapter(n)}
        self.adapters = [n for n in shapes if is_adapter(n)]

    def read(self, names, *, merged: bool = True) -> dict[str, torch.Tensor]:
        """float32 tensors of ``names``; with ``merged`` their adapters are read too and folded in."""
        names = list(names)
        if merged and self.lora:
            names += [f"{n.removesuffix('.weight')}.{x}.weight" for n in names for x in ADAPTER_NAMES
                      if f"{n.removesuffix('.weight')}.{x}.weight" in self.all]
        buf = {n: torch.empty(self.all[n], dtype=torch.float32) for n in names}
        _read(self.reader, {f"{self.kinds[n]}.{n}": (self.all[n], t) for n, t in buf.items()})
        return merge(buf, self.scale) if merged and self.lora else buf


def _write_hf(weights: _Weights, hf_cfg, tmp: Path, dtype, max_bytes: int, family: str) -> None:
    from safetensors.torch import save_file

    groups = _groups(weights.shapes, max_bytes, torch.tensor([], dtype=dtype).element_size())
    files = ["model.safetensors"] if len(groups) == 1 else [
        f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map, total = {}, 0
    for names, file in zip(groups, files, strict=True):
        buf = weights.read(names)
        tensors = {k: v for n, t in buf.items() for k, v in _hf_tensors(n, t.to(dtype), family).items()}
        save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        for k, t in tensors.items():
            weight_map[k] = file
            total += t.numel() * t.element_size()
        del buf, tensors
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")


def peft_name(name: str) -> str:
    """PEFT's key of adapter ``name``: ``layers.0.self_attn.q_proj.lora_A.weight`` ->
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``."""
    base, _, leaf = name.removesuffix(".weight").rpartition(".")
    return f"base_model.model.{to_hf(base + '.weight').removesuffix('.weight')}.{leaf}.weight"


def _write_peft(weights: _Weights, cfg: RunConfig, tmp: Path, dtype, family: str) -> None:
    """``adapter_model.safetensors`` (the adapters under PEFT's names) and ``adapter_config.json``
    (a LoRA config whose target_modules are the adapted modules' exact Hugging Face names), which
    ``peft.PeftModel.from_pretrained(base, DIR)`` loads onto the base model (model.init_from)."""
    from safetensors.torch import save_file

    m = cfg.model
    tensors = {peft_name(n): t.to(dtype).contiguous() for n, t in weights.read(weights.adapters, merged=False).items()}
    targets = sorted({k.removeprefix("base_model.model.").rsplit(".", 2)[0] for k in tensors})
    save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": m.init_from or None,
        "r": m.lora_rank, "lora_alpha": m.lora_alpha, "lora_dropout": m.lora_dropout, "target_modules": targets,
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
        "init_lora_weights": True, "inference_mode": True, "rank_pattern": {}, "alpha_pattern": {},
    }
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _write_torch(weights: _Weights, cfg: RunConfig, tmp: Path, dtype) -> None:
    """``model.pt``: the state dict of the run's model family's module (its own names), and its
    ``[model]`` config as ``config.json`` (``ModelConfig(**json)`` rebuilds the module)."""
    import dataclasses

    from chipset.models.family import meta_model
    from chipset.models.registry import resolve_family

    sd = {n: t.to(dtype) for n, t in weights.read(weights.shapes).items()}
    # A module's state_dict lists a shared (tied) weight under each of its names; the
    # checkpoint holds it once, under the first.
    _tie(sd, meta_model(resolve_family(cfg.model.family), cfg))
    torch.save(sd, tmp / "model.pt")
    plain = dataclasses.replace(cfg.model, lora_rank=0, lora_targets="")  # the adapters are merged in
    (tmp / "config.json").write_text(json.dumps(dataclasses.asdict(plain), indent=2) + "\n")
