"""The demo's drafter served by vLLM's CPU build, the traffic moved to another task mix, and `eaglekit adapt`.

    .venv/bin/python benchmarks/shift.py --run RUN_DIR --out OUT [--samples 160 --steps 240]
    .venv/bin/python benchmarks/shift.py --run RUN_DIR --out OUT --scratch   # after it: the drafter from scratch

RUN_DIR is a finished demo run (`eaglekit demo --run-dir RUN_DIR`: its drafter, verify's and evaluate's figures). The
drafter is served behind eaglekit's own gateway (``adapt.ServerPool``, which logs the traffic as gateways do); then:

1. before the shift: 12 prompts of the demo's kind (held-out tasks of every kind), served τ and watch's window;
2. the shift: the traffic moves to vowel counts and unit conversions (the demo drafter's weakest kinds), watch's
   first window of 8 such requests, then the rest of the traffic; served τ on 12 held-out prompts of the new mix;
3. `adapt` on the gateway's log (finetune, offline comparison, verify, second server, watch confirms), the clients
   sending the new mix all along; served τ on the same 12 prompts afterwards, and on the demo's kind.

Every step's wall time and watch's verdicts go to OUT/shift.json and a table on stdout. ``--scratch`` then trains a
drafter from scratch on the log adapt read (all of it) and decodes the 12 held-out prompts offline with it, adapt's
drafter and the demo's (OUT/scratch.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

from eaglekit import adapt, watch
from eaglekit.serving.engine import find_vllm_python
from eaglekit.tiny import sample_tasks, write_prompts

K = 3
MIX = ("count", "convert")  # the demo drafter's weakest kinds (offline τ at K=3 ≈ 2.5 and 2.9 against 3.5 on its mix)
MAX_TOKENS = 200  # the demo's generate.max_tokens: the replies end their turn


def mix_prompts(split: str, seed: int) -> list[str]:
    tasks = sample_tasks(30000 if split == "train" else 8000, seed, split=split)  # type: ignore[arg-type]
    return list(dict.fromkeys(t.prompt for t in tasks if t.kind in MIX))


def chat(url: str, prompt: str) -> None:
    model = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS}
    response = httpx.post(f"{url}/v1/chat/completions", json=body | {"temperature": 0.0}, timeout=600)
    response.raise_for_status()


def window(pool: adapt.ServerPool, url: str, prompts: list[str], refs, logged: bool = True) -> dict:
    """``prompts`` sent one at a time, through the gateway (``logged``: they become traffic) or straight to the
    server behind it (the held-out prompts: adapt must not train on what measures it); watch's comparison of that
    window (served τ in it)."""
    client = watch.connect(pool.active.root)
    before, t0 = client.snapshot(), time.monotonic()
    for prompt in prompts:
        chat(url if logged else pool.active.root, prompt)
    span = watch.Window.between(1, time.monotonic() - t0, before, client.snapshot())
    record = watch.compare(span, refs, watch.served_setup(client, None, 0.0))
    record["line"] = watch.line(record)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, required=True, help="a finished demo run directory")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=160, help="conversations adapt reads (the newest)")
    parser.add_argument("--traffic", type=int, default=200, help="new-mix requests sent before adapt")
    parser.add_argument("--steps", type=int, default=adapt.STEPS)
    parser.add_argument(
        "--scratch",
        action="store_true",
        help="after a run into OUT: a drafter from scratch on OUT's whole log, compared",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # the tiny target gains nothing from threads on a shared machine
    if args.scratch:
        scratch(args.run.resolve(), args.out)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    run = args.run.resolve()
    report = json.loads((run / "verify" / "report.json").read_text())
    refs = watch.references(run)
    old_mix = [
        json.loads(line)["messages"][-1]["content"]
        for line in write_prompts(args.out / "old.jsonl", 12, seed=321, shape="messages").read_text().splitlines()
    ]
    heldout, train = mix_prompts("heldout", 2)[:12], mix_prompts("train", 11)
    figures: dict = {"machine": machine(), "samples": args.samples, "steps": args.steps}
    timings: dict[str, float] = {}
    pool = adapt.ServerPool(
        find_vllm_python(None), report["target"], K, args.out / "logs", traffic_log=args.out / "gateway.jsonl"
    )
    try:
        t0 = time.monotonic()
        url = pool.start(run / "export" / "eagle3")
        timings["serve the demo drafter"] = time.monotonic() - t0
        figures["before"] = window(pool, url, old_mix, refs)
        t0 = time.monotonic()
        figures["shift_first_window"] = window(pool, url, train[:8], refs)
        with ThreadPoolExecutor(8) as clients:
            list(clients.map(lambda p: chat(url, p), train[8 : args.traffic]))
        timings["the shifted traffic"] = time.monotonic() - t0
        figures["after_shift"] = window(pool, url, heldout, refs, logged=False)
        said: list[str] = []
        outcome: dict = {}

        def work() -> None:
            outcome["value"] = adapt.adapt(
                run, args.out / "gateway.jsonl", args.out / "adapt", run / "export" / "eagle3", K, pool,
                samples=args.samples, steps=args.steps, windows=2, window_requests=8, say=said.append,
            )  # fmt: skip

        t0 = time.monotonic()
        worker = threading.Thread(target=work)
        worker.start()
        i = 0
        while worker.is_alive():
            if pool.previous is not None:  # swapped: the clients' traffic is what watch confirms with
                chat(url, train[i % len(train)])
                i += 1
            else:
                worker.join(2.0)
        timings["adapt (all steps)"] = time.monotonic() - t0
        result = outcome["value"]
        figures["adapt"] = {"status": result.status, "detail": result.detail, "said": said}
        figures["adapt"]["comparison"] = result.comparison.as_dict() if result.comparison else None
        figures["adapt"]["steps"] = adapt.steps_recorded(args.out / "adapt")
        refs_now = watch.references(args.out / "adapt") if result.status == "promoted" else refs
        figures["after_adapt"] = window(pool, url, heldout, refs_now, logged=False)
        figures["after_adapt_old_mix"] = window(pool, url, old_mix, refs_now)
    finally:
        pool.close()
    figures["timings_s"] = {k: round(v, 1) for k, v in timings.items()}
    figures["commit"] = commit()
    (args.out / "shift.json").write_text(json.dumps(figures, indent=1, default=str))
    for name in ("before", "shift_first_window", "after_shift", "after_adapt", "after_adapt_old_mix"):
        print(f"{name}: {figures[name]['line']}")
    for step in figures["adapt"]["steps"]:
        print(
            f"adapt {step['step']}: {json.dumps({k: v for k, v in step.items() if k not in ('ts', 'event', 'step')})}"
        )
    print(json.dumps(figures["timings_s"]))


def scratch(run: Path, out: Path) -> None:
    """The demo's recipe from scratch on the whole log adapt read (``adapt.write_scratch_config``: every conversation,
    no init_from), then the three drafters decoding the same 12 held-out prompts of the new mix offline, to the served
    replies' length, counted as vLLM counts."""
    from eaglekit.config import load_config
    from eaglekit.rundir import RunDir

    config = adapt.write_scratch_config(run, out / "scratch", out / "adapt" / "traffic", K)
    t0 = time.monotonic()
    adapt.finetune(config)
    seconds = time.monotonic() - t0
    prompts = [(f"p{i}", [{"role": "user", "content": p}]) for i, p in enumerate(mix_prompts("heldout", 2)[:12])]
    folders = {
        "demo": run / "export" / "eagle3",
        "adapted": out / "adapt" / "export" / "eagle3",
        "scratch": out / "scratch" / "export" / "eagle3",
    }
    counts = adapt.decode_counts(load_config(config), folders, K, prompts, max_new_tokens=MAX_TOKENS)
    taus = {name: round(adapt.counted_tau(rows), 4) for name, rows in counts.items()}
    samples = {}
    for name in ("adapt", "scratch"):
        read = json.loads((out / name / "prepare" / "stats.json").read_text())["samples"]
        trained = RunDir(out / name).last_events()["train"]["end"]["counts"]
        samples[name] = {"read": read, "trained_on": trained["train_samples"], "steps": trained["steps"]}
    result = {
        "offline_tau_k3": taus,
        "samples": samples,
        "scratch_seconds": round(seconds, 1),
        "machine": machine(),
        "commit": commit(),
    }
    (out / "scratch.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


def commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()


def machine() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "CPU")
    load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"
    return f"{cpu}, {len(os.sched_getaffinity(0))} cores, load average {load} at the start"


if __name__ == "__main__":
    main()
