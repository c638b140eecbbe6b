#!/usr/bin/env bash
# The GPU check: under 8 minutes on one GPU, no network. PyTorch must be installed already; specdec
# runs from this checkout (PYTHONPATH=backends), nothing is downloaded or installed.
#
#   build/gpu-check.sh                 # KIT=build/demo-kit, OUT=reports/gpu-check
#
# 1. greedy identity: baseline, spec_draft and spec_eagle engines on CUDA give the CPU's tokens
#    (float64 on both devices, so no rounding difference can flip an argmax), 8 held-out prompts;
# 2. `specdec bench --device cuda` (float32 and float16): tok/s, speedup and acceptance per method.
# Exit status 0 only if every step passed; figures land in $OUT (identity.json, bench-*.json, *.log).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$ROOT/backends${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 PIP_NO_INDEX=1
KIT="${KIT:-$ROOT/build/demo-kit}"
OUT="${OUT:-$ROOT/reports/gpu-check}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
start=$(date +%s)

"$PY" - <<'EOF'
import torch
assert torch.cuda.is_available(), "no CUDA device visible to torch"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) on {torch.cuda.get_device_name(0)}")
EOF

echo "== 1/3 greedy identity, CUDA vs CPU (float64)"
KIT="$KIT" OUT="$OUT" timeout 240 "$PY" - <<'EOF' 2>&1 | tee "$OUT/identity.log"
import json, os, time
from specdec.core.engine_config import EngineConfig, build_engine
from specdec.core.sampling import SamplingParams
from specdec.tools.bench import kit_paths
from specdec.tools.prompts import heldout_prompts

kit, out = os.environ["KIT"], os.environ["OUT"]
paths = kit_paths(kit)
prompts = heldout_prompts(8, "short", 0)
params = SamplingParams(max_tokens=64)
runs = {}
for device in ("cpu", "cuda"):
    for method in ("baseline", "draft", "eagle"):
        t0 = time.perf_counter()
        engine = build_engine(EngineConfig.of(method=method, dtype="float64", device=device, max_batch=8,
                                           policy="fixed", threads=4, **paths))
        runs[device, method] = [r.token_ids for r in engine.generate(prompts, params)]
        print(f"{device:4s} {method:8s} {time.perf_counter() - t0:6.1f} s")
failures = []
for method in ("baseline", "draft", "eagle"):
    for i, (a, b) in enumerate(zip(runs["cpu", method], runs["cuda", method])):
        if a != b:
            at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            failures.append(f"{method} prompt {i}: CUDA differs from CPU at token {at}")
    if runs["cuda", method] != runs["cuda", "baseline"]:
        failures.append(f"{method}: CUDA output differs from the CUDA baseline (not lossless)")
json.dump({"prompts": len(prompts), "tokens": 64, "failures": failures}, open(f"{out}/identity.json", "w"), indent=1)
print("\n".join(failures) or "identical: baseline, spec_draft and spec_eagle on CUDA == CPU, and == the baseline")
raise SystemExit(1 if failures else 0)
EOF

echo "== 2/3 specdec bench --device cuda --dtype float32"
timeout 150 "$PY" -m specdec.cli bench --kit "$KIT" --device cuda --dtype float32 --batch-sizes 1,8 --prompts 8 \
    --max-tokens 128 --repeats 2 --json "$OUT/bench-cuda-float32.json" 2>&1 | tee "$OUT/bench-cuda-float32.log"

echo "== 3/3 specdec bench --device cuda --dtype float16"
timeout 150 "$PY" -m specdec.cli bench --kit "$KIT" --device cuda --dtype float16 --batch-sizes 1,8 --prompts 8 \
    --max-tokens 128 --repeats 2 --json "$OUT/bench-cuda-float16.json" 2>&1 | tee "$OUT/bench-cuda-float16.log"

echo "gpu-check passed in $(( $(date +%s) - start )) s; figures in $OUT"
