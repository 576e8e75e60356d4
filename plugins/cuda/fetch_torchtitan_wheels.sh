#!/usr/bin/env bash
# Download the wheels the GPU check's torchtitan comparison (step torchtitan_peer) needs on an
# offline device machine into vendor_wheels/ (git-ignored, ~11 MB): torchtitan and what
# `import torchtitan.train` needs beyond torch, numpy and rich (gpu_check_peers.VENDOR_WHEELS).
# Run on a machine with internet; gpu_check.sh installs them with --no-deps --no-index.
#
#   bash plugins/cuda/fetch_torchtitan_wheels.sh [DEST]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
dest="${1:-$root/vendor_wheels}"
PY="${PYTHON:-python}"
wheels=$("$PY" -c "import sys; sys.path.insert(0, sys.argv[1]); import gpu_check_peers as p; print(' '.join(p.VENDOR_WHEELS))" "$here")
# binary wheels for x86-64 Linux; tokenizers and protobuf are abi3 (any CPython >= 3.10), the rest pure Python
# shellcheck disable=SC2086
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.11 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d "$dest" $wheels
echo "wheels in $dest: $(ls "$dest" | wc -l) files, $(du -sh "$dest" | cut -f1)"
