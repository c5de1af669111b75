#!/usr/bin/env bash
# The training (TTT) step on a lent GPU, in one command that fits one device call (8 minutes of parts at
# most with the budget below; give the call a timeout of ~540 s):
#
#     bash benchmarks/gpu_ttt.sh                    # text and JSON figures in $OUT (/tmp/eaglekit-gpu-ttt when unset)
#     bash benchmarks/gpu_ttt.sh --device cpu --tiny  # the dry run: every part at a tiny size on the CPU
#
# Parts, each its own process under its own `timeout`, so a failing part or a failing peer costs its own
# figures only (a part that would end past the budget is skipped and says so). The goal figures come first:
# on a fresh machine inductor compiles the fused step for ~100 s (measured on an H200, 2026-12-04: every part
# of the first version of this script, with 40-80 s limits, ran out of time while compiling).
#   eaglekit_kimi  reference vs fused (benchmarks/ttt_step.py --variants), timed interleaved, with the share
#                  of 790 TFLOP/s (the H200's bf16 dense rate) and one profiled step per variant (attention,
#                  GEMMs, head loss, the rest)
#   speculators_*  speculators 0.9.0 on the same shape: its compiled path first; where that fails its eager KL
#                  loss under its compiled model (its fully eager mode runs flex attention uncompiled, which
#                  did not finish one Kimi-shaped step in 80 s there, so it is last); summary.txt says which ran
#   check_*        eaglekit's fused step against its reference (fp32; loss and every gradient), on unpacked
#                  rows and on rows packed with 4 documents: the GPU half of tests/drafters/test_fused_step.py
#   eaglekit_h4096, memory_per_step   the smaller shape and the memory of one extra TTT step (the budget
#                  usually skips them on a fresh machine)
# Shapes: H=4096 L=2048 (32 x 128 heads, 8 KV heads, V=128256) and the Kimi-K2.5 drafter (H=7168, 56 x 128
# heads, GQA 4 = 14 KV heads, I=21504, L=4096, V=163840); both K=7, Vd=32000, bf16, lm_head frozen on both sides.
#
# Needs a python with a CUDA build of torch (PYTHON, default python3); eaglekit comes from this working tree.
# A bare GPU image lacks speculators and its requirements: cp312 manylinux wheels put in .whl/ beforehand
# (`pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl speculators==0.9.0 ...`, the list
# in benchmarks/setup_speculators.sh) are installed into /tmp/site first; without them the speculators parts
# say so and eaglekit's figures stand alone. eaglekit's benchmark needs nothing beyond torch and transformers.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/eaglekit-gpu-ttt}
PY=${PYTHON:-python3}
BUDGET=${BUDGET:-480}  # seconds for all parts together
DEVICE=cuda
TINY=()
while [ $# -gt 0 ]; do
  case $1 in
    --device) DEVICE=$2; shift 2 ;;
    --tiny) TINY=(--tiny); shift ;;
    *) echo "usage: $0 [--device cuda|cpu] [--tiny]" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1  # figures reach $OUT even when a part hits its time limit
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
START=$SECONDS

{ nvidia-smi || true
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
  "$PY" -c "from importlib.metadata import version; import speculators; print('speculators', version('speculators'))" \
    2>/dev/null || echo "speculators: not importable (eaglekit figures alone)"
} > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"

STEP=(benchmarks/ttt_step.py --device "$DEVICE" --threads "$(nproc)" --freeze-lm-head "${TINY[@]}")
H4096=(--sizes 4096x2048 --head-dim 128 --gqa 4 --vocab 128256 --draft-vocab 32000)
KIMI=(--sizes 7168x4096 --head-dim 128 --gqa 4 --vocab 163840 --draft-vocab 32000)
TIMED=(--warmup 2 --repeats 5 --profile --peak-tflops 790)

