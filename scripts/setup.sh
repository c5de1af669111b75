#!/usr/bin/env bash
# Creates .venv and installs eaglekit with its test extras. Idempotent: a second run only checks.
# torch comes first and pinned: 2.13.0 is the CPU build these machines keep on disk; an unpinned torch
# would pull a multi-GB CUDA build. On a GPU machine, install the torch build you want before this.
#
#   bash scripts/setup.sh          eaglekit in .venv
#   bash scripts/setup.sh --vllm   and a real vLLM (CPU build) in .venv-vllm, for the engine tests and
#                                  `eaglekit verify` (scripts/setup_vllm.sh; ~3 minutes the first time)
#   ... --tiny-target              and the built-in tiny target the demo and the tests use (`eaglekit tiny-target`:
#                                  5-15 minutes the first time, cached), built while vLLM installs
set -euo pipefail
cd "$(dirname "$0")/.."
WITH_VLLM=0
WITH_TINY=0
for arg in "$@"; do
  case "$arg" in
    --vllm) WITH_VLLM=1 ;;
    --tiny-target) WITH_TINY=1 ;;
    *) echo "usage: bash scripts/setup.sh [--vllm] [--tiny-target]" >&2; exit 2 ;;
  esac
done
PYTHON=${PYTHON:-python3}
BACKGROUND=()
# a failed step leaves nothing running behind it (a half-installed .venv-vllm is reinstalled by the next run)
stop_background() {
  for pid in ${BACKGROUND[@]+"${BACKGROUND[@]}"}; do
    if command -v pkill >/dev/null; then pkill -P "$pid" 2>/dev/null || true; fi  # setup_vllm.sh's pip
    kill "$pid" 2>/dev/null || true
  done
}
trap stop_background EXIT
trap 'exit 130' INT  # a signal ends the script through its EXIT trap (bash skips that trap when killed outright)
trap 'exit 143' TERM HUP
VLLM_PID=
if [ "$WITH_VLLM" = 1 ]; then
  # beside .venv's install: the two environments share nothing, each pip keeps one core busy, and the tiny
  # target's build below has both cores sooner (~3 minutes of vLLM install no longer ahead of it)
  bash scripts/setup_vllm.sh &
  VLLM_PID=$!
  BACKGROUND+=("$VLLM_PID")
fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! python -c "import torch" >/dev/null 2>&1; then
  python -m pip install -q "torch==2.13.0"
fi
# trackers: train.report_to's experiment trackers, each an optional extra, for tests/pipeline/test_trackers.py
# (~40 s and ~520 MB more the first time, MLflow most of it; none of them moves torch)
python -m pip install -q -e ".[test,mooncake,trackers]"
# the Mooncake wheel's libraries link the RDMA verbs library even for TCP; without it `import mooncake.store` fails
# and the Mooncake transport's tests skip, saying so
if ! python -c "import mooncake.store" >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && apt-get install -y -qq libibverbs1) >/dev/null 2>&1 || echo "warning: apt-get install libibverbs1 failed: the Mooncake transport's tests will skip" >&2
  else
    echo "warning: mooncake.store does not load (libibverbs.so.1 missing?): install libibverbs1 as root for the Mooncake transport" >&2
  fi
fi
# pip compiles what it installs, but an editable install leaves eaglekit itself as source; where
# PYTHONDONTWRITEBYTECODE is set (as on the CI machines) every process would compile its modules again (~1 s each)
python -m compileall -q src
echo "eaglekit installed in .venv ($(python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
deactivate
BUILD_PID=
if [ "$WITH_TINY" = 1 ]; then
  # in the background: the build trains on one core while pip fills the other, then takes both (tiny/build.py)
  .venv/bin/eaglekit tiny-target &
  BUILD_PID=$!
  BACKGROUND+=("$BUILD_PID")
fi
if [ -n "$VLLM_PID" ] && ! wait "$VLLM_PID"; then
  echo "error: installing vLLM into ${VLLM_VENV:-.venv-vllm} failed (its message is above); \`bash scripts/setup_vllm.sh\` retries it" >&2
  exit 1
fi
BACKGROUND=(${BUILD_PID:+"$BUILD_PID"})  # the install is waited for: its pid may be another process's by now
if [ "$WITH_VLLM" = 1 ]; then
  # SGLang's model code, which tests/drafters/test_sglang_forms.py builds the exported drafters with in .venv-vllm:
  # the sglang wheel alone (--no-deps, ~40 MB once), its Python files unpacked into the cache beside the tiny target
  SGLANG_DIR="${EAGLEKIT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/eaglekit}/sglang-0.5.23"
  if [ ! -f "$SGLANG_DIR/.unpacked" ]; then
    WHEELS=$(mktemp -d)
    if ! .venv/bin/python -m pip download -q --no-deps "sglang==0.5.23" -d "$WHEELS"; then
      echo "error: downloading the sglang 0.5.23 wheel failed (pip's message is above); \`bash scripts/setup.sh --vllm\` retries it" >&2
      exit 1
    fi
    .venv/bin/python - "$WHEELS" "$SGLANG_DIR" <<'PY'
import sys, zipfile
from pathlib import Path
wheels, dest = Path(sys.argv[1]), Path(sys.argv[2])
with zipfile.ZipFile(next(wheels.glob("sglang-*.whl"))) as wheel:
    # its Python files, and the kernel sources sglang.kernels.jit looks for when imported (never compiled here)
    wanted = [n for n in wheel.namelist() if n.endswith(".py") or n.startswith("sglang/kernels/jit/")]
    wheel.extractall(dest, [n for n in wanted if n.startswith("sglang/")])
(dest / ".unpacked").touch()
PY
    rm -rf "$WHEELS"
  fi
fi
if [ -n "$BUILD_PID" ] && ! wait "$BUILD_PID"; then
  echo "error: building the tiny target failed (its message is above); \`.venv/bin/eaglekit tiny-target\` retries it" >&2
  exit 1
fi
BACKGROUND=()
