"""The MLA drafter against the Llama drafter on a DeepSeek-V3-shaped target: same data, same step budget.

One run: the DeepSeek-V3-shaped tiny target (``eaglekit.tiny``, ``arch="deepseek_v3"``: MLA + routed experts,
trained on the tiny corpus for ``--target-steps``, built once into ``OUT/target``) answers the demo's kind of
prompts (generate), the answers are prepared, a draft vocab is chosen and the
target's features are extracted once (offline), shared by both drafters. Then each drafter trains the same number
of steps on the same batches and is evaluated by real draft -> verify decoding with the target. Reported:

  - trainable parameters, and the drafter's KV cache per token (MLA keeps one latent, Llama K and V per head);
  - held-out simulated τ at the end of training, and τ measured by decoding at each K (T = 0);
  - the time of one training step, both drafters timed interleaved (A B B A ...) on the same batch, median;
  - for scale, both drafters' trainable parameters and KV cache per token as eaglekit derives them from a full-size
    DeepSeek-V3 config (transformers' ``DeepseekV3Config()`` defaults; built on the meta device, nothing trained).

    .venv/bin/python benchmarks/mla_vs_llama.py --out runs/bench-mla          # ~7 min on 1 thread (4 of them the target)

Nothing here asserts anything; figures go to benchmarks/results/mla.md with the command.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from eaglekit import pipeline  # noqa: E402
from eaglekit.config import load_config  # noqa: E402
from eaglekit.rundir import RunDir  # noqa: E402

ARCHITECTURES = ("llama", "mla")
SHARED_STAGES = ("generate", "prepare", "vocab", "extract")


def base_config(target: Path, args) -> dict:
    return {
        "run_dir": ".",
        "target": {"model": str(target), "dtype": "float32"},
        "data": {"prompts": str(args.out / "prompts.jsonl"), "eval_fraction": 0.1},  # one file: same fingerprints
        "generate": {"backend": "local", "max_tokens": 200, "temperature": 0.0, "batch_size": 48},
        "prepare": {"max_length": 384},
        "vocab": {"draft_vocab_size": 80},
        "extract": {"mode": "offline", "dtype": "float32"},
        "train": {
            "max_steps": args.steps,
            "batch_size": 16,
            "lr": 3e-3,
            "warmup_steps": 10,
            "eval_every": 60,
            "save_every": args.steps,
            "ttt": {"steps": 4},
        },
        "evaluate": {
            "num_samples": args.eval_prompts,
            "num_speculative_tokens": [1, 3, 5],
            "temperatures": [0.0],
            "max_new_tokens": 96,
        },
    }


def write_config(folder: Path, data: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run(cfg, stages) -> None:
    with RunDir(cfg.run_dir).lock:
        for stage in stages:
            pipeline.run_stage(cfg, stage)


def kv_cache_floats_per_token(c) -> int:
    """What the serving engine caches per token for the drafter's one layer."""
    if c.architecture == "mla":
        return c.kv_lora_rank + c.qk_rope_head_dim  # the latent and the shared rotary key
    return 2 * c.num_key_value_heads * c.head_dim


def full_size_shapes(draft_vocab_size: int = 32000) -> dict[str, dict[str, int]]:
    """Both drafters derived from a full-size DeepSeek-V3 config: the tiny target's 2 heads hide MLA's point."""
    from accelerate import init_empty_weights
    from transformers import DeepseekV3Config

    from eaglekit.drafters.eagle3.model import DrafterConfig, Eagle3Drafter

    shapes = {}
    for arch in ARCHITECTURES:
        c = DrafterConfig.from_target_config(DeepseekV3Config(), draft_vocab_size, architecture=arch)
        with init_empty_weights():  # parameters on the meta device, the small d2t/t2d buffers real
            drafter = Eagle3Drafter(c)
        shapes[arch] = {
            "trainable_parameters": sum(p.numel() for p in drafter.parameters() if p.requires_grad),
            "kv_floats_per_token": kv_cache_floats_per_token(c),
        }
    return shapes


