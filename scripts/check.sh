#!/usr/bin/env bash
# The house rules, then the tests: what CI runs after scripts/setup.sh (README, "Two commands").
#   bash scripts/check.sh                  ruff, ruff format --check, mypy, then every test
#   bash scripts/check.sh -m "not slow"    the same gate, then the fast lane (day-to-day work)
# Arguments go to pytest (after the defaults, so `-n 0` runs in one process). Each gate names its findings; the
# first that fails stops the run.
# Two pytest workers, a file each at a time: the tests run torch on one thread (tiny models), so one process leaves
# a core of the 2-core runner idle. Whole files keep their module fixtures (trained drafters) in one worker, and go
# out in the order tests/conftest.py gives them (longest first), not xdist's default of most tests first, which left
# the few long tests of the block-drafter runs for last, one worker alone on them. The slowest tests are listed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
echo "ruff check";           "$PY" -m ruff check --no-cache .
echo "ruff format --check";  "$PY" -m ruff format --check --no-cache .
echo "mypy";                 "$PY" -m mypy --no-incremental
"$PY" -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25 "$@"
