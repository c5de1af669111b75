"""extract.backend vllm: extraction throughput vs the same vLLM's prefill alone, on the same prepared tokens.

Two real vLLM servers (the CPU build, ``.venv-vllm``) serve the same target side by side: a plain one, and a
feature source (``extract_hidden_states`` + eaglekit's CPU connector). Rounds alternate between

- forward only: every prepared sample sent to the plain server as token ids with ``max_tokens: 1`` (the
  prefill, one sampled token, nothing written), ``--concurrency`` in flight;
- extraction: the extract stage with ``backend: vllm`` against the feature server (the same requests, plus the
  hidden states written by the server, read, checked, normed, encoded and committed to shards by eaglekit),

and the medians' ratio is the figure. Needs the prepared run of ``benchmarks/features.py`` (``RUN/base``).

    .venv/bin/python benchmarks/features_vllm.py --run runs/bench-features     # ~4 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import yaml


async def forward_only(url: str, model: str, samples: list[list[int]], concurrency: int) -> float:
    from types import SimpleNamespace

    from eaglekit.serving.client import ChatClient

    cfg = SimpleNamespace(
        servers=[url],
        concurrency=concurrency,
        timeout=600.0,
        max_retries=2,
        retry_backoff=0.5,
        probe_interval=30.0,
        outage_timeout=600.0,
    )
    async with ChatClient(cfg) as client:
        t0 = time.perf_counter()
        await asyncio.gather(
            *(
                client.post(
                    "/completions",
                    lambda ids=ids: {
                        "model": model,
                        "prompt": ids,
                        "max_tokens": 1,
                        "temperature": 0.0,
                        "return_token_ids": True,
                    },
                )
                for ids in samples
            )
        )
        return sum(map(len, samples)) / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, default=Path("runs/bench-features"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16", help="feature storage dtype of the extraction")
    args = parser.parse_args()

    from eaglekit.config import load_config
    from eaglekit.data.tokens import TokenStore
    from eaglekit.pipeline import run_stage
    from eaglekit.rundir import RunDir
    from eaglekit.serving.engine import VllmServer, find_vllm_python
    from eaglekit.serving.vllm_features import plugin_dir, serve_args

    root = args.run.resolve()
    base = root / "base"
    cfg = load_config(base / "config.yaml")
    store = TokenStore(base / "prepare" / "tokens.safetensors")
    samples = [store[i][1].tolist() for i in range(len(store))]
    run = root / "vllm"
    storage = root / "vllm-hidden-states"
    shutil.rmtree(run, ignore_errors=True)
    shutil.rmtree(storage, ignore_errors=True)
    storage.mkdir(parents=True)
    shutil.copytree(base, run, ignore=shutil.ignore_patterns(".lock"))

    python = find_vllm_python()
    model = cfg.target.model
    longest = ["--max-model-len", str(max(map(len, samples)) + 1)]
    plain = VllmServer(python, model, longest, root / "vllm-plain.log")
    source = VllmServer(
        python,
        model,
        [*longest, *serve_args([2, 4, 5, 8], str(storage), "cpu")],
        root / "vllm-features.log",
        env={"PYTHONPATH": str(plugin_dir())},
    )
    data = yaml.safe_load((run / "config.yaml").read_text())
    data["extract"] = {
        "mode": "offline",
        "backend": "vllm",
        "dtype": args.dtype,
        "vllm": {"servers": [None], "storage_path": str(storage), "connector": "cpu", "concurrency": args.concurrency},
    }
    rates: dict[str, list[float]] = {"forward": [], "extract": []}
    with plain, source:
        data["extract"]["vllm"]["servers"] = [source.url]
        (run / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
        feature_cfg = load_config(run / "config.yaml")
        asyncio.run(forward_only(plain.url, plain.model, samples[:16], args.concurrency))  # warm both up
        asyncio.run(forward_only(source.url, source.model, samples[:16], args.concurrency))
        for name in storage.iterdir():
            name.unlink()
        for _ in range(args.rounds):
            rates["forward"].append(asyncio.run(forward_only(plain.url, plain.model, samples, args.concurrency)))
            with RunDir(feature_cfg.run_dir).lock:
                row = run_stage(feature_cfg, "extract", force=True, skip_preflight=True)
            rates["extract"].append(row["counts"]["tokens_per_s"])
    medians = {k: statistics.median(v) for k, v in rates.items()}
    result = {
        "samples": len(samples),
        "tokens": sum(map(len, samples)),
        "dtype": args.dtype,
        "concurrency": args.concurrency,
        "rounds": rates,
        "median_tokens_per_s": medians,
        "extract_over_forward": round(medians["extract"] / medians["forward"], 3),
    }
    (root / "features_vllm.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.exit(main())
