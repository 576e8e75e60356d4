"""``chipset data prepare|info``: tokenize documents into token shards, and describe a prepared folder."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("data", help="prepare tokenized training data (data.source = 'tokens')",
                       description="Tokenize text, JSONL or Parquet documents with a Hugging Face tokenizer "
                       "into token shards that `chipset train` reads with data.source = 'tokens' "
                       "(docs/data.md).")
    cmds = p.add_subparsers(dest="data_command", metavar="SUBCOMMAND", parser_class=sub._parser_class)
    cmds.required = True
    prep = cmds.add_parser("prepare", help="tokenize documents into a token folder",
                           description="Documents: each text file is one document; each JSONL line's "
                           "--field; each Parquet row's --field column. Folders are walked in sorted order and "
                           "contribute the files whose extension is in --ext (the others are counted and "
                           "reported, not read); a file named on its own is always read (as text unless it "
                           "is .jsonl/.json or .parquet). "
                           "A folder saved by Hugging Face datasets (save_to_disk) is one input, its --field "
                           "column read through the datasets package (chipset[hf-data]). "
                           "Every document is followed by the tokenizer's EOS token.")
    prep.add_argument("inputs", nargs="+", metavar="INPUT", help="text, JSONL or Parquet files, folders of them, or saved HF datasets")
    prep.add_argument("--tokenizer", required=True, metavar="PATH",
                      help="a tokenizers tokenizer.json, or a model directory holding one")
    prep.add_argument("--out", required=True, metavar="DIR", help="new folder to write (never overwritten)")
    prep.add_argument("--field", default="text", help="JSONL field / Parquet or dataset column holding the text (default text)")
    prep.add_argument("--workers", type=int, default=0, metavar="N",
                      help="tokenizer processes (default: the CPUs available, at most 8)")
    prep.add_argument("--shard-tokens", type=int, default=100_000_000, metavar="N",
                      help="start a new shard after this many tokens (default 100M)")
    prep.add_argument("--ext", default=None, metavar="LIST",
                      help="comma-separated extensions read from folders, replacing the default "
                      ".txt,.md,.text,.jsonl,.json,.parquet (.jsonl/.json are JSONL, .parquet Parquet, "
                      "any other is text), e.g. --ext .py,.md,.txt")
    prep.add_argument("--eos-token", default=None, metavar="TOKEN",
                      help="end-of-document token (default: the model's eos_token, else a common name)")
    prep.set_defaults(run=run_prepare)
    info = cmds.add_parser("info", help="describe a token folder or .bin file")
    info.add_argument("path", metavar="PATH")
    info.set_defaults(run=run_info)


def run_prepare(args) -> int:
    from chipset.data.prepare import INPUT_SUFFIXES, parse_extensions, prepare
    from chipset.errors import ConfigError

    if args.workers < 0:
        raise ConfigError(f"--workers {args.workers}: expected 0 (automatic) or a positive number of processes")
    exts = INPUT_SUFFIXES if args.ext is None else parse_extensions(args.ext)
    meta = prepare(args.inputs, args.tokenizer, args.out, field=args.field, workers=args.workers,
                   shard_tokens=args.shard_tokens, eos_token=args.eos_token, extensions=exts)
    print(f"chipset data prepare: {meta['documents']} documents, {meta['tokens']} tokens ({meta['dtype']}, "
          f"vocab {meta['vocab_size']}, eos {meta['eos_id']}) in {len(meta['shards'])} shard(s) -> {args.out}")
    print(f"train on it: chipset train --set data.source=tokens --set data.path={args.out} "
          f"--set model.vocab_size={meta['vocab_size']}")
    return 0


def run_info(args) -> int:
    from chipset.data import open_tokens

    store = open_tokens(args.path)
    m = store.meta
    print(f"{store.source}: {store.total} tokens in {len(store.shards)} shard(s), dtype {m.get('dtype')}")
    for key in ("documents", "vocab_size", "eos_id"):
        if key in m:
            print(f"  {key}: {m[key]}")
    if "tokenizer" in m:
        print(f"  tokenizer: {m['tokenizer']['file']} (sha256 {m['tokenizer']['sha256'][:16]})")
    return 0
