"""The DFlash race (issue 21): eaglekit's DFlash trainer against speculators 0.9.0's own DFlash model, loss and trainer.

Same data, same drafter shape, same step budget; each trainer otherwise as it ships. Both drafters are then
measured by eaglekit's block decoding (speculative/block.py, vLLM's DFlash proposer) on the same prompts.

  data         dflash_vs_eagle3.py's: the tiny target's task corpus (train split) rendered with its chat template,
               loss on the assistant turn; --steps batches of --batch rows picked in a seeded order. The target's
               features of each batch are computed once (eaglekit's TargetFeatures, aux layers [2, 4, 5]) and
               given to both sides: the same rows, features and order at every step.
  eaglekit     DFlashDrafter + training/block.py's block_loss (random anchors, per-document blocks, CE on the
               target's argmax, D-PACE), padded rows; AdamW betas 0.9/0.95, no weight decay, clip 0.5.
  speculators  in its own venv (benchmarks/.venv-speculators): DFlashDraftModel.from_training_args, its collate
               (the batch's rows packed into one sequence with document ids), get_trainer_kwargs (loss "ce",
               D-PACE) and its Trainer (AdamW betas 0.9/0.999, weight decay 0.01, clip 1.0). Its verifier targets
               come from the final decoder layer's output before the norm (it applies the verifier's norm and head).
               CPU adaptations, as tau_vs_speculators.py's: device "cpu" (its trainer moves models to
               cuda:LOCAL_RANK), its step profiler off (it synchronizes an accelerator), eager attention (flex
               attention has no CPU backward) and the eager loss (the fused ones need Triton).
  matched      layers --layers and block --block (its defaults 5 and 16: changed, for the CPU budget), the
               target's layer shape (intermediate 256), one k_norm per layer (speculators' layers; eaglekit's
               shared_k_norm off), the mask token (eaglekit's default_mask_token_id, passed as its
               mask_token_id), max anchors --anchors, D-PACE alpha 0.5, the full verifier vocabulary, embedding
               and head frozen at the target's, lr --lr constant (its scheduler default "linear" changed to
               "none"), the steps and the rows of each step.
  differs      the optimizer settings and clip above; initialisation (speculators: normal(0.02), eaglekit:
               torch's default); anchors: speculators draws --anchors per packed sequence and never in its last
               block, eaglekit per row (a row has fewer loss tokens than --anchors, so every one); a block that
               runs past its document's end keeps counting in speculators (into the next packed document, whose
               first tokens are outside the loss mask), eaglekit stops at the end.
  measure      speculators' saved checkpoint loaded into eaglekit's DFlashDrafter (its weight names are the
               same; the key set and shapes are checked), after a check that its own forward and eaglekit's give
               the same logits on a real block; then dflash_vs_eagle3.py's measure: --prompts held-out prompts,
               96 new tokens, temperature 0, τ (tokens per target pass) per K and acceptance per draft position.

    .venv/bin/python benchmarks/dflash_vs_speculators.py --steps 5 --seeds 1      # smoke, ~2 min
    .venv/bin/python benchmarks/dflash_vs_speculators.py                          # 3 seeds, ~35 min on one core
    .venv/bin/python benchmarks/dflash_vs_speculators.py --no-speculators --eaglekit-optimizer speculators
                                    # eaglekit's side alone with speculators' AdamW settings and clip (~5 min)

--seeds N trains each side N times (seeds 0..N-1; each seed also picks the batches' order) and reports the mean
and a 95 % bootstrap interval over seeds per K for each side and for the ratio. A side that fails is reported as
failed and the race goes on. It needs benchmarks/.venv-speculators (bash benchmarks/setup_speculators.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPECULATORS_PYTHON = ROOT / "benchmarks" / ".venv-speculators" / "bin" / "python"
sys.path.insert(0, str(ROOT / "src"))
# AdamW betas, weight decay, gradient clip: eaglekit's train stage defaults, and speculators' Trainer's (an ablation
# of eaglekit's side: --eaglekit-optimizer speculators)
OPTIMIZERS = {"eaglekit": ((0.9, 0.95), 0.0, 0.5), "speculators": ((0.9, 0.999), 0.01, 1.0)}


# --------------------------------------------------------------------------------------------- the shared data


def step_rows(rows: list, steps: int, batch: int, seed: int) -> list[list]:
    """The rows of each step: dflash_vs_eagle3.py's seeded order, cycling through the corpus."""
    order = random.Random(seed).sample(range(len(rows)), len(rows))
    return [[rows[order[(step * batch + i) % len(rows)]] for i in range(batch)] for step in range(steps)]


