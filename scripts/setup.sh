#!/usr/bin/env bash
# Creates .venv and installs eaglekit with its test extras. Idempotent: a second run only checks.
# torch comes first and pinned: 2.13.0 is the CPU build these machines keep on disk; an unpinned torch
# would pull a multi-GB CUDA build. On a GPU machine, install the torch build you want before this.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! python -c "import torch" >/dev/null 2>&1; then
  python -m pip install -q "torch==2.13.0"
fi
python -m pip install -q -e ".[test]"
echo "eaglekit installed in .venv ($(python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
