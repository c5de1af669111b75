"""extract.mode stream vs offline shards: trainer steps/s on the same data, the same config, the same vLLM servers.

Two real vLLM feature servers (the CPU build, ``.venv-vllm``) of the tiny target share one storage folder. One
prepared run (the tiny corpus, ``--samples`` samples) is copied into each variant:

- offline: ``extract`` through the servers into shards once, then ``train`` reads the shards (timed: train only);
- stream: ``train`` asks the servers for each micro-batch's features as it goes (``extract.stream``).

Rounds alternate offline / stream (a fresh train each); steps/s is ``steps / counts.seconds`` (the training loop's
clock: the same held-out evaluations in both). The stream's report says who waited on whom and both rates.

    .venv/bin/python benchmarks/stream_vs_offline.py --run runs/bench-stream --rounds 5    # ~8 minutes, 2 CPU cores
    .venv/bin/python benchmarks/stream_vs_offline.py --run runs/bench-stream --servers 1 --concurrency 1

``--crossover`` instead runs the stream alone along a ladder that makes the trainer faster relative to the servers
(one server with one request in flight instead of two with four, then fewer TTT steps a micro-batch, then more
samples a micro-batch; the fast trainer again with both servers), each rung ``--rounds`` times, and prints the
trainer's and the servers' rates side by side with the stage's verdict (trainer-bound / server-bound): the crossover
is where trainer ÷ servers passes 1.

    .venv/bin/python benchmarks/stream_vs_offline.py --run runs/bench-stream --crossover --rounds 3   # 5-11 minutes
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

import yaml

TRAIN = {
    "ttt": {"steps": 3},
    "batch_size": 4,
    "lr": 1e-3,
    "warmup_steps": 2,
    "eval_samples": 8,
    "eval_every": 1000,
    "save_every": 1000,
    "log_every": 10,
}


def prepare(base: Path, target: Path, samples: int) -> dict:
    """A run directory with prepare and vocab done, on the tiny corpus (as the tests' prepared_run)."""
    from eaglekit.config import parse_config
    from eaglekit.pipeline import run_stage
    from eaglekit.rundir import RunDir
    from eaglekit.tiny.corpus import sample_tasks, write_responses

    gen = base / "run" / "generate"
    write_responses(gen, sample_tasks(samples, 5, split="train"), "b-")
    data = {
        "run_dir": "run",
        "target": {"model": str(target)},
        "data": {"prompts": "unused.jsonl", "eval_fraction": 0.05},
        "vocab": {"draft_vocab_size": 200},
    }
    cfg = parse_config(data, base_dir=base)
    with RunDir(cfg.run_dir).lock:
        run_stage(cfg, "prepare", skip_preflight=True)
        run_stage(cfg, "vocab", skip_preflight=True)
    return data


def variant(root: Path, base: Path, data: dict, name: str, extract: dict, steps: int, train: dict | None = None):
    from eaglekit.config import parse_config

    folder = root / name
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(base, folder)
    cfg = parse_config(
        {**data, "extract": extract, "train": {**TRAIN, **(train or {}), "max_steps": steps}}, base_dir=folder
    )
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude={"source"})))
    return cfg


# (servers, in flight each, TTT steps, batch size): the trainer faster relative to the servers, rung after rung
LADDER = [(2, 4, 3, 4), (1, 1, 3, 4), (1, 1, 2, 4), (1, 1, 1, 4), (2, 4, 1, 4), (1, 1, 1, 8), (2, 4, 1, 8)]


