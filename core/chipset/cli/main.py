"""The ``chipset`` command line. Each command lives in its own module with ``add_parser`` and ``run``."""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from chipset._version import __version__
from chipset.errors import ChipsetError

COMMANDS = ("backends", "models", "info", "train", "rl", "plugin", "conformance", "plan", "report", "diagnose", "data",
            "export", "generate")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # exit 2 with one clear line, and a hint
        self.print_usage(sys.stderr)
        self.exit(2, f"chipset: error: {message}{self._suggest(message)}\n"
                     f"Run '{self.prog} --help' for the valid commands and options.\n")

    def _suggest(self, message: str) -> str:
        """'did you mean' for a mistyped command or option (argparse on Python < 3.14 has none)."""
        import difflib
        import re

        m = re.search(r"invalid choice: '([^']*)'", message)
        if m:
            choices = [c for a in self._actions if a.choices for c in a.choices]
            words = [m.group(1)]
        else:
            m = re.search(r"unrecognized arguments: (.*)", message)
            if not m:
                return ""
            choices = sorted(set(_options(self)))
            words = [w.split("=")[0] for w in m.group(1).split() if w.startswith("-")]
        hints = [f"{w!r} -> {close[0]!r}" for w in words
                 if (close := difflib.get_close_matches(w, choices, n=1, cutoff=0.6))]
        return f" (did you mean: {', '.join(hints)}?)" if hints else ""


def _options(parser) -> list[str]:
    """Every option string of ``parser`` and its sub-commands (unknown options reach the top parser)."""
    out = []
    for a in parser._actions:
        out += a.option_strings
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                out += _options(sub)
    return out


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
    from chipset.logs import configure

    configure()
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
    except BrokenPipeError:
        # the reader went away (`chipset plan --validation | head`): stop quietly, as a Unix tool
        # does, and keep Python from complaining again when it flushes stdout at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def entry() -> None:
    """The ``chipset`` command: :func:`main`, then the process ends without the interpreter's
    teardown (chipset._process.exit_process). Call :func:`main` to run a command in-process."""
    from chipset._process import exit_process

    exit_process(main())


if __name__ == "__main__":
    entry()
