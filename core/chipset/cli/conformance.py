"""``chipset conformance``: certify an installed backend with the conformance suite.

Equivalent plain pytest invocation (what this command runs)::

    pytest -p chipset.conformance.plugin -p no:cacheprovider --pyargs chipset.conformance.tests \\
        --chipset-backend NAME [--chipset-json-report FILE] [--junit-xml FILE] [-k EXPR]
"""

from __future__ import annotations

import os
import sys

from chipset.discovery.select import select


def add_parser(sub) -> None:
    p = sub.add_parser(
        "conformance",
        help="run the conformance suite against an installed backend",
        description="Run chipset's conformance suite (a pytest plugin shipped in core) against one "
        "installed backend. Exit 0 only with no failures and no errors.",
    )
    p.add_argument("--backend", required=True, metavar="NAME", help="backend to certify (as listed by `chipset backends`)")
    p.add_argument("--json-report", metavar="FILE", help="write the JSON report (summary, groups, tests) here")
    p.add_argument("--junit-xml", metavar="FILE", help="write a JUnit XML report here")
    p.add_argument("-k", metavar="EXPR", dest="keyword", help="only run tests matching the pytest -k expression (e.g. 'memory or rng')")
    p.add_argument("--keep-going", action="store_true",
                   help="run every check even when methods of the backend still raise NotImplementedError "
                   "(by default those are listed once, as a work plan, and no check runs)")
    p.add_argument("-q", "--quiet", action="store_true", help="less pytest output (the matrix is always printed)")
    p.set_defaults(run=run)


def run(args) -> int:
    try:
        import pytest
    except ModuleNotFoundError:
        # The suite is a pytest plugin; pytest is an extra, not a dependency of training.
        print(
            "chipset conformance: the conformance suite needs pytest, which is not installed in this "
            f"environment ({sys.executable}). Install the extra: pip install 'chipset[conformance]'",
            file=sys.stderr,
        )
        return 2

    from chipset.conformance import pytest_args

    # Fail before pytest starts when the backend cannot run here (absent hardware is
    # not a pass): BackendSelectionError carries exit code 2 and lists every backend.
    sel = select(args.backend)
    os.environ["CHIPSET_BACKEND"] = sel.record.name
    extra = ["-q"] if args.quiet else []
    code = pytest.main(pytest_args(
        sel.record.name, json_report=args.json_report, junit_xml=args.junit_xml,
        keyword=args.keyword, keep_going=args.keep_going, extra=extra,
    ))
    if code == pytest.ExitCode.OK:
        return 0
    if code in (pytest.ExitCode.USAGE_ERROR, pytest.ExitCode.INTERRUPTED):
        return 2
    return 1
