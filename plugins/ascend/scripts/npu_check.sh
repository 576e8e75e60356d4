#!/usr/bin/env bash
# NPU check for owners of Ascend hardware (verification layer 2, docs/ascend.md).
#
#   source /usr/local/Ascend/ascend-toolkit/set_env.sh   # CANN
#   bash plugins/ascend/scripts/npu_check.sh [OUT_DIR]
#
# Runs, in order, and writes every result under OUT_DIR (default npu-check-<time>):
#   backends.json      chipset backends --json (ascend must be "ok")
#   conformance.json   chipset conformance --backend ascend (the whole suite)
#   kernels.json       per kernel: fused torch_npu operator vs chipset reference, ms per call, bf16
#   train/summary.json a short bf16 training run (tokens/s); mfu.json: MFU against the profile's peak
#   summary.json       everything above in one file, with the exit status of each step
# A failing step is recorded and the next step still runs; the script exits non-zero if any failed.
# NPU_CHECK_SHAPES=B,N,S,D,H changes the kernel shapes (default 4,32,2048,128,4096);
# NPU_CHECK_TRAIN_STEPS the training steps (default 30); NPU_CHECK_TRAIN_ARGS extra
# `chipset train` arguments (e.g. "--set model.hidden=2048 ..." for a model large
# enough that MFU means something: the default model is tiny).
set -u
OUT="${1:-npu-check-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"
declare -A RC

step() {  # step NAME COMMAND...
  local name="$1"; shift
  echo "== $name: $*"
  "$@"; RC[$name]=$?
  echo "== $name: exit ${RC[$name]}"
}

step versions "$PY" -c 'import json, torch, torch_npu; print(json.dumps({"torch": torch.__version__, "torch_npu": torch_npu.__version__, "npus": torch.npu.device_count(), "soc": torch.npu.get_device_name(0)}))'
"$PY" -m chipset.cli.main backends --json > "$OUT/backends.json"; RC[backends]=$?
step conformance "$PY" -m chipset.cli.main conformance --backend ascend --json-report "$OUT/conformance.json"

step kernels "$PY" - "$OUT/kernels.json" <<'PYEOF'
import json, sys
import torch
import chipset

b = chipset.backend("ascend")
dev = b.device.torch_device(0)
bf = torch.bfloat16
import os
B, N, S, D, H = (int(t) for t in os.environ.get("NPU_CHECK_SHAPES", "4,32,2048,128,4096").split(","))
x = torch.randn(B * S, H, device=dev, dtype=bf)
q, k, v = (torch.randn(B, N, S, D, device=dev, dtype=bf) for _ in range(3))
cos = torch.randn(S, D, device=dev, dtype=bf).clamp(-1, 1)
params = [torch.randn(H, H, device=dev) for _ in range(4)]
state = [[torch.zeros_like(p) for p in params] for _ in range(2)]
cases = {
    "rms_norm": ((x, torch.ones(H, device=dev, dtype=bf)), {}),
    "swiglu": ((x, x), {}),
    "rotary_embedding": ((q, cos, cos), {}),
    "scaled_dot_product_attention": ((q, k, v), {"causal": True}),
    "fused_adamw": ((params, params, state[0], state[1], 1), {"lr": 1e-4}),
}

def ms(fn, args, kw, iters=20):
    for _ in range(3):
        fn(*args, **kw)
    start, end = b.device.event(enable_timing=True), b.device.event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn(*args, **kw)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters

out = {}
for name, (args, kw) in cases.items():
    fused = b.kernels.select(name, *args, **kw)
    ref = b.kernels.reference(name)
    row = {"fused_available": fused is not ref, "reference_ms": ms(ref, args, kw)}
    row["fused_ms"] = ms(fused, args, kw) if fused is not ref else None
    out[name] = row
    print(name, row)
json.dump({"shapes": {"B": B, "N": N, "S": S, "D": D, "H": H}, "dtype": "bfloat16", "kernels": out}, open(sys.argv[1], "w"), indent=2)
PYEOF

step train "$PY" -m chipset.cli.main train --set train.dtype=bfloat16 --set train.steps="${NPU_CHECK_TRAIN_STEPS:-30}" --run-dir "$OUT/train" ${NPU_CHECK_TRAIN_ARGS:-}

step mfu "$PY" - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
import chipset
from chipset.config import load_config
from chipset.planner.flops import model_flops_per_token
from chipset.planner.model import from_engine_model_config

out = Path(sys.argv[1])
summary = json.loads((out / "train" / "summary.json").read_text())
cfg = load_config(out / "train" / "config.toml")
spec = from_engine_model_config(cfg.model, cfg.train.seq_len)
peak = chipset.backend("ascend").device.properties(0).peak_flops_for("bfloat16")
achieved = summary["tokens_per_s"] * model_flops_per_token(spec)
mfu = {"tokens_per_s": summary["tokens_per_s"], "model_flops_per_token": model_flops_per_token(spec),
       "peak_bf16_flops_per_device": peak, "world_size": summary["world_size"],
       "mfu": achieved / (peak * summary["world_size"]) if peak else None,
       "note": "peak from chipset's 910B profile (an estimate, docs/ascend.md); the default model is tiny, so MFU is low by design"}
(out / "mfu.json").write_text(json.dumps(mfu, indent=2))
print(mfu)
PYEOF

"$PY" - "$OUT" "versions=${RC[versions]}" "backends=${RC[backends]}" "conformance=${RC[conformance]}" "kernels=${RC[kernels]}" "train=${RC[train]}" "mfu=${RC[mfu]}" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rc = dict(a.split("=") for a in sys.argv[2:])
doc = {"exit_status": {k: int(v) for k, v in rc.items()}}
for name in ("backends.json", "conformance.json", "kernels.json", "mfu.json", "train/summary.json"):
    p = out / name
    doc[name] = json.loads(p.read_text()) if p.exists() else None
(out / "summary.json").write_text(json.dumps(doc, indent=2))
print(f"results: {out / 'summary.json'}")
PYEOF

for name in "${!RC[@]}"; do [ "${RC[$name]}" -eq 0 ] || exit 1; done
