#!/usr/bin/env bash
# The training (TTT) benchmarks on a lent GPU, in one command that fits one device call (8.7 minutes at most;
# give the run a timeout of ~580 s):
#
#     bash benchmarks/gpu_ttt.sh        # text and JSON figures in $OUT (/tmp/eaglekit-gpu-ttt when unset)
#
# Installs nothing: it needs a python with a CUDA build of torch (PYTHON, default python3) and takes eaglekit from
# this working tree (src/ on the path). speculators is compared where it imports; a bare GPU image will not have
# it, and then every figure is eaglekit's alone (each script says so). Each part has its own time limit, so a
# slow part costs its own figures only. Sizes: a Llama-3-8B-like drafter (H=4096, 32 heads x 128, 8 KV heads,
# V=128256, Vd=32000) in bf16, plus the CPU sizes for comparison with benchmarks/RESULTS.md. The TTT step is the
# current one: the fused draft head + soft cross-entropy (training/loss.py) and, in packing.py, packed rows with
# per-document attention; memory_small gives the memory per extra TTT step at the CPU benchmark's H=256 in bf16.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/eaglekit-gpu-ttt}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1  # figures reach $OUT even when a part hits its time limit
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
LLAMA8B=(--head-dim 128 --gqa 4 --vocab 128256 --draft-vocab 32000)
CPU=(--threads "$(nproc)")  # only the setup (random weights and features) runs on the CPU

{ nvidia-smi || true
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  "$PY" -c "from importlib.metadata import version; import speculators; print('speculators', version('speculators'))" \
    2>/dev/null || echo "speculators: not importable (eaglekit figures alone)"
} > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"

part() {  # part NAME SECONDS SCRIPT ARGS...: run one benchmark, its output to $OUT/NAME.txt and NAME.json
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s): $PY $*"
  timeout "$limit" "$PY" "$@" --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.txt"
  echo "== $name exit ${PIPESTATUS[0]}" | tee -a "$OUT/$name.txt"
}

part step_small 60 benchmarks/ttt_step.py --device cuda "${CPU[@]}" --sizes 256x512,512x2048 --warmup 3 --repeats 10
part memory_small 40 benchmarks/ttt_memory.py --device cuda "${CPU[@]}" --hidden 256 --lengths 2048,4096,8192 \
  --speculators-max-len 8192
part step_8b 150 benchmarks/ttt_step.py --device cuda "${CPU[@]}" --sizes 4096x2048,4096x8192 "${LLAMA8B[@]}" \
  --warmup 3 --repeats 5
part memory_8b 120 benchmarks/ttt_memory.py --device cuda "${CPU[@]}" --hidden 4096 "${LLAMA8B[@]}" \
  --lengths 2048,4096,8192,16384 --speculators-max-len 16384
part flops_8b 60 benchmarks/flops.py --device cuda "${CPU[@]}" --sizes 4096x2048,4096x8192 "${LLAMA8B[@]}" --repeats 5
part packing_8b 90 benchmarks/packing.py --device cuda "${CPU[@]}" --hidden 4096 "${LLAMA8B[@]}" --samples 160 \
  --median 600 --longest 8192 --pack-length 8192 --batch 4 --pack-rows 2 --rounds 2
echo "figures in $OUT"