def step_times(runs: dict[str, Path], repeats: int) -> dict[str, float]:
    """Median seconds of one TTT training step (forward, backward, AdamW) per drafter, timed interleaved on one batch."""
    from eaglekit.config import TTTConfig
    from eaglekit.data.tokens import TokenStore
    from eaglekit.data.vocab import load_vocab
    from eaglekit.drafters.eagle3.checkpoint import load_drafter
    from eaglekit.drafters.eagle3.ttt import ttt_loss
    from eaglekit.model.target import embedding_and_head
    from eaglekit.training.data import collate
    from eaglekit.training.features import Features

    models, inputs = {}, None
    for arch, run_dir in runs.items():
        cfg = load_config(run_dir / "config.yaml")
        drafter, _ = load_drafter(run_dir / "train" / "checkpoints" / "best", torch.float32)
        embed, head = embedding_and_head(cfg.target.model)
        drafter.embed_tokens.weight.data.copy_(embed)
        params = [p for n, p in drafter.named_parameters() if n != "embed_tokens.weight"]
        models[arch] = (drafter, torch.optim.AdamW(params, lr=1e-6), cfg.train.ttt.steps)
        if inputs is None:
            store = TokenStore(run_dir / "prepare" / "tokens.safetensors")
            _, t2d = load_vocab(run_dir)
            features = Features(
                run_dir, t2d, torch.device("cpu"), drafter.config.aux_layer_ids or [2, 4, 5], torch.float32, head=head
            )
            inputs = features(collate(store, list(range(16)), features.store))

    def one_step(arch: str) -> float:
        drafter, optim, steps = models[arch]
        t0 = time.perf_counter()
        ttt_loss(drafter, *inputs[:5], settings=TTTConfig(steps=steps), target_in_draft=inputs[5]).loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    for arch in models:  # warmup
        one_step(arch)
    times: dict[str, list[float]] = {arch: [] for arch in models}
    for i in range(repeats):
        for arch in ARCHITECTURES if i % 2 == 0 else ARCHITECTURES[::-1]:
            times[arch].append(one_step(arch))
    return {arch: statistics.median(t) for arch, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench-mla")
    parser.add_argument(
        "--target", type=Path, default=None, help="a DeepSeek-V3-shaped target folder (default: build one)"
    )
    parser.add_argument("--target-steps", type=int, default=2000, help="training steps of the built tiny target")
    parser.add_argument("--prompts", type=int, default=400)
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--eval-prompts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per drafter")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    args.out = args.out.resolve()
    torch.set_num_threads(args.threads)

    from eaglekit.tiny import build_tiny_target, write_prompts

    t0 = time.monotonic()
    target = (args.target or args.out / "target").resolve()  # config paths are relative to each run folder
    if not (target / "config.json").exists():
        build_tiny_target(target, steps=args.target_steps, heldout=48, arch="deepseek_v3")
    shared = args.out / "shared"
    if not (args.out / "prompts.jsonl").exists():
        write_prompts(args.out / "prompts.jsonl", n=args.prompts, seed=1234)
    config = base_config(target, args)
    run(load_config(write_config(shared, config)), SHARED_STAGES)

    runs = {}
    for arch in ARCHITECTURES:
        folder = args.out / arch
        if not (folder / "train").exists():  # the shared stages' outputs, then this drafter's own
            shutil.rmtree(folder, ignore_errors=True)
            shutil.copytree(shared, folder, ignore=shutil.ignore_patterns(".lock"))
        data = json.loads(json.dumps(config))
        data["train"]["draft"] = {"architecture": arch}
        run(load_config(write_config(folder, data)), ("train", "evaluate"))
        runs[arch] = folder

    seconds = step_times(runs, args.repeats)
    from eaglekit.drafters.eagle3.checkpoint import load_drafter

    results = {}
    for arch, folder in runs.items():
        summary = json.loads((folder / "train" / "summary.json").read_text())
        report = json.loads((folder / "evaluate" / "report.json").read_text())
        c = load_drafter(folder / "train" / "checkpoints" / "best")[0].config
        results[arch] = {
            "trainable_parameters": summary["trainable_parameters"],
            "kv_floats_per_token": kv_cache_floats_per_token(c),
            "held_out_simulated_tau": round(summary["tau"], 3),
            "tau": {f"K={r['k']}": r["tau"] for r in report["results"] if r["method"] == "eagle"},
            "ngram_tau": {f"K={r['k']}": r["tau"] for r in report["results"] if r["method"] == "ngram"},
            "lossless": report["lossless"],
            "step_seconds": round(seconds[arch], 4),
        }
    results["deepseek_v3_size"] = full_size_shapes()
    results["mla/llama"] = {
        "step_time": round(seconds["mla"] / seconds["llama"], 3),
        "trainable_parameters": round(
            results["mla"]["trainable_parameters"] / results["llama"]["trainable_parameters"], 3
        ),
    }
    manifest = target / "eaglekit_tiny.json"
    results["setup"] = {
        "target": str(target),
        "target_build": json.loads(manifest.read_text()) if manifest.exists() else None,
        "prompts": args.prompts,
        "steps": args.steps,
        "threads": args.threads,
        "minutes": round((time.monotonic() - t0) / 60, 1),
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    print("\n| drafter | trainable params | KV floats/token | held-out sim. τ | τ K=1 | τ K=3 | τ K=5 | step s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for arch in ARCHITECTURES:
        r = results[arch]
        print(
            f"| {arch} | {r['trainable_parameters']:,} | {r['kv_floats_per_token']} | {r['held_out_simulated_tau']} | "
            + " | ".join(str(r["tau"].get(f"K={k}")) for k in (1, 3, 5))
            + f" | {r['step_seconds']} |"
        )
    print("\nDerived from a full-size DeepSeek-V3 config (draft vocab 32000):")
    for arch, r in results["deepseek_v3_size"].items():
        print(
            f"  {arch}: {r['trainable_parameters'] / 1e6:.1f}M trainable parameters, "
            f"{r['kv_floats_per_token']} KV floats/token"
        )


if __name__ == "__main__":
    main()
