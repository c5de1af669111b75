"""Six training steps per drafter family on the tiny target, through the pipeline's train stage: each run's
metrics.jsonl (seconds removed) and its ledger counts, to diff two commits' behaviour (a refactor changes none).

    .venv/bin/python benchmarks/six_steps.py OUT_DIR [FAMILY ...]      # in each checkout, then diff -r the two OUT_DIRs

Run from the repository root; it reads the tests' prepared_run (tests/pipeline/, or tests/ before the tests had folders).
"""

import json
import shutil
import sys
from pathlib import Path

sys.path[:0] = ["tests", "tests/pipeline"]  # the tests' run builder, where this checkout keeps it
from test_extract import prepared_run  # prepare + vocab on the tiny target's corpus  # noqa: E402  (after the path)

from eaglekit.pipeline import run_stage  # noqa: E402  (after the path)
from eaglekit.rundir import RunDir  # noqa: E402  (after the path)
from eaglekit.tiny import ensure_tiny_target  # noqa: E402  (after the path)

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
target = ensure_tiny_target()
DRAFT = {"llama": {}, "mla": {}, "dflash": {"shared_k_norm": True}, "dspark": {"markov_rank": 8}}
for family in sys.argv[2:] or ["llama", "mla", "dflash", "dspark"]:
    work = out / f"work-{family}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    train = {
        "max_steps": 6,
        "log_every": 2,
        "eval_every": 3,
        "save_every": 6,
        "seed": 0,
        "draft": {"architecture": family, **DRAFT[family]},
    }
    if family in ("llama", "mla"):
        train["ttt"] = {"steps": 3}
    cfg = prepared_run(work, target, n=24, train=train)
    with RunDir(cfg.run_dir).lock:
        row = run_stage(cfg, "train", skip_preflight=True)
    rows = [json.loads(line) for line in (Path(cfg.run_dir) / "train" / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r.pop("seconds", None)
    (out / f"{family}.metrics.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    counts = {k: v for k, v in row["counts"].items() if k not in ("seconds",)}
    (out / f"{family}.counts.json").write_text(json.dumps(counts, sort_keys=True, indent=1, default=str))
    print(family, "done", len(rows), "rows")
