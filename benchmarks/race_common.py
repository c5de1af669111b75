"""What the step-for-step races against speculators 0.9.0 share (dflash_vs_speculators.py, dspark_vs_speculators.py,
dflash2_vs_speculators.py, peagle_vs_speculators.py).

Every race gives both trainers the same rows of the tiny target's train split and the same target features at every
step (``step_rows``, ``batch_features``), trains speculators' side in a child process of its own venv
(``run_child``; the child rebuilds its samples with ``child_samples``), loads the drafter it saved into eaglekit's
model, measures both with eaglekit's decoding at T=0 (``Race.measured``) and reports the mean and a 95 % bootstrap
interval over seeds per K for each side and for the ratio (``report``). A family's script says only what is its
own: how each side builds and trains its drafter, and how speculators' save is read and checked.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPECULATORS_PYTHON = ROOT / "benchmarks" / ".venv-speculators" / "bin" / "python"
# eaglekit's side's AdamW betas, weight decay and gradient clip (--eaglekit-optimizer): the train stage's defaults
# (None), or an ablation's: speculators' Trainer's, or eaglekit's before train.adam_betas
OPTIMIZERS = {
    "eaglekit": None,
    "speculators": ((0.9, 0.999), 0.01, 1.0),
    "eagle-reference": ((0.9, 0.95), 0.0, 0.5),  # eaglekit's defaults before train.adam_betas (the EAGLE repo's)
}
NEW_TOKENS = 96  # dflash_vs_eagle3.measure's generation length


# --------------------------------------------------------------------------------------------- the shared data


def step_rows(rows: list, steps: int, batch: int, seed: int) -> list[list]:
    """The rows of each step: dflash_vs_eagle3.py's seeded order, cycling through the corpus."""
    order = random.Random(seed).sample(range(len(rows)), len(rows))
    return [[rows[order[(step * batch + i) % len(rows)]] for i in range(batch)] for step in range(steps)]


def batch_features(target, aux: list[int], picked: list) -> dict:
    """One step's padded rows and the target's features of them: aux states (both sides), the argmax of its
    next-token logits (eaglekit's block labels), the next-token logits themselves (eaglekit's EAGLE-3 targets) and
    the final hidden state before the norm (speculators' input: it applies the verifier's norm and head itself)."""
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


