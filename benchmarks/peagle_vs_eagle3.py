"""P-EAGLE against EAGLE-3: the same layer, data, budget and seeds.

The family table (benchmarks/family_table.py) with these two families: its data, budget, measure and options (--ttt:
EAGLE-3's training-time test steps and P-EAGLE's parallel slots trained), its rows in its --out
(runs/family_table.jsonl).

  OMP_NUM_THREADS=1 .venv/bin/python benchmarks/peagle_vs_eagle3.py                        # 3 seeds
  OMP_NUM_THREADS=1 .venv/bin/python benchmarks/peagle_vs_eagle3.py --seeds 0              # one seed
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from family_table import main  # noqa: E402

if __name__ == "__main__":
    main(families=["eagle3", "peagle"])
