#!/usr/bin/env bash
# Creates benchmarks/.venv-speculators: speculators 0.9.0 (the peer of the training benchmarks) and eaglekit
# in ONE environment, so one process times both implementations side by side.
#
# speculators pins transformers<=5.19 and torch<=2.14.1, so it never joins eaglekit's own .venv. Order matters:
# torch 2.13.0 first (the CPU build on disk; an unpinned torch pulls a CUDA build of several GB), then
# transformers 5.19.0, then speculators --no-deps plus the requirements its wheel's METADATA lists (read from
# the wheel, not guessed), each install constrained so nothing moves torch or transformers. torchaudio and
# torchvision are listed by speculators but imported nowhere in it; where no build imports with torch 2.13.0 they are
# skipped with a note. Idempotent: a second run reinstalls nothing that is there and re-checks the imports.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=benchmarks/.venv-speculators
PYTHON=${PYTHON:-python3}
TORCH=${TORCH:-2.13.0}
TRANSFORMERS=5.19.0
SPECULATORS=0.9.0

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
printf 'torch==%s\ntransformers==%s\n' "$TORCH" "$TRANSFORMERS" > "$WORK/pins.txt"

"${PIP[@]}" "torch==$TORCH"
"${PIP[@]}" -c "$WORK/pins.txt" "transformers==$TRANSFORMERS"

# speculators' own requirements, from its METADATA: unconditional Requires-Dist lines (no extras).
"$PY" -m pip download -q --no-deps "speculators==$SPECULATORS" -d "$WORK" 2> >(grep -v "is ignored" >&2)
"$PY" - "$WORK" > "$WORK/reqs.txt" <<'EOF'
import glob, sys, zipfile
wheel = glob.glob(f"{sys.argv[1]}/speculators-*.whl")[0]
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            print(line.split(":", 1)[1].split(";")[0].strip())
EOF
echo "speculators $SPECULATORS requires: $(tr '\n' ' ' < "$WORK/reqs.txt")"
"${PIP[@]}" --no-deps "speculators==$SPECULATORS"
grep -v -E '^(torch|torchaudio|torchvision|transformers)([<>=!~ ]|$)' "$WORK/reqs.txt" > "$WORK/rest.txt"
"${PIP[@]}" -c "$WORK/pins.txt" -r "$WORK/rest.txt"
# A torchvision/torchaudio built for another torch build fails at import, and transformers then fails to import
# PreTrainedModel (it imports torchvision when present): keep them only where they import cleanly.
for extra in torchaudio torchvision; do
  [ -e "$VENV/.without-$extra" ] && continue  # tried on an earlier run
  if ! { "${PIP[@]}" -c "$WORK/pins.txt" "$extra" 2>/dev/null && "$PY" -c "import $extra" >/dev/null 2>&1; }; then
    "$PY" -m pip uninstall -q -y "$extra" >/dev/null 2>&1 || true
    touch "$VENV/.without-$extra"
    echo "note: no $extra build that imports with torch $TORCH here; left out (speculators imports neither)"
  fi
done

# eaglekit itself, without its dependencies (they would move transformers), plus what its training code imports
# (matplotlib: training/loop.py draws the curves; benchmarks/lockstep.py reads its held-out figure).
"${PIP[@]}" --no-deps -e .
"${PIP[@]}" -c "$WORK/pins.txt" pyyaml matplotlib

"$PY" - <<'EOF'
from importlib.metadata import version
import torch, transformers
from speculators.models.eagle3 import Eagle3DraftModel  # noqa: F401
from speculators.losses import resolve_loss_config  # noqa: F401
import eaglekit.training.ttt, eaglekit.model.target  # noqa: F401
print(f"ok: torch {torch.__version__}, transformers {transformers.__version__}, speculators {version('speculators')}, "
      "eaglekit imports")
EOF
