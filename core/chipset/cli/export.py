"""``chipset export RUN_DIR [--step N] --format hf|torch|peft --out DIR``: a checkpoint for other tools."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser(
        "export",
        help="write a run's checkpoint as a Hugging Face model folder or one torch state-dict file",
        description="Read a checkpoint of RUN_DIR (any layout: dp, ZeRO, tp, pp, ...) in this one process, "
        "without launching ranks, and write it to the new folder --out: --format hf writes config.json and "
        "safetensors (sharded above --max-shard-mb, with model.safetensors.index.json) that "
        "transformers.AutoModelForCausalLM.from_pretrained loads; --format torch writes model.pt (chipset "
        "parameter names) and config.json (the [model] section); a LoRA run's adapters are merged into both. "
        "--format peft writes a LoRA run's adapters alone (adapter_config.json, adapter_model.safetensors) "
        "for peft.PeftModel.from_pretrained. Weights come from the fp32 masters. "
        "docs/hf.md.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory chipset train wrote (with checkpoints/)")
    p.add_argument("--step", type=int, default=None, metavar="N", help="the checkpoint of step N (default: newest)")
    p.add_argument("--format", default="hf", choices=("hf", "torch", "peft"),
                   help="output format (default hf); peft: a LoRA run's adapters as a PEFT adapter folder")
    p.add_argument("--out", required=True, metavar="DIR", help="new or empty folder to write (never overwritten)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="dtype of the written weights (default float32)")
    p.add_argument("--max-shard-mb", type=float, default=2048.0, metavar="MB",
                   help="largest safetensors file before the weights are split (default 2048)")
    p.set_defaults(run=run)


def run(args) -> int:
    from chipset.train.checkpoint.export import export

    done = export(args.run_dir, args.out, step=args.step, fmt=args.format, dtype=args.dtype,
                  max_shard_mb=args.max_shard_mb)
    print(f"chipset export: wrote {args.out} ({args.format}, {args.dtype}) from {done.checkpoint}")
    for note in done.notes:  # hf: the special ids, generation config and tokenizer carried, or why none
        print(f"  {note}")
    return 0
