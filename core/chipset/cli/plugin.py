"""``chipset plugin new NAME --dir DIR``: scaffold a vendor backend distribution."""

from __future__ import annotations

from pathlib import Path

from chipset.plugin_kit import scaffold


def add_parser(sub) -> None:
    p = sub.add_parser("plugin", help="tools for backend plugin authors")
    psub = p.add_subparsers(dest="plugin_command", metavar="ACTION")
    psub.required = True
    new = psub.add_parser("new", help="scaffold a new backend plugin distribution")
    new.add_argument("name", help="backend name, e.g. acme_npu")
    new.add_argument("--dir", type=Path, default=None, help="target directory (default: ./chipset-NAME)")
    new.set_defaults(run=run_new)


def run_new(args) -> int:
    target = args.dir or Path(f"chipset-{args.name.replace('_', '-')}")
    files = scaffold(args.name, target)
    print(f"created backend plugin {args.name!r} in {target}:")
    for f in files:
        print(f"  {f}")
    print("next:")
    print(f"  pip install -e {target}")
    print(f"  CHIPSET_BACKEND={args.name} chipset backends")
    print(f"  chipset conformance --backend {args.name}   # lists every method still to write")
    return 0
