"""Does eaglekit's chat client keep up with a bare httpx loop? Requests/s of both against one instant server.

The fake vLLM server (tests/support/fake_vllm.py) runs in its own process and answers at once, so what is
measured is the client side: eaglekit's ChatClient (least-outstanding scheduling, retries, record
checks) vs the plainest asyncio + httpx loop at the same concurrency. The whole generate stage (records
built, reasoning extracted, lines written and fsynced, progress) is measured too, for reference. Runs
alternate (bare, eaglekit, bare, eaglekit, …) so that drifting machine load hits both alike.

    python benchmarks/generate_client.py [--requests 2000] [--concurrency 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
MODEL = "fake/reasoner"
MESSAGES = [{"role": "user", "content": "how many words are in this short question"}]


def start_server() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "fake_vllm.py"), "--model", MODEL], stdout=subprocess.PIPE, text=True
    )
    return proc, proc.stdout.readline().strip()


def generate_config(url: str, concurrency: int, **extra):
    from eaglekit.config import GenerateConfig

    return GenerateConfig(
        backend="openai", servers=[url], model=MODEL, max_tokens=64, concurrency=concurrency, timeout=30, **extra
    )


async def bare(url: str, n: int, concurrency: int) -> float:
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 64,
        "temperature": 0.0,
        "top_p": 1.0,
        "return_token_ids": True,
    }
    left = n
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=30, limits=limits) as http:

        async def worker():
            nonlocal left
            while left > 0:
                left -= 1
                resp = await http.post(url + "/chat/completions", json=body)
                resp.raise_for_status()
                resp.json()["choices"][0]["message"]

        return await timed(n, worker, concurrency)


async def timed(n: int, worker, concurrency: int) -> tuple[float, float]:
    """(requests/s, CPU ms of this process per request): the server runs in another process."""
    t0, c0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return n / (time.perf_counter() - t0), (time.process_time() - c0) * 1000 / n


async def eaglekit_client(url: str, n: int, concurrency: int) -> float:
    from eaglekit.serving.client import ChatClient

    left = n
    async with ChatClient(generate_config(url, concurrency)) as client:

        async def worker():
            nonlocal left
            while left > 0:
                left -= 1
                await client.chat(MESSAGES)

        return await timed(n, worker, concurrency)


def whole_stage(url: str, n: int, concurrency: int) -> tuple[float, float]:
    from eaglekit import pipeline
    from eaglekit.config import parse_config
    from eaglekit.progress import console
    from eaglekit.rundir import RunDir

    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "prompts.jsonl"
        prompts.write_text(
            "".join(
                json.dumps(
                    {
                        "id": f"p{i}",
                        "messages": [
                            {"role": "user", "content": f"question {i}: how many words are in this short question"}
                        ],
                    }
                )
                + "\n"
                for i in range(n)
            )
        )
        cfg = parse_config(
            {
                "run_dir": f"{tmp}/run",
                "target": {"model": "org/none"},
                "data": {"prompts": str(prompts)},
                "generate": {**generate_config(url, concurrency).model_dump(), "reasoning": "required"},
            }
        )
        console.quiet = True
        c0 = time.process_time()
        try:
            with RunDir(cfg.run_dir).lock:
                pipeline.run_stage(cfg, "generate", skip_preflight=True)
        finally:
            console.quiet = False
        end = [e for e in RunDir(cfg.run_dir).events() if e.get("event") == "end"][-1]
        return end["rates"]["req_per_s"], (time.process_time() - c0) * 1000 / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    proc, url = start_server()
    try:
        asyncio.run(bare(url, 100, args.concurrency))  # warm up both ends
        rates: dict[str, list[tuple[float, float]]] = {"bare httpx": [], "eaglekit client": [], "eaglekit stage": []}
        for _ in range(args.rounds):
            rates["bare httpx"].append(asyncio.run(bare(url, args.requests, args.concurrency)))
            rates["eaglekit client"].append(asyncio.run(eaglekit_client(url, args.requests, args.concurrency)))
            rates["eaglekit stage"].append(whole_stage(url, args.requests, args.concurrency))
    finally:
        proc.terminate()
        proc.wait()
    print(f"{args.requests} requests x {args.rounds} rounds, concurrency {args.concurrency}, one instant fake server")
    med = {k: statistics.median(r for r, _ in v) for k, v in rates.items()}
    for k, v in rates.items():
        print(
            f"  {k:16s} median {med[k]:8.1f} req/s, {statistics.median(c for _, c in v):.2f} client CPU ms/request"
            f"   (rounds: {', '.join(f'{r:.0f}' for r, _ in v)} req/s)"
        )
    print(f"  ratio eaglekit client / bare httpx: {med['eaglekit client'] / med['bare httpx']:.2f} (goal >= 0.8)")
    print(f"  ratio eaglekit stage  / bare httpx: {med['eaglekit stage'] / med['bare httpx']:.2f}")


if __name__ == "__main__":
    main()
