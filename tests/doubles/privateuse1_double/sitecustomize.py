"""TEST DOUBLE harness: with TOY_ACCEL_DOUBLE=1, every Python process on this PYTHONPATH
imports the toy vendor package first, as a vendor's autoload entry point would."""

import os

if os.environ.get("TOY_ACCEL_DOUBLE") == "1":
    import toy_accel  # noqa: F401