def batch_features(target, aux: list[int], picked: list) -> dict:
    """One step's padded rows and the target's features of them: aux states (both sides), the argmax of its
    next-token logits (eaglekit's labels) and the final hidden state before the norm (speculators' input)."""
    import torch

    from eaglekit.model.target import TargetFeatures, decoder_parts, target_argmax
    from eaglekit.tiny.build import batch_tensors

    ids, labels, attention = batch_tensors(picked, 0)
    pre_norm: dict[str, torch.Tensor] = {}
    final_norm = decoder_parts(target)[2]
    handle = final_norm.register_forward_pre_hook(lambda m, a: pre_norm.__setitem__("h", a[0]))
    try:
        f = TargetFeatures(target, aux)(ids, attention, with_logits=False)
    finally:
        handle.remove()
    return {
        "input_ids": ids,
        "attention_mask": attention,
        "loss_mask": (labels != -100).long(),
        "aux": f.aux.float(),
        "argmax": target_argmax(f.last_hidden, target.lm_head.weight.detach()),
        "pre_norm": pre_norm["h"].float(),
    }


# ------------------------------------------------------------------------------------------- eaglekit's side


def dflash_config(target_config, aux: list[int], mask_token_id: int, args):
    from eaglekit.drafters.dflash.model import DFlashConfig

    return DFlashConfig.from_target_config(
        target_config, aux, mask_token_id, num_hidden_layers=args.layers, block_size=args.block, shared_k_norm=False
    )


def train_eaglekit(drafter, batches: list[dict], args, seed: int) -> tuple[float, float]:
    """(seconds, mean loss of the last tenth of the steps)."""
    import torch

    from eaglekit.drafters.dflash.objective import block_loss

    params = [p for p in drafter.parameters() if p.requires_grad]
    betas, decay, clip = OPTIMIZERS[args.eaglekit_optimizer]
    optim = torch.optim.AdamW(params, lr=args.lr, betas=betas, weight_decay=decay)
    generator = torch.Generator().manual_seed(seed)
    losses = []
    t0 = time.perf_counter()
    for b in batches:
        out = block_loss(
            drafter,
            b["aux"],
            b["argmax"],
            b["input_ids"],
            b["loss_mask"],
            b["attention_mask"],
            max_anchors=args.anchors,
            generator=generator,
        )
        optim.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, clip)
        optim.step()
        losses.append(float(out.loss.detach()))
    return time.perf_counter() - t0, tail_mean(losses)