part() {  # part NAME SECONDS ARGS...: one process, its output to $OUT/NAME.txt and NAME.json
  local name=$1 limit=$2
  shift 2
  if [ $((SECONDS - START + limit)) -gt "$BUDGET" ]; then
    echo "== $name skipped: ${limit}s would pass the ${BUDGET}s budget" | tee "$OUT/$name.txt"
    return 1
  fi
  echo "== $name (limit ${limit}s): $PY $*"
  timeout "$limit" "$PY" "$@" --json "$OUT/$name.json" 2>&1 | grep -v '^USDT' | tee "$OUT/$name.txt"
  local rc=${PIPESTATUS[0]}
  echo "== $name exit $rc" | tee -a "$OUT/$name.txt"
  return "$rc"
}

speculators_ran() {  # did the part's JSON time speculators?
  "$PY" -c "import json, sys; r = json.load(open(sys.argv[1]))['results']
sys.exit(0 if r and 'speculators' in r[0]['median_s'] else 1)" "$OUT/$1.json" 2>/dev/null
}

speculators() {  # speculators NAME SECONDS SHAPE...: its compiled path, else the fallbacks, in order
  local name=$1 limit=$2 mode
  shift 2
  for mode in default eager-loss eager; do  # each a fresh process: a failed compile leaves nothing behind
    part "speculators_${name}_$mode" "$limit" "${STEP[@]}" "$@" "${TIMED[@]}" --speculators-only \
      --speculators-mode "$mode"
    speculators_ran "speculators_${name}_$mode" && return 0
    grep -q "not importable" "$OUT/speculators_${name}_$mode.txt" 2>/dev/null && return 1
  done
}

part eaglekit_kimi 200 "${STEP[@]}" "${KIMI[@]}" "${TIMED[@]}" --variants reference,fused --eaglekit-only
speculators kimi 130 "${KIMI[@]}"
part check_packed 120 "${STEP[@]}" --check --variants fused --dtype float32 --sizes 1024x1024 --documents 4 \
  --head-dim 128 --gqa 4 --vocab 32000 --draft-vocab 8000 --eaglekit-only
part check_unpacked 120 "${STEP[@]}" --check --variants fused,compiled --dtype float32 --sizes 1024x1024 \
  --head-dim 128 --gqa 4 --vocab 32000 --draft-vocab 8000 --eaglekit-only
part eaglekit_h4096 120 "${STEP[@]}" "${H4096[@]}" "${TIMED[@]}" --variants reference,fused,compiled --eaglekit-only
speculators h4096 90 "${H4096[@]}"
if [ ${#TINY[@]} -gt 0 ]; then
  MEMORY=(--hidden 64 --lengths 128 --vocab 512 --draft-vocab 128 --head-dim 16 --steps 3)
else
  MEMORY=(--hidden 7168 --lengths 4096 --head-dim 128 --gqa 4 --vocab 163840 --draft-vocab 32000)
fi
part memory_per_step 60 benchmarks/ttt_memory.py --device "$DEVICE" --threads "$(nproc)" "${MEMORY[@]}" \
  --variants reference,fused --eaglekit-only

# One table from the parts' JSON: seconds per step, TFLOP/s and share of peak, and eaglekit's best against
# speculators (whichever of its modes ran).
"$PY" - "$OUT" <<'EOF' 2>&1 | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
for shape in ("kimi", "h4096"):
    rows = {}
    for path in sorted(out.glob(f"*_{shape}*.json")):
        for result in json.loads(path.read_text())["results"]:
            for side, seconds in result["median_s"].items():
                label = f"speculators ({result['speculators_mode']})" if side == "speculators" else side
                rows[label] = (seconds, result.get("share_of_peak", {}).get(side), result["label"])
    print(f"\n{shape}:")
    for label, (seconds, share, where) in rows.items():
        print(f"  {label:32s} {seconds:8.3f} s/step" + (f"  {100 * share:5.1f} % of peak" if share else "") + f"  {where}")
    ours = [v[0] for k, v in rows.items() if k.startswith("eaglekit")]
    theirs = [v[0] for k, v in rows.items() if k.startswith("speculators")]
    if ours and theirs:
        print(f"  eaglekit's best step is x{min(theirs) / min(ours):.2f} speculators' fastest")
EOF
echo "figures in $OUT (parts took $((SECONDS - START)) s)"
