"""How long the vLLM CPU build takes to serve: eaglekit's CPU settings against vLLM's own defaults, side by side.

Every real-engine step on a CPU machine (``verify``, ``extract.backend: vllm``, the engine tests) starts vLLM,
and on 2 cores most of a start is Python importing vLLM and torch in each process it spawns. Rounds alternate
between two starts of the same server (the tiny target, with an EAGLE-3 drafter when ``--draft`` names one):

- vLLM's defaults: a fresh ``VLLM_CACHE_ROOT`` (as eaglekit gave each run before, so the model registry
  inspects each architecture in a subprocess again), the worker in a process of its own, threads pinned;
- eaglekit's ``CPU_DEFAULTS`` (``serving/engine.py``), with vLLM's own cache (warm after the first round).

Both sides keep eaglekit's KV-cache size (``VLLM_CPU_KVCACHE_SPACE=1``) and any ``VLLM_*`` the shell sets. The
side that starts first alternates (ABBA...), so neither always finds the files the other just read in the page
cache. Time is from the process start to the first answer of ``/v1/models``; the medians' ratio is the figure.

    .venv/bin/python benchmarks/engine_start.py --draft runs/demo/export/eagle3     # ~5 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

VLLM_DEFAULTS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "auto"}


def start_seconds(python: Path, model: str, args: list[str], log: Path, env: dict[str, str]) -> float:
    from eaglekit.serving.engine import VllmServer

    t0 = time.monotonic()
    with VllmServer(python, model, args, log, env=env):
        return time.monotonic() - t0


def main() -> None:
    from eaglekit.serving.engine import find_vllm_python
    from eaglekit.tiny import ensure_tiny_target

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", type=Path, help="an exported eagle3 folder to serve as the drafter (e.g. the demo's)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("runs/bench-engine-start"))
    a = p.parse_args()

    python = find_vllm_python()
    target = str(ensure_tiny_target())
    args = []
    if a.draft:
        spec = {"method": "eagle3", "model": str(a.draft.resolve()), "num_speculative_tokens": 3}
        args = ["--speculative-config", json.dumps(spec)]
    a.out.mkdir(parents=True, exist_ok=True)
    times: dict[str, list[float]] = {"vllm defaults": [], "eaglekit": []}
    for r in range(a.rounds):
        for side in ("vllm defaults", "eaglekit") if r % 2 == 0 else ("eaglekit", "vllm defaults"):
            if side == "eaglekit":
                times[side].append(start_seconds(python, target, args, a.out / f"eaglekit-{r}.log", {}))
                continue
            with tempfile.TemporaryDirectory(dir=a.out) as fresh:
                env = {**VLLM_DEFAULTS, "VLLM_CACHE_ROOT": fresh}
                times[side].append(start_seconds(python, target, args, a.out / f"defaults-{r}.log", env))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.1f} s" for k, v in times.items()), flush=True)
    medians = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "drafter": str(a.draft) if a.draft else None,
        "seconds": times,
        "median_s": medians,
        "ratio": medians["eaglekit"] / medians["vllm defaults"],
    }
    (a.out / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result["median_s"]), f"eaglekit / vLLM defaults = x{result['ratio']:.2f}")


if __name__ == "__main__":
    main()