def tail_mean(losses: list[float]) -> float:
    tail = losses[-max(1, len(losses) // 10) :]
    return sum(tail) / len(tail)


# ---------------------------------------------------------------------------------------- speculators' side


def train_speculators(batches_file: Path, folder: Path, args, seed: int, mask_token_id: int, aux: list[int]) -> float:
    import shutil

    from eaglekit.tiny import ensure_tiny_target

    shutil.rmtree(folder, ignore_errors=True)
    job = {
        "batches": str(batches_file),
        "out": str(folder),
        "target": str(ensure_tiny_target()),
        "aux": aux,
        "mask_token_id": mask_token_id,
        "seed": seed,
        "lr": args.lr,
        "layers": args.layers,
        "block": args.block,
        "anchors": args.anchors,
    }
    t0 = time.monotonic()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": str(args.threads)}
    child = [str(args.speculators_python), __file__, "--speculators-child", json.dumps(job)]
    subprocess.run(child, check=True, env=env)
    return time.monotonic() - t0


def speculators_child(job: dict) -> None:
    """Runs in benchmarks/.venv-speculators: speculators' own DFlash model, collate, loss and Trainer."""
    import torch
    from speculators.models.dflash import DFlashDraftModel
    from speculators.train import trainer as trainer_module
    from speculators.train.data import CollateFn
    from speculators.train.trainer import Trainer, TrainerConfig
    from tau_vs_speculators import in_memory_dataset, trainer_on_cpu
    from torch.utils.data import DataLoader

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(job["seed"])
    batches = torch.load(job["batches"])
    samples = []  # one per row of each step, trimmed to its length; the collate packs a step's rows again
    for b in batches:
        for row in range(b["input_ids"].shape[0]):
            n = int(b["attention_mask"][row].sum())
            samples.append(
                {
                    "hidden_states": b["aux"][row, :n],
                    "input_ids": b["input_ids"][row, :n],
                    "verifier_last_hidden_states": b["pre_norm"][row, :n],
                    "loss_mask": b["loss_mask"][row, :n].bool(),
                }
            )
    rows = batches[0]["input_ids"].shape[0]
    packed = max(int(b["attention_mask"].sum()) for b in batches)

    model = speculators_model(job)
    hidden = model.config.transformer_layer_config.hidden_size
    loader = DataLoader(
        in_memory_dataset(
            [len(s["input_ids"]) for s in samples],
            lambda index: {k: v.clone() for k, v in samples[index].items()},
            packed,
        ),
        batch_sampler=[list(range(s * rows, (s + 1) * rows)) for s in range(len(batches))],  # eaglekit's steps
        collate_fn=CollateFn(packed, hidden, num_target_layers=len(job["aux"]), dtype=torch.float32),
    )
    train_kwargs, val_kwargs = DFlashDraftModel.get_trainer_kwargs(
        loss_fn="ce",
        loss_implementation="eager",
        per_position_loss_weight="dpace",
        dpace_alpha=0.5,
        max_anchors=job["anchors"],
    )
    trainer_on_cpu(trainer_module)
    losses: list[float] = []
    model.register_forward_hook(lambda m, a, out: losses.append(float(out[1].detach())))
    config = TrainerConfig(
        lr=job["lr"],
        num_epochs=1,
        save_path=job["out"],
        train_call_kwargs=train_kwargs,
        val_call_kwargs=val_kwargs,
        optimizer="adamw",
        scheduler_type="none",
        max_steps=len(batches),
        hidden_states_dtype=torch.float32,
        log_freq=10**9,
        checkpoint_freq=10**6,
    )
    trainer = Trainer(model, config, loader, None)
    trainer.run_training()
    model.save_pretrained(Path(job["out"]) / "final")
    check = forward_check(model, batches[0], job)
    summary = {"steps": trainer.global_step, "tail_loss": tail_mean(losses), "forward_check": check}
    (Path(job["out"]) / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"speculators child: {json.dumps(summary)}", flush=True)


def speculators_model(job: dict):
    """speculators' DFlashDraftModel as its CLI builds it (``from_training_args``), on a Qwen3 layer config of the
    target's shape with --layers layers, the full verifier vocabulary (no t2d / d2t) and the race's mask token."""
    from speculators.models.dflash import DFlashDraftModel
    from tau_vs_speculators import draft_layer_shape
    from transformers import AutoConfig, Qwen3Config

    hf = AutoConfig.from_pretrained(job["target"])
    layer = Qwen3Config(
        **draft_layer_shape(hf, hf.intermediate_size, job["layers"]),
        attention_bias=False,
        layer_types=["full_attention"] * job["layers"],
    )
    model = DFlashDraftModel.from_training_args(
        verifier_config=layer,
        verifier_name_or_path=job["target"],
        target_layer_ids=job["aux"],
        draft_vocab_size=hf.vocab_size,
        block_size=job["block"],
        mask_token_id=job["mask_token_id"],
        draft_attn_impl="eager",  # flex attention has no CPU backward
    )
    assert not model.uses_sliding_window_attn, "every draft layer must be full attention (vLLM's and eaglekit's)"
    return model


def forward_check(model, batch: dict, job: dict) -> dict:
    """Speculators' own layers and eaglekit's DFlashDrafter with its saved weights on one block as served: the
    first row's context before a position n, queries [token n-1, mask x (block-1)] at n..n+block-1, every query
    seeing everything (no mask). Returns the largest logit difference and whether the drafts agree."""
    import torch

    from eaglekit.model.target import embedding_and_head

    embed, head = embedding_and_head(job["target"])
    ours = load_speculators_drafter(Path(job["out"]) / "final", embed, head)
    model.eval()
    n = int(batch["attention_mask"][0].sum()) - job["block"]
    aux = batch["aux"][:1, :n]
    queries = torch.full((1, job["block"]), job["mask_token_id"])
    queries[0, 0] = batch["input_ids"][0, n - 1]
    positions = torch.arange(n + job["block"])[None]
    with torch.no_grad():
        context = model.hidden_norm(model.fc(aux))
        h = model.embed_tokens(queries)
        rope = model.rotary_emb(h, positions)
        for layer in model.layers:
            h = layer(hidden_states=h, target_hidden=context, attention_mask=None, position_embeddings=rope)
        theirs = model.lm_head(model.norm(h)).float()
        kv = ours.context_kv(ours.context(aux), positions[:, :n])
        mine = ours(queries, positions[:, n:], kv)
    return {
        "max_abs_logit_diff": float((theirs - mine).abs().max()),
        "same_drafts": bool(torch.equal(theirs[0, 1:].argmax(-1), mine[0, 1:].argmax(-1))),
    }


def load_speculators_drafter(folder: Path, embed, head):
    """speculators' saved DFlash checkpoint as eaglekit's DFlashDrafter. Its weight names are eaglekit's (and
    vLLM's qwen3_dflash.py's); it leaves out the embedding and, over the full vocabulary, the head: both are the
    target's. Its config says the rest: the layer shape, aux layers, block size and mask token."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from eaglekit.drafters.dflash.checkpoint import SHARED, validate_state
    from eaglekit.drafters.dflash.model import DFlashConfig, DFlashDrafter

    c = json.loads((folder / "config.json").read_text())
    layer = AutoConfig.for_model(**c["transformer_layer_config"])  # its diff dict: the Qwen3 defaults filled in
    cfg = DFlashConfig.from_target_config(
        layer,
        c["aux_hidden_state_layer_ids"],
        c["mask_token_id"],
        num_hidden_layers=layer.num_hidden_layers,
        block_size=c["block_size"],
    )
    state = {k: v for k, v in load_file(folder / "model.safetensors").items() if k not in SHARED}
    validate_state(state, cfg, f"{folder}/model.safetensors")
    drafter = DFlashDrafter(cfg)
    drafter.load_state_dict(state, strict=False)
    drafter.take_target(embed, head)
    return drafter.to(torch.float32)


# ---------------------------------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=3, help="train each side this many times (seeds 0, 1, …)")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps, both trainers")
    p.add_argument("--batch", type=int, default=8, help="rows per step, both trainers")
    p.add_argument("--lr", type=float, default=1e-3, help="constant, both trainers")
    p.add_argument("--layers", type=int, default=2, help="draft layers (speculators' default 5)")
    p.add_argument("--block", type=int, default=8, help="block size (speculators' default 16)")
    p.add_argument("--anchors", type=int, default=512, help="max anchors per step's sequence (speculators' default)")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 3, 7], help="drafts per block at measure time")
    p.add_argument("--prompts", type=int, default=12, help="held-out prompts to decode")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "dflash_vs_speculators")
    p.add_argument("--eaglekit-optimizer", choices=sorted(OPTIMIZERS), default="eaglekit", help="eaglekit's side")
    p.add_argument("--no-speculators", action="store_true", help="train eaglekit's side only (an ablation)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--speculators-python", type=Path, default=SPECULATORS_PYTHON)
    p.add_argument("--speculators-child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.speculators_child:
        return speculators_child(json.loads(args.speculators_child))
    if max(args.ks) > args.block - 1:
        sys.exit(f"--ks {max(args.ks)}: a block of {args.block} drafts at most {args.block - 1} tokens")
    if not args.speculators_python.exists():
        sys.exit(f"{args.speculators_python} does not exist: run `bash benchmarks/setup_speculators.sh` first")

    import torch
    from dflash_vs_eagle3 import measure
    from tau_vs_speculators import isolated
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eaglekit.drafters.dflash.model import DFlashDrafter, default_mask_token_id
    from eaglekit.model.target import default_aux_layers
    from eaglekit.tiny import ensure_tiny_target, sample_tasks
    from eaglekit.tiny.build import encode

    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    path = ensure_tiny_target()
    tok = AutoTokenizer.from_pretrained(path)
    target = AutoModelForCausalLM.from_pretrained(path).eval()
    aux = default_aux_layers(target.config.num_hidden_layers)
    mask_token_id = default_mask_token_id(tok, target.config.vocab_size)
    rows = encode(tok, sample_tasks(1024, 0), random.Random(0))
    prompts = [ids[:start] for ids, start in encode(tok, sample_tasks(args.prompts, 1, "heldout"), random.Random(1))]
    stop = {tok.eos_token_id}
    embed, head = target.get_input_embeddings().weight.detach(), target.lm_head.weight.detach()

    def measured(drafter) -> dict:
        drafter.eval()
        out = {}
        for k in args.ks:
            tau, positions = measure("dflash", drafter, target, prompts, k, stop)
            out[str(k)] = {"tau": round(tau, 4), "acceptance_by_position": [round(x, 3) for x in positions]}
        return out

    def eaglekit_run(batches: list[dict], seed: int) -> dict:
        torch.manual_seed(seed)
        drafter = DFlashDrafter(dflash_config(target.config, aux, mask_token_id, args))
        drafter.take_target(embed, head)
        seconds, loss = train_eaglekit(drafter, batches, args, seed)
        return {"train_s": round(seconds, 1), "tail_loss": round(loss, 4), "k": measured(drafter)}

    def speculators_run(batches_file: Path, seed: int) -> dict:
        folder = args.out / f"speculators-seed{seed}"
        seconds = train_speculators(batches_file, folder, args, seed, mask_token_id, aux)
        summary = json.loads((folder / "summary.json").read_text())
        check = summary["forward_check"]
        if not check["same_drafts"] or check["max_abs_logit_diff"] > 1e-3:
            raise RuntimeError(f"speculators' forward and eaglekit's differ on its weights: {check}")
        drafter = load_speculators_drafter(folder / "final", embed, head)
        return {"train_s": round(seconds, 1), "tail_loss": round(summary["tail_loss"], 4)} | {
            "forward_check": check,
            "k": measured(drafter),
        }

    runs: dict[str, dict[int, dict]] = {"eaglekit": {}, "speculators": {}}
    for seed in range(args.seeds):
        batches = [batch_features(target, aux, picked) for picked in step_rows(rows, args.steps, args.batch, seed)]
        batches_file = args.out / f"batches-seed{seed}.pt"
        torch.save(batches, batches_file)
        runs["eaglekit"][seed] = isolated("eaglekit", seed, lambda b=batches, s=seed: eaglekit_run(b, s))
        if not args.no_speculators:
            runs["speculators"][seed] = isolated(
                "speculators", seed, lambda f=batches_file, s=seed: speculators_run(f, s)
            )
        for side, by_seed in runs.items():
            if seed in by_seed:
                print(f"{side} seed {seed}: {json.dumps(by_seed[seed])}", flush=True)
        batches_file.unlink()
    print(
        f"\nDFlash race on the tiny target: {args.steps} steps x {args.batch} rows, lr {args.lr:g} constant, "
        f"{args.layers} layers, block {args.block}, max anchors {args.anchors}; seeds 0..{args.seeds - 1}; "
        f"{args.prompts} held-out prompts, 96 new tokens, T=0\n"
    )
    print(report(runs, args.ks))
    (args.out / "race.json").write_text(
        json.dumps({"argv": sys.argv, "args": {k: str(v) for k, v in vars(args).items()}, "runs": runs}, indent=1)
    )


def report(runs: dict[str, dict[int, dict]], ks: list[int]) -> str:
    """Mean and 95 % interval over seeds per K of each side and of the ratio, then acceptance by position."""
    from tau_vs_speculators import bootstrap

    ok = {side: [r for r in by_seed.values() if "error" not in r] for side, by_seed in runs.items()}
    lines = [
        f"{side} seed {s}: FAILED ({r['error']})" for side, by in runs.items() for s, r in by.items() if "error" in r
    ]

    def fmt(v):
        return f"{v[0]:.3f} [{v[1]:.3f}, {v[2]:.3f}]"

    lines += ["", f"n = {len(ok['eaglekit'])} / {len(ok['speculators'])} seeds; mean [95 % interval]", ""]
    lines += ["| K | τ eaglekit | τ speculators | ratio |", "|---|---|---|---|"]
    for k in ks:
        a, b = ([r["k"][str(k)]["tau"] for r in ok[side]] for side in ("eaglekit", "speculators"))
        ratio = f"**x{fmt(bootstrap(a, b))}**" if a and b else "-"
        lines.append(f"| {k} | {fmt(bootstrap(a)) if a else '-'} | {fmt(bootstrap(b)) if b else '-'} | {ratio} |")
    lines += ["", "Acceptance by draft position (mean over seeds):", ""]
    for k in ks:
        for side in ("eaglekit", "speculators"):
            per_seed = [r["k"][str(k)]["acceptance_by_position"] for r in ok[side]]
            if per_seed:
                mean = [sum(col) / len(col) for col in zip(*per_seed, strict=True)]
                lines.append(f"K={k} {side}: " + " ".join(f"{x:.3f}" for x in mean))
    for side in ("eaglekit", "speculators"):
        if ok[side]:
            secs = sum(r["train_s"] for r in ok[side]) / len(ok[side])
            loss = sum(r["tail_loss"] for r in ok[side]) / len(ok[side])
            lines.append(f"\n{side}: training {secs:.0f} s per seed, loss over the last tenth of the steps {loss:.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
