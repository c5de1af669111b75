"""Pre-flight time on a large sharded checkpoint: 100 shards of a 540 GB Kimi-K2-like target, headers only.

The shards are written sparse (a real safetensors header, then a hole up to the file's full size), so the folder
takes a few MB on disk while every file has the size the header promises. Measured side by side in one process:

    eaglekit   ``files.read_weights`` — every header validated against its file's size, the index against the shards
    safetensors ``safe_open`` on every shard and ``keys()`` — the library's own header parse, no validation of ours

and then the whole ``eaglekit preflight --stage extract`` command on a config using that target, in a fresh
process (imports included), with the seconds of each check from its JSON report.

    .venv/bin/python benchmarks/preflight_checkpoint.py [--shards 100] [--total-gb 540] [--dir /tmp/ckpt]
"""

from __future__ import annotations

import argparse
import json
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAYERS, EXPERTS_PER_SHARD_LAYER = 61, 384


def write_checkpoint(folder: Path, shards: int, total_bytes: int) -> dict:
    """Sparse shards with Kimi-like names: INT4-packed experts (weight_packed, weight_scale), dense embedding/norm/head."""
    folder.mkdir(parents=True, exist_ok=True)
    per_shard = total_bytes // shards
    tensors_per_shard = 1200
    weight_map, header_bytes = {}, 0
    names = (
        (f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.{part}", part)
        for layer in range(LAYERS)
        for e in range(EXPERTS_PER_SHARD_LAYER)
        for p in ("gate", "up", "down")
        for part in ("weight_packed", "weight_scale")
    )
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        dense = []
        if s == 0:
            dense = [("model.embed_tokens.weight", "BF16", [163840, 7168])]
        if s == shards - 1:
            dense = [("model.norm.weight", "BF16", [7168]), ("lm_head.weight", "BF16", [163840, 7168])]
        for key, dtype, shape in dense:
            size = 2
            for d in shape:
                size *= d
            header[key] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
            offset += size
        budget = per_shard - offset
        each = (budget // tensors_per_shard) // 4 * 4
        for _ in range(tensors_per_shard):
            key, part = next(names)
            if part == "weight_scale":
                header[key] = {"dtype": "BF16", "shape": [each // 2], "data_offsets": [offset, offset + each]}
            else:
                header[key] = {"dtype": "I32", "shape": [each // 4], "data_offsets": [offset, offset + each]}
            offset += each
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        path = folder / name
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
            f.truncate(8 + len(text) + offset)  # a hole: the data is never written
        header_bytes += 8 + len(text)
        weight_map |= {k: name for k in header if k != "__metadata__"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["DeepseekV3ForCausalLM"],
                "model_type": "deepseek_v3",
                "hidden_size": 7168,
                "num_hidden_layers": LAYERS,
                "intermediate_size": 18432,
                "num_attention_heads": 64,
                "num_key_value_heads": 64,
                "vocab_size": 163840,
                "max_position_embeddings": 262144,
                "rope_theta": 50000.0,
                "quantization_config": {
                    "quant_method": "compressed-tensors",
                    "config_groups": {"g": {"weights": {"num_bits": 4}}},
                },
            }
        )
    )
    (folder / "tokenizer_config.json").write_text("{}")
    return {
        "tensors": len(weight_map),
        "header_bytes": header_bytes,
        "apparent_bytes": sum(p.stat().st_size for p in folder.glob("*.safetensors")),
        "disk_bytes": sum(p.stat().st_blocks * 512 for p in folder.glob("*.safetensors")),
    }


def time_ours(folder: Path) -> tuple[float, int]:
    from eaglekit.preflight import files

    files._read_header.cache_clear()
    t0 = time.perf_counter()
    weights = files.read_weights(folder)
    seconds = time.perf_counter() - t0
    assert not weights.problems, weights.problems[:3]
    return seconds, len(weights.tensors())


def time_safetensors(folder: Path) -> tuple[float, int]:
    from safetensors import safe_open

    t0 = time.perf_counter()
    n = 0
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="numpy") as f:
            n += len(list(f.keys()))
    return time.perf_counter() - t0, n


def time_context(folder: Path, work: Path) -> float:
    """Building the stage context: the fingerprints of extract and its upstream stages. generate's (local backend)
    identifies the target folder by hashing the first and last MiB of every file in it."""
    from eaglekit import pipeline
    from eaglekit.config import load_config

    cfg = load_config(work / "cfg.yaml")
    t0 = time.perf_counter()
    pipeline.make_context(cfg, "extract")
    return time.perf_counter() - t0


def time_cli(folder: Path, work: Path) -> dict:
    (work / "prompts.jsonl").write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}]}) + "\n")
    (work / "cfg.yaml").write_text(
        json.dumps(
            {
                "run_dir": str(work / "run"),
                "target": {"model": str(folder)},
                "data": {"prompts": str(work / "prompts.jsonl")},
                "extract": {"mode": "offline"},
            }
        )
    )
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "eaglekit.cli", "preflight", str(work / "cfg.yaml"), "--stage", "extract", "--json"],
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    doc = json.loads(out.stdout)
    checks = {c["name"]: (c["status"], c["seconds"]) for c in doc["stages"]["extract"]}
    return {"wall": wall, "checks_seconds": doc["seconds"], "checks": checks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shards", type=int, default=100)
    ap.add_argument("--total-gb", type=float, default=540)
    ap.add_argument("--dir", type=Path, default=None, help="where to write the checkpoint (default: a temp folder)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp) / "ckpt"
        t0 = time.perf_counter()
        facts = write_checkpoint(folder, args.shards, int(args.total_gb * 1e9))
        print(
            f"checkpoint: {args.shards} shards, {facts['tensors']:,} tensors, {facts['apparent_bytes'] / 1e9:.0f} GB "
            f"apparent, {facts['disk_bytes'] / 1e6:.1f} MB on disk, {facts['header_bytes'] / 1e6:.1f} MB of headers "
            f"(written in {time.perf_counter() - t0:.1f} s)"
        )
        ours, theirs = [], []
        for _ in range(3):  # interleaved: A B A B A B
            ours.append(time_ours(folder)[0])
            theirs.append(time_safetensors(folder)[0])
        o, t = sorted(ours)[1], sorted(theirs)[1]
        print(
            f"headers: eaglekit read_weights {o * 1000:.0f} ms (median of {', '.join(f'{x * 1000:.0f}' for x in ours)}), "
            f"safetensors safe_open {t * 1000:.0f} ms ({', '.join(f'{x * 1000:.0f}' for x in theirs)}); "
            f"ratio eaglekit/safetensors {o / t:.2f}"
        )
        cli = time_cli(folder, Path(tmp))
        print(
            f"eaglekit preflight --stage extract: {cli['wall']:.1f} s wall (fresh process, imports included), "
            f"checks {cli['checks_seconds']:.1f} s"
        )
        for name, (status, seconds) in cli["checks"].items():
            print(f"  {name:22s} {status:5s} {seconds * 1000:8.0f} ms")
        listed = sum(seconds for _, seconds in cli["checks"].values())
        print(
            f"  (the checks listed: {listed:.1f} s; the rest is building the context — its fingerprints: "
            f"{time_context(folder, Path(tmp)):.1f} s measured in this process)"
        )


if __name__ == "__main__":
    main()
