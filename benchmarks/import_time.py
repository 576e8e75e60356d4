"""How much `import chipset` plus resolving the default backend adds over `import torch`.

Run: python benchmarks/import_time.py [--repeat 7]
Each variant runs in a fresh interpreter; the best of N wall times is reported, since the
minimum is the least disturbed by other load on the machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

BASE = "import torch"
CHIPSET = "import torch; import chipset; chipset.backend(); chipset.list_backends()"


def best_of(code: str, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    base = best_of(BASE, args.repeat)
    full = best_of(CHIPSET, args.repeat)
    print(json.dumps({
        "import_torch_s": round(base, 4),
        "import_torch_chipset_resolve_s": round(full, 4),
        "added_ms": round((full - base) * 1000, 1),
        "repeat": args.repeat,
    }, indent=2))


if __name__ == "__main__":
    main()
