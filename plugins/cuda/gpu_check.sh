#!/usr/bin/env bash
# chipset-cuda GPU check: run from anywhere on a machine with an NVIDIA GPU, a CUDA build
# of torch, pluggy and numpy installed (triton and pytest used when present). No internet:
# chipset is installed from this checkout with --no-deps --no-build-isolation.
#
#   OUT=/tmp/gpu_check bash plugins/cuda/gpu_check.sh
#
# Writes $OUT/gpu_check.json, $OUT/gpu_check.md (and conformance-cuda.json/.log when the
# installed chipset has the conformance suite). Exit 0 only when every step passed.
# Budget: under 5 minutes (install ~20 s, checks budgeted 250 s, hard stop at 270 s).
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
OUT="${OUT:-$root/gpu_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"
cd "$root"
if ! "$PY" -m pip install --no-deps --no-build-isolation -q -e . -e plugins/accelerator -e plugins/cuda -e plugins/cpu_sim >"$OUT/install.log" 2>&1; then
  echo "pip install of the checkout failed (see $OUT/install.log); gpu_check.py falls back to the sources"
fi
timeout 270 "$PY" "$here/gpu_check.py" --out "$OUT"
rc=$?
echo "gpu_check exit $rc; results in $OUT/gpu_check.json"
exit $rc