def tail_mean(losses: list[float]) -> float:
    tail = losses[-max(1, len(losses) // 10) :]
    return sum(tail) / len(tail)


def optimizer(params: list, args):
    """eaglekit's side's AdamW (--eaglekit-optimizer) and its gradient clip."""
    import torch

    from eaglekit.config import TrainConfig

    defaults = TrainConfig()
    chosen = OPTIMIZERS[args.eaglekit_optimizer]
    betas, decay, clip = chosen or (defaults.adam_betas, defaults.weight_decay, defaults.grad_clip)
    return torch.optim.AdamW(params, lr=args.lr, betas=betas, weight_decay=decay), clip


# ---------------------------------------------------------------------------------------- speculators' child


def run_child(script: str, job: dict, args) -> float:
    """Runs ``script --speculators-child JOB`` in speculators' venv (its own model, loss and Trainer); seconds."""
    import shutil

    shutil.rmtree(job["out"], ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": str(args.threads)}
    t0 = time.monotonic()
    subprocess.run([str(args.speculators_python), script, "--speculators-child", json.dumps(job)], check=True, env=env)
    return time.monotonic() - t0


def child_batches(job: dict) -> list[dict]:
    """In the child: its threads and seed set, the steps' batches the race saved."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(job["seed"])
    return torch.load(job["batches"])


def child_samples(batches: list[dict]) -> tuple[list[dict], int, int]:
    """In the child: one speculators sample per row of each step, trimmed to its length (its collate packs a step's
    rows again), the rows per step and the longest step's packed length."""
    samples = []
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
    return samples, batches[0]["input_ids"].shape[0], max(int(b["attention_mask"].sum()) for b in batches)


def child_loader(samples: list[dict], rows: int, packed: int, steps: int, hidden: int, aux: int, preprocess=None):
    """speculators' DataLoader over the child's samples: its dataset and collate (one packed sequence per step,
    document ids), eaglekit's steps as the batches (``preprocess``: its per-sample shift, where the family has one)."""
    import torch
    from speculators.train.data import CollateFn
    from tau_vs_speculators import in_memory_dataset
    from torch.utils.data import DataLoader

    dataset = in_memory_dataset(
        [len(s["input_ids"]) for s in samples], lambda index: {k: v.clone() for k, v in samples[index].items()}, packed
    )
    return DataLoader(
        dataset,
        batch_sampler=[list(range(s * rows, (s + 1) * rows)) for s in range(steps)],
        collate_fn=CollateFn(packed, hidden, num_target_layers=aux, dtype=torch.float32, preprocess=preprocess),
    )


def child_train(model, loader, train_kwargs: dict, val_kwargs: dict, job: dict, steps: int) -> dict:
    """speculators' own Trainer (AdamW, constant lr) over the loader, on the CPU; the final drafter saved by its
    save_pretrained under out/final. The loss of every step, read from its forward's output."""
    import torch
    from speculators.train import trainer as trainer_module
    from speculators.train.trainer import Trainer, TrainerConfig
    from tau_vs_speculators import trainer_on_cpu

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
        max_steps=steps,
        hidden_states_dtype=torch.float32,
        log_freq=10**9,
        checkpoint_freq=10**6,
    )
    trainer = Trainer(model, config, loader, None)
    trainer.run_training()
    if trainer.global_step < steps:
        sys.exit(f"speculators child: stopped at step {trainer.global_step} of {steps}; final/ not written")
    model.save_pretrained(Path(job["out"]) / "final")
    return {"steps": trainer.global_step, "tail_loss": tail_mean(losses)}


def speculators_block_child(job: dict, model, forward_check, **family_loss) -> None:
    """speculators' own trainer of a block family (DFlash, DSpark, DFlash2) on the race's packed batches, with the
    loss every block race matches: cross-entropy against the target's argmax per slot, D-PACE weights at α 0.5
    (eaglekit's), at most --anchors anchors a packed step; ``family_loss`` adds the family's own terms. Then the
    family's ``forward_check`` of the saved drafter against eaglekit's model of it."""
    batches = child_batches(job)
    samples, rows, packed = child_samples(batches)
    hidden = model.config.transformer_layer_config.hidden_size
    loader = child_loader(samples, rows, packed, len(batches), hidden, len(job["aux"]))
    train_kwargs, val_kwargs = type(model).get_trainer_kwargs(
        loss_fn="ce",
        loss_implementation="eager",
        per_position_loss_weight="dpace",
        dpace_alpha=0.5,
        max_anchors=job["anchors"],
        **family_loss,
    )
    summary = child_train(model, loader, train_kwargs, val_kwargs, job, len(batches))
    write_summary(job, summary | {"forward_check": forward_check(model, batches[0], job)})


def write_summary(job: dict, summary: dict) -> None:
    (Path(job["out"]) / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"speculators child: {json.dumps(summary)}", flush=True)


def checked(summary: dict, tolerance: float = 1e-3) -> dict:
    """The child's forward check, refused where speculators' forward and eaglekit's differ on its weights."""
    check = summary["forward_check"]
    if not check["same_drafts"] or check["max_abs_logit_diff"] > tolerance:
        raise RuntimeError(f"speculators' forward and eaglekit's differ on its weights: {check}")
    return check


# ------------------------------------------------------------------------------------ speculators' block forms


def load_block_drafter(
    folder: Path, embed, head, config_class, drafter_class, own_keys: tuple[str, ...] = (), expected_state=None
):
    """A block drafter (DFlash, DSpark, DFlash2) saved by speculators' save_pretrained, as eaglekit's drafter of
    ``drafter_class``. Its weight names are eaglekit's (and vLLM's); it leaves out the embedding and, over the full
    vocabulary, the head: both are the target's. Its config says the rest: the layer shape, aux layers, block size,
    mask token and the family's ``own_keys`` (passed to ``config_class`` as they are). ``expected_state``: the
    family's exported keys and shapes of a config (DFlash's by default), which the save must hold exactly."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from eaglekit.drafters.dflash.checkpoint import SHARED, validate_state

    c = json.loads((folder / "config.json").read_text())
    layer = AutoConfig.for_model(**c["transformer_layer_config"])  # its diff dict: the Qwen3 defaults filled in
    cfg = config_class.from_target_config(
        layer,
        c["aux_hidden_state_layer_ids"],
        c["mask_token_id"],
        num_hidden_layers=layer.num_hidden_layers,
        block_size=c["block_size"],
        **{key: c[key] for key in own_keys},
    )
    state = {k: v for k, v in load_file(folder / "model.safetensors").items() if k not in SHARED}
    expected = None if expected_state is None else expected_state(cfg)
    validate_state(state, cfg, f"{folder}/model.safetensors", expected)
    drafter = drafter_class(cfg)
    drafter.load_state_dict(state, strict=False)
    drafter.take_target(embed, head)
    return drafter.to(torch.float32)


def speculators_block_layer(job: dict):
    """The Qwen3 layer config speculators' DFlash-family models are built on: the target's shape with --layers
    layers, every one full attention (vLLM's and eaglekit's)."""
    from tau_vs_speculators import draft_layer_shape
    from transformers import AutoConfig, Qwen3Config

    hf = AutoConfig.from_pretrained(job["target"])
    layer = Qwen3Config(
        **draft_layer_shape(hf, hf.intermediate_size, job["layers"]),
        attention_bias=False,
        layer_types=["full_attention"] * job["layers"],
    )
    return hf, layer


def block_context(model, batch: dict, job: dict):
    """Speculators' DFlash-family layers on one block as served: the first row's context before a position n,
    queries [token n-1, mask x (block-1)] at n..n+block-1, every query seeing everything (no mask). Returns its
    normed hidden states [1, block, H], the queries, n and the aux states of the context."""
    import torch

    n = int(batch["attention_mask"][0].sum()) - job["block"]
    aux = batch["aux"][:1, :n]
    queries = torch.full((1, job["block"]), job["mask_token_id"])
    queries[0, 0] = batch["input_ids"][0, n - 1]
    positions = torch.arange(n + job["block"])[None]
    model.eval()
    with torch.no_grad():
        context = model.hidden_norm(model.fc(aux))
        h = model.embed_tokens(queries)
        rope = model.rotary_emb(h, positions)
        for layer in model.layers:
            h = layer(hidden_states=h, target_hidden=context, attention_mask=None, position_embeddings=rope)
    return model.norm(h), queries, n, aux


def eaglekit_block_hidden(drafter, queries, n: int, aux):
    """eaglekit's drafter on the same block (``block_context``): its normed hidden states [1, block, H]."""
    import torch

    positions = torch.arange(n + queries.shape[1])[None]
    with torch.no_grad():
        kv = drafter.context_kv(drafter.context(aux), positions[:, :n])
        return drafter.final_hidden(queries, positions[:, n:], kv)


def logit_check(theirs, mine, drafting) -> dict:
    """The largest logit difference and whether the drafts (argmax at the ``drafting`` slots) agree."""
    import torch

    return {
        "max_abs_logit_diff": float((theirs.float() - mine.float()).abs().max()),
        "same_drafts": bool(torch.equal(theirs[..., drafting, :].argmax(-1), mine[..., drafting, :].argmax(-1))),
    }


def train_block_eaglekit(drafter, batches: list[dict], args, seed: int, extra_weight: float = 1.0) -> tuple:
    """eaglekit's block objective (drafters/dflash/objective.py: random anchors, per-document blocks, CE on the
    target's argmax, D-PACE, the family's own slot bias and slot loss) over the race's steps: (seconds, mean loss of
    the last tenth of the steps)."""
    import torch

    from eaglekit.drafters.dflash.objective import block_loss

    params = [p for p in drafter.parameters() if p.requires_grad]
    optim, clip = optimizer(params, args)
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
            extra_weight=extra_weight,
        )
        optim.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, clip)
        optim.step()
        losses.append(float(out.loss.detach()))
    return time.perf_counter() - t0, tail_mean(losses)


