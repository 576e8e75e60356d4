"""``chipset generate RUN_DIR --prompt TEXT``: sample from a run's checkpoint without exporting it."""

from __future__ import annotations

import json
import sys


def add_parser(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="sample text from a run's checkpoint (no export, no launch)",
        description="Load a checkpoint of RUN_DIR (any layout) into this one process and sample completions "
        "of --prompt with a KV cache: the tokenizer the run's data was prepared with (or model.init_from's), "
        "bytes for data.source = 'text', token ids (--prompt-ids) for synthetic data. Stops at the "
        "tokenizer's end-of-sequence id or after --max-new-tokens. docs/generate.md.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory chipset train wrote (with checkpoints/)")
    p.add_argument("--prompt", default=None, help="the text to continue")
    p.add_argument("--prompt-ids", default=None, metavar="I,J,...", help="token ids to continue instead of text")
    p.add_argument("--step", type=int, default=None, metavar="N", help="the checkpoint of step N (default: newest)")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="longest completion (default 64)")
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature, > 0 (default 1.0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1.0: off)")
    p.add_argument("--greedy", action="store_true", help="always the most likely token (ignores temperature, top-p)")
    p.add_argument("--num", type=int, default=1, metavar="N", help="completions of the prompt (default 1)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed: the same seed gives the same completions")
    p.add_argument("--json", action="store_true", help="print one JSON object (ids and text) instead of text")
    p.set_defaults(run=run)


def run(args) -> int:
    from chipset.errors import UsageError
    from chipset.train.generate import generate

    if (args.prompt is None) == (args.prompt_ids is None):
        raise UsageError("give exactly one of --prompt TEXT or --prompt-ids I,J,... (token ids)")
    if args.max_new_tokens < 1 or args.num < 1:
        raise UsageError(f"--max-new-tokens ({args.max_new_tokens}) and --num ({args.num}) must be >= 1")
    if not args.greedy and not (args.temperature > 0 and 0 < args.top_p <= 1):
        raise UsageError(f"--temperature ({args.temperature}) must be > 0 and --top-p ({args.top_p}) in (0, 1]; "
                         "or use --greedy")
    ids = None
    if args.prompt_ids is not None:
        try:
            ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise UsageError(f"--prompt-ids {args.prompt_ids!r}: expected comma-separated token ids, e.g. 1,2,3") from None
        if not ids:
            raise UsageError("--prompt-ids is empty: give at least one token id")
    out = generate(args.run_dir, prompt=args.prompt, prompt_ids=ids, step=args.step, max_new_tokens=args.max_new_tokens,
                   temperature=args.temperature, top_p=args.top_p, greedy=args.greedy, num=args.num, seed=args.seed)
    if args.json:
        print(json.dumps(out.to_dict()))
        return 0
    print(f"chipset generate: {out.checkpoint} ({out.tokenizer})", file=sys.stderr)
    for i, c in enumerate(out.completions):
        if args.num > 1:
            print(f"--- completion {i + 1}")
        print(out.prompt_text + c.text if c.text is not None else " ".join(map(str, out.prompt_ids + c.ids)))
    return 0
