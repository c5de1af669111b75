"""`eaglekit demo`: the whole pipeline on the built-in tiny target, on a laptop CPU, in a few minutes.

It writes ``RUN_DIR/config.yaml`` (an ordinary run config — edit it and go on with ``eaglekit run``) and
a prompts file of held-out tasks, then runs every stage exactly as a real run would.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import yaml

from eaglekit import atomic, pipeline, status
from eaglekit.config import load_config
from eaglekit.errors import UsageError
from eaglekit.progress import console
from eaglekit.serving.engine import find_vllm_python

# Sized so the whole demo takes a few minutes on 2 CPU cores (measured: docs/setup.md, "The demo").
DEMO_SAMPLES = 400
HEADER = "# Written by `eaglekit demo`; edit it and continue with `eaglekit run` on this file.\n"


def demo_config(target: Path, offline: bool = False) -> dict[str, Any]:
    return {
        "run_dir": ".",
        "target": {"model": str(target)},
        "data": {"prompts": "prompts.jsonl", "eval_fraction": 0.1},
        "generate": {"backend": "local", "max_tokens": 200, "temperature": 0.0, "batch_size": 48},
        "prepare": {"max_length": 384},
        "vocab": {"draft_vocab_size": 80},
        "extract": {"mode": "offline" if offline else "online"},
        "train": {
            "max_steps": 240,
            "batch_size": 16,
            "lr": 3e-3,
            "warmup_steps": 10,
            "eval_every": 60,
            "save_every": 60,
            "ttt": {"steps": 4},
            "draft": {"intermediate_size": 256},
        },
        # Greedy only: the tiny target is all but deterministic on its own replies (measured on these 8 prompts:
        # the top token's probability averages 0.998, so sampling at T=1 leaves the greedy path 1.2 times in
        # 548 tokens), so its τ at T=1 equals T=0's within noise and says nothing. Sampling is measured on a
        # target with real entropy in tests/drafters/test_speculative.py.
        "evaluate": {
            "num_samples": 8,
            "num_speculative_tokens": [1, 3, 5],
            "temperatures": [0.0],
            "max_new_tokens": 96,
        },
        "export": {"verifier": None},
        **({"verify": {"engine": "vllm"}} if vllm_installed() else {}),
    }


def vllm_installed() -> bool:
    """With a vLLM environment at hand (scripts/setup.sh --vllm), the demo ends by serving its drafter in it."""
    try:
        find_vllm_python()
        return True
    except UsageError:
        return False


def run_demo(run_dir: Path, force: bool = False, offline: bool = False) -> dict[str, Any]:
    from eaglekit.tiny import ensure_tiny_target, write_prompts  # lazy: heavy (eaglekit.tiny imports transformers)

    # The tiny target's matmuls are too small to gain from intra-op threads; on a shared 2-core machine
    # a second thread made decoding many times slower (measured), so the demo computes on one.
    torch.set_num_threads(1)
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    console.print("[bold]demo[/]: building (or reusing) the built-in tiny target")
    target = ensure_tiny_target()
    prompts = run_dir / "prompts.jsonl"
    if not prompts.exists():
        write_prompts(prompts, n=DEMO_SAMPLES, seed=1234)
    config_path = run_dir / "config.yaml"
    if not config_path.exists():
        atomic.write_text(config_path, HEADER + yaml.safe_dump(demo_config(target, offline), sort_keys=False))
    cfg = load_config(config_path)
    redo = []
    if offline and cfg.extract.mode != "offline":  # --offline on an online demo: extract, then train from disk
        data = yaml.safe_load(config_path.read_text())
        data.setdefault("extract", {})["mode"] = "offline"
        atomic.write_text(config_path, HEADER + yaml.safe_dump(data, sort_keys=False))
        cfg = load_config(config_path)
        order = pipeline.stages_for(cfg)
        redo = order[order.index("extract") :]
        console.print(
            f"demo: {config_path} now has extract.mode: offline; {', '.join(redo)} replace the online run's outputs"
        )
    rows = pipeline.run_stages(cfg, [s for s in pipeline.stages_for(cfg) if s not in redo], force=force)
    if redo:  # their folders hold the online run's outputs: other parameters, which only --force replaces
        rows += pipeline.run_stages(cfg, redo, force=True)
    console.print(f"\n[bold]demo done[/]: run directory {run_dir}; `eaglekit status {run_dir}` shows it again")
    return {"run_dir": str(run_dir), "config": str(config_path), "stages": rows, "status": status.stage_rows(cfg)}