# ---------------------------------------------------------------------------------------------------- the race


def arguments(doc: str, out: str, **defaults) -> argparse.ArgumentParser:
    """The options every race takes (a family adds its own): seeds, budget, measure, venv."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--seeds", type=int, default=3, help="train each side this many times (seeds --first-seed, …)")
    p.add_argument("--first-seed", type=int, default=0, help="the first seed (each seed also orders the batches)")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps, both trainers")
    p.add_argument("--batch", type=int, default=8, help="rows per step, both trainers")
    p.add_argument("--lr", type=float, default=1e-3, help="constant, both trainers")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 3, 7], help="drafts per round at measure time")
    p.add_argument("--prompts", type=int, default=12, help="held-out prompts to decode")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / out)
    p.add_argument("--eaglekit-optimizer", choices=sorted(OPTIMIZERS), default="eaglekit", help="eaglekit's side")
    p.add_argument("--no-speculators", action="store_true", help="train eaglekit's side only (an ablation)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--speculators-python", type=Path, default=SPECULATORS_PYTHON)
    p.add_argument("--speculators-child", help=argparse.SUPPRESS)
    p.set_defaults(**defaults)
    return p


class Race:
    """The tiny target, its data and the held-out prompts, loaded once; ``run`` races two sides over the seeds."""

    def __init__(self, args):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from eaglekit.drafters.dflash.model import default_mask_token_id
        from eaglekit.model.target import default_aux_layers
        from eaglekit.tiny import ensure_tiny_target, sample_tasks
        from eaglekit.tiny.build import encode

        if not args.speculators_python.exists():
            sys.exit(f"{args.speculators_python} does not exist: run `bash benchmarks/setup_speculators.sh` first")
        torch.set_num_threads(args.threads)
        args.out.mkdir(parents=True, exist_ok=True)
        self.args = args
        self.path = ensure_tiny_target()
        self.tok = AutoTokenizer.from_pretrained(self.path)
        self.target = AutoModelForCausalLM.from_pretrained(self.path).eval()
        self.aux = default_aux_layers(self.target.config.num_hidden_layers)
        self.mask_token_id = default_mask_token_id(self.tok, self.target.config.vocab_size)
        self.rows = encode(self.tok, sample_tasks(1024, 0), random.Random(0))
        held_out = encode(self.tok, sample_tasks(args.prompts, 1, "heldout"), random.Random(1))
        self.prompts = [ids[:start] for ids, start in held_out]
        self.stop = {self.tok.eos_token_id}
        self.embed = self.target.get_input_embeddings().weight.detach()
        self.head = self.target.lm_head.weight.detach()

    def job(self, seed: int, **own) -> dict:
        """The child's job: where the batches and its output are, the target, aux layers, seed and lr."""
        return {
            "batches": str(self.args.out / f"batches-seed{seed}.pt"),
            "out": str(self.args.out / f"speculators-seed{seed}"),
            "target": str(self.path),
            "aux": self.aux,
            "mask_token_id": self.mask_token_id,
            "seed": seed,
            "lr": self.args.lr,
        } | own

    def measured(self, drafter) -> dict:
        """τ (tokens per target pass) and acceptance by draft position per K: eaglekit's decoding at T=0 with the
        drafter's family's proposer (dflash_vs_eagle3.measure)."""
        from dflash_vs_eagle3 import measure

        drafter.eval()
        out = {}
        for k in self.args.ks:
            tau, positions = measure("race", drafter, self.target, self.prompts, k, self.stop)
            out[str(k)] = {"tau": round(tau, 4), "acceptance_by_position": [round(x, 3) for x in positions]}
        return out

    def speculators_seed(self, seed: int, speculators_side: Callable[[dict], dict]) -> dict:
        """speculators' side of one seed, or its result saved by an earlier run with the same settings: its side
        costs minutes a seed where eaglekit's costs seconds, so an ablation of eaglekit's side reruns only that."""
        from tau_vs_speculators import isolated

        from eaglekit import atomic

        saved = self.args.out / f"speculators-seed{seed}.json"
        settings = shared_settings(self.args)
        if saved.exists():
            record = json.loads(saved.read_text())
            if record.get("settings") == settings and "error" not in record["result"]:
                print(f"speculators seed {seed}: reusing {saved} (same settings)", flush=True)
                return record["result"]
        result = isolated("speculators", seed, lambda: speculators_side(self.job(seed)))
        if "error" not in result:
            atomic.write_text(saved, json.dumps({"settings": settings, "result": result}, indent=1))
        return result

    def run(
        self, title: str, eaglekit_side: Callable[[list, int], dict], speculators_side: Callable[[dict], dict]
    ) -> None:
        """Per seed: the steps' batches (saved for the child), each side trained and measured (a failure is reported
        and the race goes on); then the report, and race.json under --out."""
        import torch
        from tau_vs_speculators import isolated

        args = self.args
        runs: dict[str, dict[int, dict]] = {"eaglekit": {}, "speculators": {}}
        seeds = range(args.first_seed, args.first_seed + args.seeds)
        for seed in seeds:
            picked = step_rows(self.rows, args.steps, args.batch, seed)
            batches = [batch_features(self.target, self.aux, rows) for rows in picked]
            job = self.job(seed)
            torch.save(batches, job["batches"])
            runs["eaglekit"][seed] = isolated("eaglekit", seed, lambda b=batches, s=seed: eaglekit_side(b, s))
            if not args.no_speculators:
                runs["speculators"][seed] = self.speculators_seed(seed, speculators_side)
            for side, by_seed in runs.items():
                if seed in by_seed:
                    print(f"{side} seed {seed}: {json.dumps(by_seed[seed])}", flush=True)
            Path(job["batches"]).unlink()
        print(
            f"\n{title} race on the tiny target: {args.steps} steps x {args.batch} rows, lr {args.lr:g} constant; "
            f"seeds {seeds.start}..{seeds.stop - 1}; {args.prompts} held-out prompts, {NEW_TOKENS} new tokens, T=0\n"
        )
        print(report(runs, args.ks))
        (args.out / "race.json").write_text(
            json.dumps({"argv": sys.argv, "args": {k: str(v) for k, v in vars(args).items()}, "runs": runs}, indent=1)
        )


# options that change eaglekit's side only, or where and how the race runs: not part of speculators' settings
EAGLEKIT_ONLY = {"seeds", "first_seed", "out", "no_speculators", "threads", "speculators_python", "speculators_child"}


def shared_settings(args) -> dict:
    """The options speculators' side of a seed depends on (a saved result is reused only under the same ones)."""
    return {
        k: str(v) for k, v in sorted(vars(args).items()) if k not in EAGLEKIT_ONLY and not k.startswith("eaglekit_")
    }


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
