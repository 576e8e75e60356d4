"""The CLI reference page (docs/cli.md), generated from the argparse parsers.

``python -m chipset.cli.reference --write`` regenerates docs/cli.md; tests/docs/test_docs_site.py
checks that every command, option and help text of the live parsers is on the page, so
the page cannot go stale. Not a command itself (it is not in ``COMMANDS``).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

__all__ = ["iter_parsers", "render"]

WIDTH = 100

HEADER = """# CLI reference

Generated from the argparse parsers by `python -m chipset.cli.reference --write`; a test
checks that every command, option and help text below matches the code. Every command
exits 0 on success, 2 on a usage or configuration error (with one line saying what was
expected, what was found and what to do), 1 on other failures; `chipset --debug COMMAND`
shows the traceback of an error.
"""


def iter_parsers(parser: argparse.ArgumentParser | None = None, prefix: str = "chipset"):
    """Yield ``(command line, parser)`` for the root parser and every sub-command, depth first."""
    if parser is None:
        from chipset.cli.main import build_parser

        parser = build_parser()
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from iter_parsers(sub, f"{prefix} {name}")


def _help(parser: argparse.ArgumentParser) -> str:
    # A fixed width so the page does not depend on the terminal that generated it.
    parser.formatter_class = functools.partial(argparse.HelpFormatter, width=WIDTH)
    return parser.format_help().rstrip()


def render() -> str:
    """The whole docs/cli.md text."""
    parts = [HEADER]
    for line, parser in iter_parsers():
        parts.append(f"## `{line}`\n\n```text\n{_help(parser)}\n```\n")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m chipset.cli.reference", description=__doc__)
    p.add_argument("--write", action="store_true", help="write docs/cli.md (else print the page)")
    p.add_argument("--path", type=Path, default=Path("docs/cli.md"), help="where --write puts it")
    args = p.parse_args(argv)
    text = render()
    if args.write:
        args.path.write_text(text)
        print(f"wrote {args.path}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