def crossover(root: Path, base: Path, data: dict, vllm: dict, args) -> list[dict]:
    """The stream alone along LADDER: both rates and the verdict of each round."""
    from eaglekit.pipeline import run_stage
    from eaglekit.rundir import RunDir

    rows = []
    for n, (servers, in_flight, ttt, batch) in enumerate(LADDER):
        pool = {**vllm, "servers": vllm["servers"][:servers], "concurrency": in_flight}
        extract = {"mode": "stream", "backend": "vllm", "vllm": pool, "stream": {"spool_gb": args.spool_gb, "ahead": 4}}
        for r in range(args.rounds):
            train = {"batch_size": batch, "ttt": {"steps": ttt}}
            cfg = variant(root, base, data, f"rung-{n}-{r}", extract, args.steps, train)
            with RunDir(cfg.run_dir).lock:
                s = run_stage(cfg, "train", skip_preflight=True)["counts"]["stream"]
            ratio = s["trainer_micro_batches_per_s"] / max(s["server_micro_batches_per_s"], 1e-9)
            per_batch = s["server_tokens_per_s"] / max(s["server_micro_batches_per_s"], 1e-9)  # tokens a micro-batch
            row = {"servers": servers, "in_flight": in_flight, "ttt": ttt, "batch": batch, "round": r,
                   "trainer_mb_s": s["trainer_micro_batches_per_s"], "server_mb_s": s["server_micro_batches_per_s"],
                   "trainer_tok_s": round(s["trainer_micro_batches_per_s"] * per_batch),
                   "server_tok_s": round(s["server_tokens_per_s"]), "trainer_over_servers": round(ratio, 2),
                   "bound": s["bound"], "trainer_waited_s": s["trainer_waited_s"], "queue_full_s": s["queue_full_s"],
                   "seconds": s["seconds"]}  # fmt: skip
            rows.append(row)
            print(
                f"{servers} server(s) x {in_flight}, ttt {ttt}, batch {batch}, round {r}: trainer "
                f"{row['trainer_mb_s']} mb/s ({row['trainer_tok_s']:,} tok/s), servers {row['server_mb_s']} mb/s "
                f"({row['server_tok_s']:,} tok/s), trainer/servers {row['trainer_over_servers']}, {row['bound']} "
                f"(trainer waited {row['trainer_waited_s']}s, queue full {row['queue_full_s']}s of {row['seconds']}s)",
                flush=True,
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, default=Path("runs/bench-stream"))
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--spool-gb", type=float, default=0.01)
    parser.add_argument("--servers", type=int, default=2, help="feature servers (vLLM CPU instances)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight per server")
    parser.add_argument("--crossover", action="store_true", help="the stream alone along LADDER (starts 2 servers)")
    args = parser.parse_args()

    from eaglekit.pipeline import run_stage
    from eaglekit.rundir import RunDir
    from eaglekit.serving.engine import VllmServer, find_vllm_python
    from eaglekit.serving.vllm_features import plugin_dir, serve_args
    from eaglekit.tiny import ensure_tiny_target

    root = args.run.resolve()
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    target = ensure_tiny_target()
    base = root / "base"
    data = prepare(base, target, args.samples)
    storage = root / "hidden-states"
    storage.mkdir()
    flags = ["--max-model-len", "1024", *serve_args([2, 4, 5, 8], str(storage), "cpu")]
    python = find_vllm_python()
    servers = [
        VllmServer(python, str(target), flags, root / f"vllm-{k}.log", env={"PYTHONPATH": str(plugin_dir())})
        for k in range(2 if args.crossover else args.servers)
    ]
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready()
        vllm = {
            "servers": [s.url for s in servers],
            "storage_path": str(storage),
            "connector": "cpu",
            "model": servers[0].model,
            "concurrency": args.concurrency,
            "timeout": 120,
        }
        if args.crossover:
            print(json.dumps(crossover(root, base, data, vllm, args), indent=1))
            return
        offline = {"mode": "offline", "backend": "vllm", "shard_tokens": 4000, "vllm": vllm}
        stream = {**offline, "mode": "stream", "stream": {"spool_gb": args.spool_gb, "ahead": 4}}
        shards = variant(root, base, data, "offline-shards", offline, args.steps)
        with RunDir(shards.run_dir).lock:
            extracted = run_stage(shards, "extract", skip_preflight=True)["counts"]
        print(f"extract: {extracted['tokens']:,} tokens at {extracted['tokens_per_s']:,.0f} tok/s (the servers)")
        figures: dict[str, list[float]] = {"offline": [], "stream": []}
        reports = []
        for r in range(args.rounds):
            for name, extract in (("offline", offline), ("stream", stream)):
                # offline: the shards extracted once, a fresh train over them each round
                cfg = shards if name == "offline" else variant(root, base, data, f"{name}-{r}", extract, args.steps)
                shutil.rmtree(Path(cfg.run_dir) / "train", ignore_errors=True)  # (what makes train run again)
                with RunDir(cfg.run_dir).lock:
                    counts = run_stage(cfg, "train", skip_preflight=True)["counts"]
                rate = counts["steps"] / counts["seconds"]
                figures[name].append(rate)
                line = f"round {r} {name}: {counts['steps']} steps in {counts['seconds']:.1f}s = {rate:.2f} steps/s"
                if name == "stream":
                    reports.append(counts["stream"])
                    s = counts["stream"]
                    line += (
                        f"; {s['bound']}, trainer {s['trainer_micro_batches_per_s']} mb/s, servers "
                        f"{s['server_micro_batches_per_s']} mb/s ({s['server_tokens_per_s']:,.0f} tok/s), waited "
                        f"{s['trainer_waited_s']}s, queue full {s['queue_full_s']}s, spool peak "
                        f"{s['spool_peak_bytes'] / 1e6:.2f} MB of {s['spool_limit_bytes'] / 1e6:.0f} MB"
                    )
                print(line, flush=True)
    finally:
        for s in servers:
            s.stop()
    off, on = statistics.median(figures["offline"]), statistics.median(figures["stream"])
    print(json.dumps({"offline_steps_per_s": figures["offline"], "stream_steps_per_s": figures["stream"],
                      "median_ratio_stream_over_offline": round(on / off, 3), "stream_reports": reports}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
