"""The ``chipset`` command line. Each command lives in its own module with ``add_parser`` and ``run``."""

from __future__ import annotations

import argparse
import sys
import traceback

from chipset._version import __version__
from chipset.errors import ChipsetError

COMMANDS = ("backends", "info", "train", "plugin", "conformance", "plan", "report", "export")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # exit 2 with one clear line, and a hint
        self.print_usage(sys.stderr)
        self.exit(2, f"chipset: error: {message}\nRun '{self.prog} --help' for the valid commands and options.\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="chipset", description="chipset: one training stack, any chip.")
    p.add_argument("--version", action="version", version=f"chipset {__version__}")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    import importlib

    for name in COMMANDS:
        importlib.import_module(f"chipset.cli.{name}").add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except ChipsetError as exc:
        if args.debug:
            traceback.print_exc()
        print(f"chipset: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("chipset: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
