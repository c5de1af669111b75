"""Block drafters against the chain drafter: DFlash, DSpark and EAGLE-3 on the same data and budget.

The family table (benchmarks/family_table.py) with these three families: its data, budget, measure and options, its
rows in its --out (runs/family_table.jsonl; a row already measured with the same settings is read, not run again).

  OMP_NUM_THREADS=1 .venv/bin/python benchmarks/dflash_vs_eagle3.py                        # 3 seeds
  OMP_NUM_THREADS=1 .venv/bin/python benchmarks/dflash_vs_eagle3.py --seeds 0 --steps 60   # a quick look
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from family_table import main  # noqa: E402
from family_table import measure_drafter as measure  # noqa: E402, F401  (benchmarks/dflash_vs_speculators.py's)

if __name__ == "__main__":
    main(families=["dflash", "dspark", "eagle3"])
