#!/usr/bin/env bash
# chipset GPU check for AMD (ROCm build of torch) or Intel (XPU build of torch) GPUs, beside
# plugins/cuda/gpu_check.sh. Prepared, never yet run on such hardware. No internet: chipset is
# installed from this checkout with --no-deps --no-build-isolation.
#
#   TARGET=rocm OUT=/tmp/gpu_check bash plugins/accelerator/gpu_check.sh
#   TARGET=xpu  OUT=/tmp/gpu_check bash plugins/accelerator/gpu_check.sh
#
# Writes $OUT/gpu_check.json and $OUT/gpu_check.md. Exit 0 only when every step passed.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
OUT="${OUT:-$root/gpu_check_out}"
TARGET="${TARGET:?set TARGET=rocm or TARGET=xpu}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"
cd "$root"
if ! "$PY" -m pip install --no-deps --no-build-isolation -q -e . -e plugins/accelerator -e plugins/cuda -e plugins/cpu_sim \
    >"$OUT/install.log" 2>&1; then
  echo "pip install of the checkout failed (see $OUT/install.log)"
fi
timeout 270 "$PY" "$here/gpu_check.py" --target "$TARGET" --out "$OUT"
rc=$?
echo "gpu_check exit $rc; results in $OUT/gpu_check.json"
exit $rc
