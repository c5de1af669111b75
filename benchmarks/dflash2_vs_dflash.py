"""DFlash2 against DFlash on the same data, seeds, batches and steps, and DFlash2 drafting without its selector
(what an engine that ignores it drafts).

The family table (benchmarks/family_table.py) with these two families and --dflash2-fallback: its data, budget,
measure and options, its rows in its --out (runs/family_table.jsonl).

  OMP_NUM_THREADS=1 .venv/bin/python benchmarks/dflash2_vs_dflash.py                 # 3 seeds
  OMP_NUM_THREADS=1 .venv/bin/python benchmarks/dflash2_vs_dflash.py --seeds 0       # a quick look
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from family_table import main  # noqa: E402

if __name__ == "__main__":
    main(families=["dflash", "dflash2"], dflash2_fallback=True)
