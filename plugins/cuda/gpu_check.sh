#!/usr/bin/env bash
# chipset-cuda GPU check: run from anywhere on a machine with an NVIDIA GPU, a CUDA build
# of torch, pluggy and numpy installed (triton and pytest used when present). No internet:
# chipset is installed from this checkout with --no-deps --no-build-isolation.
#
#   OUT=/tmp/gpu_check bash plugins/cuda/gpu_check.sh [--steps core,fp8,lora] [--titan ...]
#
# Arguments go to gpu_check.py (--steps picks steps or groups: core, fp8, lora, torchtitan).
# Writes $OUT/gpu_check.json, $OUT/gpu_check.md (and conformance-cuda.json/.log when the
# installed chipset has the conformance suite). Exit 0 only when every step passed.
# Budget: install ~20 s, core steps 250 s, everything 540 s, hard stop at 570 s.
# torchtitan (step torchtitan_peer) is installed from vendor_wheels/ when that folder holds
# wheels (plugins/cuda/fetch_torchtitan_wheels.sh fills it on a machine with internet).
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
if ls "$root"/vendor_wheels/*.whl >/dev/null 2>&1; then
  if ! "$PY" -m pip install --no-deps --no-index -q "$root"/vendor_wheels/*.whl >"$OUT/install_vendor.log" 2>&1; then
    echo "pip install of vendor_wheels/ failed (see $OUT/install_vendor.log); torchtitan_peer will say why"
  fi
fi
timeout 570 "$PY" "$here/gpu_check.py" --out "$OUT" "$@"
rc=$?
echo "gpu_check exit $rc; results in $OUT/gpu_check.json"
exit $rc
