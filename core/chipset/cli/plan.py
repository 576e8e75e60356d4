"""``chipset plan``: which parallel layout fits a model on a cluster, and how fast it will be."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from chipset.errors import ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "plan", help="predict memory and step time of parallel layouts and pick the fastest that fits",
        description="Enumerate dp x tp x pp x ep x cp layouts, ZeRO stage, micro-batch, schedule and recompute "
                    "policy for a model on a cluster; discard those that are invalid or do not fit; rank the rest "
                    "by predicted step time. Formulas and their sources: docs/planner.md.",
    )
    p.add_argument("config", nargs="?", metavar="CONFIG.toml",
                   help="a chipset train config, a run directory's config.toml included (as --model FILE); its "
                        "train.global_batch, seq_len and dtype are the starting point the flags override")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="FILE", help="TOML file with a [model] table (a chipset train config), or a "
                     "Hugging Face config.json or model directory")
    src.add_argument("--preset", metavar="NAME", help="a named model (gpt3-175b, llama2-7b, ...)")
    src.add_argument("--module", metavar="package.module:factory",
                     help="any nn.Module factory: parameters and FLOPs are counted on meta tensors and the "
                          "planner answers data-parallel questions (needs --input-shape)")
    p.add_argument("--input-shape", metavar="D1,D2,...", help="per-sample input shape for --module, e.g. 3,224,224")
    p.add_argument("--input-dtype", default="float32", help="input dtype for --module (default float32; int64 for ids)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="model.KEY=VALUE",
                   help="override one model field (repeatable)")
    p.add_argument("--cluster", metavar="NODESxDEVICES:PROFILE", help="for example 64x8:a100-80g")
    p.add_argument("--global-batch", type=int, default=None, metavar="N",
                   help="sequences per step (default: the config's train.global_batch, else 512)")
    p.add_argument("--seq-len", type=int, default=None, metavar="N",
                   help="sequence length (default: the config's train.seq_len, else the model's)")
    p.add_argument("--fix", action="append", default=[], metavar="parallel.KEY=VALUE,...",
                   help="pin layout fields: dp, tp, pp, ep, cp, zero, micro_batch, schedule (1f1b, gpipe, "
                        "interleaved-vN), recompute (none, selective, full), sequence_parallel")
    p.add_argument("--top", type=int, default=5, metavar="K", help="show the K fastest layouts (default 5)")
    p.add_argument("--json", action="store_true", help="machine-readable list of candidates")
    p.add_argument("--write-config", metavar="FILE", help="write the best layout as a chipset train config "
                   "(TOML) to FILE; refuses an existing FILE unless --force (docs/planner.md)")
    p.add_argument("--force", action="store_true", help="with --write-config: overwrite an existing FILE")
    p.add_argument("--intra-node-bw", type=float, default=None, metavar="GBps",
                   help="override the profile's device-to-device bandwidth within a node, GB/s per direction")
    p.add_argument("--inter-node-bw", type=float, default=None, metavar="GBps",
                   help="override the profile's per-device bandwidth across nodes, GB/s per direction")
    p.add_argument("--dtype", default=None, help="compute dtype whose peak FLOP/s applies; float32 also plans "
                   "4-byte parameters and gradients (default: the config's train.dtype, else bfloat16)")
    p.add_argument("--fp8", default=None, choices=("off", "tensorwise", "rowwise"),
                   help="plan FP8 training (train.fp8): the attention and MLP projections at the profile's FP8 peak, "
                        "the rest at --dtype's (default: the config's train.fp8, else off)")
    p.add_argument("--efficiency", type=float, default=None, metavar="FRACTION",
                   help="fraction of peak large GEMMs sustain (default: the profile's, e.g. 0.70 on H100; "
                        "see docs/planner.md)")
    p.add_argument("--attention-efficiency", type=float, default=None, metavar="FRACTION",
                   help="fraction of peak the fused attention kernel sustains (default: the profile's, "
                        "FlashAttention-2 class, e.g. 0.40 on H100)")
    p.add_argument("--update-bytes", type=float, default=None, metavar="N",
                   help="bytes the optimizer update moves per local parameter (default: one fused pass, "
                        "2(P+G+K) = 32; torch.optim.AdamW(foreach=True) with norm clipping: 92)")
    p.add_argument("--loss-bytes", type=float, default=None, metavar="N",
                   help="bytes the loss moves per logit, forward and backward (default: a fused cross-entropy, "
                        "3 passes over the logits, 6 in bf16; F.cross_entropy over logits cast to fp32: 36)")
    p.add_argument("--whole-forward-recompute", action="store_true",
                   help="full recompute reruns each block's whole forward (Megatron-LM, DeepSpeed, reentrant "
                        "checkpointing); default: it stops before the MLP's output projection, as torch's "
                        "non-reentrant checkpoint and chipset's engine do")
    p.add_argument("--context", action="store_true",
                   help="recommend a context layout for the sequence length (--seq-len): cp degree, ring or "
                        "Ulysses attention, recompute, chunked loss and activation offload (docs/long-context.md)")
    p.add_argument("--list-profiles", action="store_true", help="list the device profiles installed plugins declare")
    p.add_argument("--validation", action="store_true",
                   help="print how far the planner is from published training runs and from steps timed on an "
                        "H200 (the tables of docs/planner.md, computed now) and exit")
    from chipset.cli.plan_islands import add_arguments

    add_arguments(p)
    p.set_defaults(run=run)


def _model(args):
    from chipset.planner.model import ModelSpec, apply_model_overrides, get_preset
    from chipset.planner.model_file import load_model_toml

    if not (args.model or args.preset or args.overrides):
        raise ConfigError("no model given: pass --model FILE.toml, --preset NAME or --set model.KEY=VALUE "
                          "(presets: run 'chipset plan --preset x' to list them)")
    if args.model:
        from chipset.planner.hf import is_hf_config, load_hf_config

        if is_hf_config(args.model):
            spec = load_hf_config(args.model)[0]
        else:
            spec = load_model_toml(args.model)
    elif args.preset:
        spec = get_preset(args.preset)
    else:
        spec = ModelSpec()
    spec = apply_model_overrides(spec, args.overrides)
    if args.seq_len is not None:
        if args.seq_len < 1:
            raise ConfigError(f"--seq-len must be a positive integer (found {args.seq_len})")
        from dataclasses import replace

        spec = replace(spec, seq_len=args.seq_len)
    return spec.validate()


DEFAULT_GLOBAL_BATCH, DEFAULT_DTYPE = 512, "bfloat16"


def _train_settings(args) -> tuple[int, str]:
    """(global batch, dtype): the flags, else the ``[train]`` table of a chipset train config given as
    the model, else the defaults. Why: planning a run's own config.toml should plan that run; a flag
    that changes one of its values says so on stderr, since --write-config carries the change.
    (``train.seq_len`` is read with the model, planner/model_file.py.)"""
    from chipset.planner.hf import is_hf_config
    from chipset.train.config import DTYPE_ALIASES

    train = {}
    if args.model and not is_hf_config(args.model):
        from chipset.cli.plan_config import _source_tables

        train = _source_tables(Path(args.model).expanduser()).get("train") or {}
    out = []
    for flag, key, value, default in (("--global-batch", "global_batch", args.global_batch, DEFAULT_GLOBAL_BATCH),
                                      ("--dtype", "dtype", args.dtype, DEFAULT_DTYPE),
                                      ("--seq-len", "seq_len", args.seq_len, 0)):
        mine = train.get(key)
        if mine is not None and (type(mine) is not type(default)):
            raise ConfigError(f"{args.model}: train.{key} = {mine!r}: expected "
                              f"{'a dtype name' if key == 'dtype' else 'a positive integer'}; fix the config")
        same = DTYPE_ALIASES.get(value, value) == mine if key == "dtype" else value == mine
        if value is not None and mine is not None and not same:
            print(f"chipset plan: {flag} {value} replaces train.{key} = {mine!r} of {args.model}", file=sys.stderr)
        out.append(value if value is not None else mine if mine is not None else default)
    if out[1] == "auto":  # train.dtype = "auto": the accelerators planned for train in their default, bf16
        out[1] = DEFAULT_DTYPE
    return out[0], out[1]


def _list_profiles(as_json: bool) -> int:
    from chipset.planner.cluster import list_profiles

    table = list_profiles()
    if as_json:
        print(json.dumps({name: {"backend": b, **p.to_dict()} for name, (b, p) in sorted(table.items())}, indent=2))
        return 0
    if not table:
        print("no device profiles declared by the installed backends")
        return 0
    print(f"{'profile':<16} {'backend':<10} {'memory':>9} {'bf16 peak':>13} {'HBM':>10} {'intra-node':>11} {'inter-node':>11}")
    for name, (backend, p) in sorted(table.items()):
        est = " (estimate)" if p.estimated else ""
        print(f"{name:<16} {backend:<10} {p.total_memory / 2**30:>5.0f} GiB "
              f"{p.peak_flops_for('bfloat16') / 1e12:>7.0f} TFLOP/s {p.memory_bandwidth / 1e9:>6.0f} GB/s "
              f"{p.intra_node_bandwidth / 1e9:>6.0f} GB/s {p.inter_node_bandwidth / 1e9:>6.1f} GB/s{est}")
    return 0


def _warn_unknown_bandwidth(cluster) -> None:
    d = cluster.device
    for what, bw in (("intra-node", d.intra_node_bandwidth), ("inter-node", d.inter_node_bandwidth)):
        if bw <= 0:
            flag = "--intra-node-bw" if what == "intra-node" else "--inter-node-bw"
            print(f"chipset: warning: profile {cluster.profile!r} declares no {what} bandwidth; that traffic is "
                  f"predicted to cost nothing. Pass {flag} GBps.", file=sys.stderr)


def _gib(x: float) -> str:
    return f"{x / 2**30:.1f} GiB"


def explain(best, runner_up, model, cluster, subject: str = "The fastest layout") -> str:
    """One paragraph on why the winner wins: where its time goes and what it trades."""
    lay, b = best.layout, best.breakdown
    step = best.step_time_s
    parts = []
    if lay.tp > 1:
        where = "inside a node" if lay.tp <= cluster.devices_per_node else "across nodes"
        parts.append(f"splits every block over tp={lay.tp} ranks {where}"
                     + (" with sequence parallelism" if lay.sp else ""))
    if lay.pp > 1:
        frac = b["bubble"] / step
        parts.append(f"cuts the {model.layers} blocks into pp={lay.pp} stages run {lay.schedule_label} "
                     f"over {best.micro_batches} micro-batches (bubble {frac:.1%} of the step)")
    if lay.cp > 1:
        parts.append(f"splits each sequence over cp={lay.cp} ranks")
    if lay.ep > 1:
        parts.append(f"spreads the {model.num_experts} experts over ep={lay.ep} ranks")
    dp_n = lay.dp * lay.cp
    if dp_n > 1:
        hidden = 1 - b["dp_exposed"] / b["dp_total"] if b["dp_total"] > 0 else 1.0
        group = f"dp={lay.dp}" if lay.cp == 1 else f"dp={lay.dp} (ZeRO group dp*cp={dp_n})"
        parts.append(f"replicates over {group} with ZeRO-{lay.zero} "
                     f"({hidden:.0%} of its {b['dp_total']:.2f} s of data-parallel traffic hidden behind compute)")
    layout_txt = "; ".join(parts) if parts else "runs on a single device"
    text = (f"{subject} {layout_txt}. It needs {_gib(best.memory.total)} of the "
            f"{_gib(best.memory_limit_bytes)} usable per device (activations {_gib(best.memory.activations)} "
            f"with recompute={lay.recompute}, model states "
            f"{_gib(best.memory.params + best.memory.grads + best.memory.optimizer)}). "
            f"Of its {step:.3g} s step, {b['compute']:.3g} s is compute (GEMMs at {b['gemm_efficiency']:.0%} of peak), "
            f"{b['tp']:.3g} s tensor-parallel, {b['ep']:.3g} s expert all-to-all, {b['pp']:.3g} s pipeline sends, "
            f"{b['bubble']:.3g} s bubble, {b['dp_exposed']:.3g} s exposed data-parallel communication and "
            f"{b['optimizer']:.3g} s optimizer step.")
    if runner_up is not None:
        gain = runner_up.step_time_s / step - 1
        r = runner_up.layout
        text += (f" The runner-up (dp={r.dp} tp={r.tp} pp={r.pp} ep={r.ep} cp={r.cp} ZeRO-{r.zero} "
                 f"micro-batch {r.micro_batch} {r.schedule_label} recompute={r.recompute}) is {gain:.1%} slower.")
    return text


def _validation() -> int:
    from chipset.planner.cluster import list_profiles
    from chipset.planner.published import RUNS
    from chipset.planner.tables import TABLE_TITLES, doc_tables

    profiles = list_profiles()
    missing = sorted({r.profile for r in RUNS} - profiles.keys())
    if missing:
        raise ConfigError(f"the validation tables need the device profiles {', '.join(missing)}, which are not "
                          "installed; they come with chipset-cuda: pip install -e plugins/cuda")
    for name, body in doc_tables(profiles).items():
        print(f"## {TABLE_TITLES[name]}\n\n{body}\n")
    print("Sources, what each leaves unstated, and the known gaps: docs/planner.md, 'Predictions against published runs'.")
    return 0


def run(args) -> int:
    if args.config is not None:
        if args.model or args.preset or args.module:
            raise ConfigError(f"{args.config!r} and --model/--preset/--module both name the model; give one "
                              "(the positional CONFIG.toml is the same as --model CONFIG.toml)")
        args.model = args.config
    if args.list_profiles:
        return _list_profiles(args.json)
    if args.validation:
        return _validation()
    from chipset.planner.assumptions import Assumptions
    from chipset.planner.cluster import resolve_cluster
    from chipset.planner.search import parse_fix, search

    if not args.cluster:
        raise ConfigError("--cluster NODESxDEVICES:PROFILE is required (for example 64x8:a100-80g); "
                          "'chipset plan --list-profiles' lists the profiles")
    if args.top < 1:
        raise ConfigError(f"--top must be at least 1 (found {args.top})")
    cluster = resolve_cluster(args.cluster, args.intra_node_bw, args.inter_node_bw)
    fix = parse_fix(args.fix)
    a = Assumptions()
    device = {}
    for flag, field, value in (("--efficiency", "matmul_efficiency", args.efficiency),
                               ("--attention-efficiency", "attention_efficiency", args.attention_efficiency)):
        if value is not None:
            if not 0 < value <= 1:
                raise ConfigError(f"{flag} must be a fraction of peak in (0, 1] (found {value})")
            device[field] = value
    if args.efficiency is not None:
        a = Assumptions(gemm_efficiency=args.efficiency)
    if device:  # the profile's own values take precedence over Assumptions, so override them there
        cluster = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, **device))
    for flag, value, per in (("--update-bytes", args.update_bytes, "parameter"), ("--loss-bytes", args.loss_bytes, "logit")):
        if value is not None and not value > 0:
            raise ConfigError(f"{flag} must be positive bytes per {per} (found {value})")
    if args.write_config:
        from chipset.cli.plan_config import check_target

        check_target(args.write_config, args.force)
    if args.module:
        if args.write_config:
            raise ConfigError("--write-config needs --model or --preset: a --module factory returns an nn.Module, "
                              "while chipset train's model.family = 'package.module:factory' expects a model "
                              "family (an object with build(cfg), docs/models.md)")
        batch = DEFAULT_GLOBAL_BATCH if args.global_batch is None else args.global_batch
        return _run_module(args, cluster, fix, a, _train_spec(args, batch, args.dtype or DEFAULT_DTYPE))
    model = _model(args)
    train = _train_spec(args, *_train_settings(args))
    from chipset.cli import plan_islands

    isl = plan_islands.settings(args)
    if isl is not None:
        if args.context or args.write_config:
            raise ConfigError("--context and --write-config plan one island's job without islands; drop --islands "
                              "(or islands.count from the config)")
        train = plan_islands.island_train(train, isl)
    if args.context:
        return _context(args, model, train, cluster, a)
    if args.write_config:  # before the search: a config for a model chipset train cannot build would not run
        from chipset.cli.plan_config import check_buildable

        check_buildable(model)
    res = search(model, train, cluster, fix=fix, assumptions=a)
    _warn_unknown_bandwidth(cluster)
    shown = res.candidates[: args.top]
    if res.fixed_only is not None and not res.fixed_only.fits:
        shown = [res.fixed_only]
        f = res.fixed_only
        print(f"chipset: warning: the fixed layout does not fit: it needs {_gib(f.memory.total)} per device, "
              f"usable {_gib(f.memory_limit_bytes)}", file=sys.stderr)
    if args.write_config:
        _write_config(args, model, train, cluster, shown)
    if args.json:
        out = [p.to_json() for p in shown]
        if isl is not None and shown:  # the outer step of the best layout
            out[0]["islands"] = plan_islands.terms(args, shown[0], model, train, cluster, isl)
        print(json.dumps(out, indent=2))
        return 0
    n = cluster.world_size
    print(f"model {model.name}: {model.num_params() / 1e9:.3g}B parameters"
          + (f" ({model.active_params() / 1e9:.3g}B active)" if model.is_moe else "")
          + f", seq {model.seq_len}, global batch {train.global_batch} sequences")
    from chipset.planner.kernels import device_fp8_peak

    d = cluster.device
    print(f"cluster {cluster.nodes}x{cluster.devices_per_node} {cluster.profile} = {n} devices: "
          f"{_gib(d.total_memory)}, {d.peak_flops_for(train.dtype) / 1e12:g} TFLOP/s {train.dtype}, "
          + (f"{device_fp8_peak(d) / 1e12:g} TFLOP/s FP8 projections, " if train.fp8 != "off" else "")
          + f"intra-node {d.intra_node_bandwidth / 1e9:g} GB/s, inter-node {d.inter_node_bandwidth / 1e9:g} GB/s")
    valid = res.layouts_enumerated - sum(v for k, v in res.discarded.items()
                                          if k not in ("does not fit in device memory",
                                                       "interleaved schedule needs micro-batches divisible by pp",
                                                       "global batch not divisible by dp x micro-batch"))
    print(f"searched {res.layouts_enumerated} degree layouts ({valid} valid) and {res.configurations_evaluated} "
          f"configurations; {len(res.candidates)} fit, {res.out_of_memory} do not fit in memory")
    for reason, count in res.discarded.most_common():
        print(f"  discarded {count}: {reason}")
    print()
    hdr = (f"{'#':>2} {'dp':>4} {'tp':>3} {'pp':>3} {'ep':>3} {'cp':>3} {'zero':>4} {'mb':>3} {'schedule':<15} "
           f"{'recompute':<9} {'mem/dev':>10} {'step s':>9} {'tokens/s':>11} {'TFLOP/s':>8} {'MFU':>6}")
    print(hdr)
    for i, p in enumerate(shown, 1):
        lay = p.layout
        flag = "" if p.fits else "  DOES NOT FIT"
        print(f"{i:>2} {lay.dp:>4} {lay.tp:>3} {lay.pp:>3} {lay.ep:>3} {lay.cp:>3} {lay.zero:>4} {lay.micro_batch:>3} "
              f"{lay.schedule_label:<15} {lay.recompute:<9} {_gib(p.memory.total):>10} {p.step_time_s:>9.4g} "
              f"{p.tokens_per_s:>11.4g} {p.tflops_per_device:>8.1f} {p.mfu:>6.1%}{flag}")
    if shown:
        print()
        fixed = res.fixed_only is not None
        print(explain(shown[0], res.candidates[1] if len(res.candidates) > 1 and not fixed else None,
                      model, cluster, "The fixed layout" if fixed else "The fastest layout"))
        if isl is not None:
            print()
            print("\n".join(plan_islands.report(plan_islands.terms(args, shown[0], model, train, cluster, isl))))
    return 0


def _context(args, model, train, cluster, a) -> int:
    """``--context``: the context layouts of planner/context.py, the recommendation first."""
    from chipset.planner.context import context_layouts

    shown = context_layouts(model, train, cluster, model.seq_len, a)[: args.top]
    if args.json:
        print(json.dumps([p.to_json() for p in shown], indent=2))
        return 0
    print(f"model {model.name}, seq {model.seq_len}, global batch {train.global_batch}, "
          f"{cluster.world_size} x {cluster.profile}: context layouts, fastest that fits first")
    print(f"{'#':>2} {'dp':>4} {'cp':>3} {'attention':<10} {'recompute':<9} {'zero':>4} {'loss_chunk':>10} "
          f"{'offload':<7} {'mem/dev':>10} {'step s':>9} {'offload s':>9}")
    for i, p in enumerate(shown, 1):
        lay = p.layout
        attention = lay.cp_attention if lay.cp > 1 else "-"
        if lay.cp_attention == "hybrid":
            attention = f"hybrid{lay.cp_ulysses}x{lay.cp // lay.cp_ulysses}"
        print(f"{i:>2} {lay.dp:>4} {lay.cp:>3} {attention:<10} {lay.recompute:<9} {lay.zero:>4} "
              f"{lay.loss_chunk:>10} {str(lay.offload_activations).lower():<7} {_gib(p.memory.total):>10} "
              f"{p.step_time_s:>9.4g} {p.breakdown['offload']:>9.3g}{'' if p.fits else '  DOES NOT FIT'}")
    best = shown[0]
    if not best.fits:
        print(f"\nnothing fits: the smallest needs {_gib(best.memory.total)} per device; add devices or shorten "
              "the sequence")
        return 0
    lay = best.layout
    sets = [f"parallel.cp={lay.cp}", f"train.recompute={lay.recompute}", f"parallel.zero={lay.zero}"]
    if lay.cp > 1:
        sets.append(f"parallel.cp_attention={lay.cp_attention}")
        if lay.cp_attention == "hybrid":
            sets.append(f"parallel.cp_ulysses={lay.cp_ulysses}")
    if lay.loss_chunk:
        sets.append(f"train.loss_chunk={lay.loss_chunk}")
    if lay.offload_activations:
        sets.append("train.offload_activations=true")
    print("\nrecommended: " + " ".join(f"--set {s}" for s in sets))
    return 0


def _fp8_setting(args) -> str:
    """--fp8, else ``train.fp8`` of a chipset train config given as the model, else off."""
    if args.fp8 is not None or not args.model:
        return args.fp8 or "off"
    from chipset.planner.hf import is_hf_config

    if is_hf_config(args.model):
        return "off"
    from chipset.cli.plan_config import _source_tables
    from chipset.parallel.fp8 import FP8_MODES

    mine = (_source_tables(Path(args.model).expanduser()).get("train") or {}).get("fp8", "off")
    if mine not in FP8_MODES:
        raise ConfigError(f"{args.model}: train.fp8 = {mine!r}: expected one of {', '.join(FP8_MODES)}; fix the config")
    return mine


def _train_spec(args, global_batch: int, dtype: str):
    """The planner's step; parameters and gradients take the dtype's bytes (a float32 run keeps 4-byte
    ones, as planner/run.py plans a run), 2 for a dtype train does not know."""
    from chipset.planner.layout import TrainSpec
    from chipset.planner.run import DTYPE_BYTES
    from chipset.train.config import DTYPE_ALIASES

    e = DTYPE_BYTES.get(DTYPE_ALIASES.get(dtype, dtype), 2)
    return TrainSpec(global_batch=global_batch, dtype=dtype, fp8=_fp8_setting(args), param_bytes=e, grad_bytes=e,
                     update_bytes=args.update_bytes or 0.0, loss_bytes=args.loss_bytes or 0.0,
                     recompute_early_stop=not args.whole_forward_recompute)


def _write_config(args, model, train, cluster, shown) -> None:
    from chipset.cli.plan_config import train_config_text, write_atomic

    if not shown:
        raise ConfigError("--write-config: no layout fits, so there is no config to write; "
                          "see the discarded reasons above, relax --fix or use a larger cluster")
    write_atomic(args.write_config, train_config_text(args, model, train, cluster, shown[0]), args.force)
    print(f"chipset: wrote {args.write_config} (layout #1); launch it with the world size in its header",
          file=sys.stderr)


def _run_module(args, cluster, fix, a, train) -> int:
    from chipset.planner.module import profile_module, search_module

    if args.overrides:
        raise ConfigError("--set model.KEY=VALUE applies to reference-family models, not to --module")
    if not args.input_shape:
        raise ConfigError("--module needs --input-shape (the per-sample input shape, e.g. 3,224,224)")
    try:
        shape = tuple(int(x) for x in args.input_shape.replace("x", ",").split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--input-shape {args.input_shape!r}: expected comma-separated positive integers") from None
    if not shape or min(shape) < 1:
        raise ConfigError(f"--input-shape {args.input_shape!r}: expected comma-separated positive integers")
    _warn_unknown_bandwidth(cluster)
    prof = profile_module(args.module, shape, args.input_dtype)
    res = search_module(prof, train, cluster, fix=fix, assumptions=a)
    shown = res.candidates[: args.top]
    if args.json:
        print(json.dumps([p.to_json() for p in shown], indent=2))
        return 0
    print(f"module {prof.name}: {prof.params / 1e6:.4g}M parameters, {prof.train_flops_per_sample / 1e9:.4g} "
          f"GFLOP per sample (forward + backward, counted on meta tensors), "
          f"{prof.activation_bytes_per_sample / 2**20:.4g} MiB saved activations per sample (traced dtype)")
    print(f"cluster {cluster.nodes}x{cluster.devices_per_node} {cluster.profile} = {cluster.world_size} devices "
          f"(data parallel only); global batch {train.global_batch} samples")
    print(f"{res.configurations_evaluated} configurations; {len(res.candidates)} fit, {res.out_of_memory} do not")
    print()
    print(f"{'#':>2} {'dp':>5} {'zero':>4} {'mb':>3} {'mem/dev':>10} {'step s':>9} {'samples/s':>11} "
          f"{'grad bytes/dev':>15} {'dp s':>8} {'exposed':>8} {'TFLOP/s':>8} {'MFU':>6}")
    for i, p in enumerate(shown, 1):
        lay, b = p.layout, p.breakdown
        vol = sum(c.bytes for c in p.comm)
        print(f"{i:>2} {lay.dp:>5} {lay.zero:>4} {lay.micro_batch:>3} {_gib(p.memory.total):>10} "
              f"{p.step_time_s:>9.4g} {p.tokens_per_s:>11.4g} {vol:>15.4g} {b['dp_total']:>8.3g} "
              f"{b['dp_exposed']:>8.3g} {p.tflops_per_device:>8.1f} {p.mfu:>6.1%}")
    return 0
