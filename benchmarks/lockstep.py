"""Lockstep: eaglekit's EAGLE-3 training step beside speculators 0.9.0's, step by step on the same batches.

The τ race (benchmarks/tau_vs_speculators.py) left speculators' drafter 5–7 % ahead at K=5 with matched settings.
This finds where the two trainers part: one process (benchmarks/.venv-speculators/bin/python with PYTHONPATH=src,
which has both packages) trains both drafters from the same start on the same rows and compares them after every
step.

  data         the race's data in --out (tau_vs_speculators.make_data); an --out that already holds a race
               (its config.yaml) is read as it is and nothing in it is rewritten.
  speculators  Eagle3DraftModel.from_training_args at the race's seed, its multipack sampler and collate with
               shift_batch, its Trainer (AdamW 0.9/0.999, weight decay 0.01, clip 1.0, warmup + cosine, eager
               kl_div) — exactly as the race's child builds them — and its own ``Trainer.train_epoch`` runs the
               steps. The race's CPU adaptations, plus its progress bar off. Target features are computed
               per sample when a batch first needs it (the race computes all of them up front: same values).
  eaglekit     a drafter loaded with speculators' initial weights (``layers.0.`` = eaglekit's ``midlayer.``), trained
               after each of speculators' steps on the same packed row (unshifted: ttt_loss aligns itself) through
               the train stage's objective (training/objective.py: TTT) and its optimizer and schedule
               (training/optim.py) set as speculators': lr, weight decay 0.01 on every trainable tensor, betas
               0.9/0.999, clip 1.0, and transformers' warmup (step s at s/warmup: the first step at lr 0; eaglekit's
               own starts at 1/warmup). Loss mask: speculators' — a prediction counts where its input token is in the
               loss mask — and no target-in-draft filter (speculators has none).
  compare      after every step: loss, gradient norm before clipping, the lr applied, every gradient (after
               clipping) and every parameter, as the relative difference ||a - b|| / ||b||. speculators' loss is
               the KL divergence, eaglekit's value the soft cross-entropy (KL + the targets' entropy, the same
               gradient): the entropy term is added to speculators' for the comparison. Two lockstep drafters:
               "resynced" is given speculators' weights and AdamW state after every step, so what it differs by is
               that one step's own difference — the first step and tensor beyond float noise is judged on it and
               printed when it happens; "lockstep" runs free from the shared start, and its drift (rounding
               differences grown over the run) is the last column. A table row every --compare-every steps.
               Float noise (fp32): the two sides compute the same sums in other orders (dense eager attention
               against a blocked prefix attention merged by log-sum-exp, a per-step against a one-pass head), so each
               value carries rounding of ~1e-7 relative per operation, summed over ~2,000 positions and 200 logits:
               ~1e-6 on a gradient. NOISE = 1e-4 leaves a margin of 100 for that and for Adam, whose update divides
               by sqrt(v) and so magnifies noise in a near-zero gradient; a real difference (a position counted on
               one side only, a tensor decayed on one side only) shows at 1e-3 or more. The lr must agree to 1e-9.
  put back     --put-back A,B,... trains more eaglekit drafters beside it on the same steps, each with one of
               eaglekit's own choices back: ``mask`` (its loss mask: the predicted token in the mask, and the
               target's argmax in the draft vocab), ``optimizer`` (betas 0.9/0.95, no weight decay, clip 0.5),
               ``schedule`` (its warmup), ``batches`` (its own packing and order, training/data.py),
               ``init`` (its own initialisation at the seed). Their losses join the table.
  measure      at the end, held-out simulated τ of every drafter (the train stage's held-out figure,
               training/loop.HeldOut); --tau also saves them (--out/lockstep-NAME) and runs eaglekit's evaluate stage on
               each, as the race does, its pre-flight skipped (it wants a finished train stage; evaluate writes
               into --out's run directory, under its lock).

    PYTHONPATH=src OMP_NUM_THREADS=1 benchmarks/.venv-speculators/bin/python benchmarks/lockstep.py --steps 50
    ... benchmarks/lockstep.py --steps 300 --compare-every 25 --put-back mask,optimizer,schedule,batches,init
    ... benchmarks/lockstep.py --out /work/races/matched --steps 3     # a race's data, reused as it is

Prints figures and a JSON summary (--out/lockstep-*.json); asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from eaglekit import atomic  # noqa: E402

NOISE = 1e-4  # relative difference that fp32 reordering stays below (module docstring: why)
LR_NOISE = 1e-9
PUT_BACK = ("mask", "optimizer", "schedule", "batches", "init")
SPECULATORS_BETAS = (0.9, 0.999)  # torch's AdamW defaults, which speculators' build_optimizers keeps
SPECULATORS_DECAY, SPECULATORS_CLIP = 0.01, 1.0  # its TrainerConfig default, its Trainer's clip
clip_grad_norm = torch.nn.utils.clip_grad_norm_  # the real one: speculators' Trainer gets a recording wrapper


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("/work/races/lockstep"), help="a new folder, or a race's --out")
    p.add_argument("--target", choices=["tasks", "chatty"], default="tasks")
    p.add_argument("--prompts", type=int, default=1600)
    p.add_argument("--eval-fraction", type=float, default=0.05)
    p.add_argument("--draft-vocab", type=int, default=200)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (the schedule's length too)")
    p.add_argument("--seq", type=int, default=2048, help="packed tokens per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--ttt-steps", type=int, default=4)
    p.add_argument("--decay", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0, help="the data's seed (new --out) and the training seed")
    p.add_argument("--compare-every", type=int, default=10, help="a table row every this many steps")
    p.add_argument(
        "--put-back",
        type=lambda s: [x for x in s.split(",") if x],
        default=[],
        help=f"more eaglekit drafters, each with one of its own choices back: some of {','.join(PUT_BACK)}",
    )
    p.add_argument("--tau", action="store_true", help="save every drafter and run eaglekit's evaluate on each")
    p.add_argument("--ks", type=lambda s: [int(x) for x in s.split(",")], default=[1, 3, 5])
    p.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[0.0])
    p.add_argument("--eval-prompts", type=int, default=40)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    unknown = set(args.put_back) - set(PUT_BACK)
    if unknown:
        p.error(f"--put-back {','.join(sorted(unknown))}: not one of {', '.join(PUT_BACK)}")
    return args


# ------------------------------------------------------------------------------------------------ data


def race_config(args):
    """The race's run config: read from --out when a race made it (nothing rewritten), else made as the race does."""
    from tau_vs_speculators import make_data

    from eaglekit.config import load_config

    if (args.out / "config.yaml").exists():
        print(f"data: the race's in {args.out} (config.yaml), reused as it is", flush=True)
        return load_config(args.out / "config.yaml")
    args.out.mkdir(parents=True, exist_ok=True)
    return make_data(args.out, args)


@dataclass
class Sample:
    """One training sample with the target's features: what both trainers read."""

    ids: torch.Tensor  # [L]
    mask: torch.Tensor  # [L] bool, the prepare stage's loss mask
    aux: torch.Tensor  # [L, 3H] the aux layers' inputs
    last_hidden: torch.Tensor  # [L, H] the final decoder layer's output before the norm (speculators' verifier input)
    logits: torch.Tensor  # [L, Vd] the target's logits on the draft vocab (eaglekit's targets)
    in_draft: torch.Tensor  # [L] the target's argmax is in the draft vocab


class TargetSamples:
    """Samples by token-store index, their features computed by the target on first use and kept."""

    def __init__(self, store, target, aux_ids: list[int], t2d: torch.Tensor):
        from eaglekit.model.target import TargetFeatures, decoder_parts

        self.store = store
        self.features = TargetFeatures(target, aux_ids, t2d)
        self.final_norm = decoder_parts(target)[2]
        self.cache: dict[int, Sample] = {}

    @torch.no_grad()
    def __getitem__(self, i: int) -> Sample:
        if i not in self.cache:
            _, ids, mask = self.store[i]
            ids = ids.long()
            pre_norm: dict[str, torch.Tensor] = {}
            handle = self.final_norm.register_forward_pre_hook(lambda m, a: pre_norm.__setitem__("h", a[0]))
            try:
                f = self.features(ids[None], torch.ones_like(ids[None]))
            finally:
                handle.remove()
            assert f.target_logits is not None and f.target_in_draft is not None  # asked with logits
            self.cache[i] = Sample(
                ids, mask.bool(), f.aux[0].float(), pre_norm["h"][0].float(), f.target_logits[0].float(),
                f.target_in_draft[0].bool(),
            )  # fmt: skip
        return self.cache[i]


def eaglekit_row(samples: TargetSamples, row: list[int], speculators_mask: bool) -> tuple:
    """One packed row in the objective's inputs (aux, ids, target logits, loss mask, attention mask, in-draft,
    position ids). ``speculators_mask``: a prediction counts where its input token is in the loss mask (the mask
    shifted right by one inside each document) and the in-draft filter is off, as in speculators."""
    parts = [samples[i] for i in row]
    cat = lambda xs: torch.cat(xs)[None]  # noqa: E731
    ids = cat([s.ids for s in parts])
    if speculators_mask:
        mask, in_draft = cat([F.pad(s.mask[:-1], (1, 0)) for s in parts]), None
    else:
        mask, in_draft = cat([s.mask for s in parts]), cat([s.in_draft for s in parts])
    positions = cat([torch.arange(len(s.ids)) for s in parts])
    aux, logits = cat([s.aux for s in parts]), cat([s.logits for s in parts])
    return aux, ids, logits, mask.long(), torch.ones_like(ids), in_draft, positions


# ----------------------------------------------------------------------------------------- speculators


@dataclass
class Recorded:
    """What speculators' Trainer computes and does not keep, recorded at each step."""

    loss: float = math.nan
    grad_norm: float = math.nan
    lr: float = math.nan
    fetched: list[int] = field(default_factory=list)  # dataset indices read for the step's batch, in order


def speculators_trainer(cfg, args, samples: TargetSamples, train_idx: list[int], hf, aux_ids, d2t, t2d):
    """speculators' drafter, data loader and Trainer as the race's child builds them; returns (trainer, recorded)."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train import trainer as trainer_module
    from speculators.train.dataloader import _setup_dataloader
    from speculators.train.trainer import Trainer, TrainerConfig
    from tau_vs_speculators import in_memory_dataset, speculators_eagle3, trainer_on_cpu

    recorded = Recorded()
    lengths = [len(samples.store[i][1]) for i in train_idx]

    def fetch(index):
        recorded.fetched.append(index)
        s = samples[train_idx[index]]
        return {
            "hidden_states": s.aux.clone(),
            "input_ids": s.ids.clone(),
            "verifier_last_hidden_states": s.last_hidden.clone(),
            "loss_mask": s.mask.clone(),
        }

    model = speculators_eagle3(hf, args.intermediate, cfg.target.model, aux_ids, d2t, t2d, args.ttt_steps)
    loader = _setup_dataloader(
        in_memory_dataset(lengths, fetch, args.seq),
        args.seq,
        hf.hidden_size,
        num_workers=0,
        preprocess=shift_batch,
        seed=args.seed,
    )
    train_kwargs, val_kwargs = Eagle3DraftModel.get_trainer_kwargs(
        loss_fn="kl_div", loss_implementation="eager", ttt_steps=args.ttt_steps, ttt_step_loss_decay=args.decay
    )
    trainer_on_cpu(trainer_module)
    trainer_module.tqdm = lambda iterable, **kw: iterable  # its progress bar: this script's table replaces it
    config = TrainerConfig(
        lr=args.lr,
        num_epochs=math.ceil(args.steps / len(loader)),
        save_path=str(args.out / "lockstep-speculators-trainer"),
        train_call_kwargs=train_kwargs,
        val_call_kwargs=val_kwargs,
        scheduler_type="cosine",
        optimizer="adamw",
        scheduler_warmup_steps=args.warmup,
        max_steps=args.steps,
        hidden_states_dtype=torch.float32,
        log_freq=10**9,
        checkpoint_freq=10**6,
    )
    trainer = Trainer(model, config, loader, None)

    # Record what its step computes and drops: the loss its forward returns (as a soft cross-entropy, the value
    # eaglekit reports), the gradient norm its clip returns and the lr its optimizer applies (read at the clip, just
    # before its optimizer step). Nothing is changed.
    forward = model.forward

    def recorded_forward(**kw):
        out = forward(**kw)
        recorded.loss = float(out[1].detach()) + target_entropy(model, kw, args.ttt_steps, args.decay)
        return out

    model.forward = recorded_forward  # type: ignore[method-assign]

    def recording_clip(params, max_norm, *a, **kw):
        norm = clip_grad_norm(params, max_norm, *a, **kw)
        recorded.grad_norm = float(norm)
        recorded.lr = trainer.optimizers[0].param_groups[0]["lr"]
        return norm

    torch.nn.utils.clip_grad_norm_ = recording_clip  # eaglekit's side calls the real one (clip_grad_norm)
    return trainer, recorded


@torch.no_grad()
def target_entropy(model, batch: dict, ttt_steps: int, decay: float) -> float:
    """What speculators' KL loss lacks of the soft cross-entropy that eaglekit reports (KL + the targets' entropy,
    which has no gradient): sum_k decay^k * the mean entropy of its step-k targets, over its step-k loss mask
    (speculators' metrics.align_for_step: targets and mask from position k on)."""
    targets = model.verifier_lm_head(model.verifier_norm(batch["verifier_last_hidden_states"]))
    entropy = -(targets.softmax(-1) * targets.log_softmax(-1)).sum(-1)
    mask = batch["loss_mask"].float()
    return sum(
        decay**k * float((entropy[:, k:] * mask[:, k:]).sum() / mask[:, k:].sum().clamp(min=1))
        for k in range(ttt_steps)
    )


def eaglekit_name(name: str) -> str:
    """speculators' parameter name -> eaglekit's (its decoder layer is ``layers.0``, eaglekit's ``midlayer``)."""
    return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name


# -------------------------------------------------------------------------------------------- eaglekit


class EaglekitSide:
    """One eaglekit drafter with the train stage's objective, optimizer and schedule, stepped as its loop does."""

    def __init__(self, name: str, drafter, cfg, args, put_back: str | None):
        from eaglekit.drafters.eagle3.objective import TTT
        from eaglekit.training.optim import build_optimizer, build_scheduler, lr_factor

        self.name, self.drafter, self.put_back = name, drafter, put_back
        tc = cfg.train
        self.ttt = TTT(drafter, tc.ttt)
        self.ttt.train()
        self.named = [(n, p) for n, p in drafter.named_parameters() if p.requires_grad]
        self.clip = tc.grad_clip
        self.optim = build_optimizer(tc, self.named)
        if put_back == "schedule":
            self.sched = build_scheduler(tc, self.optim, args.steps)
        else:  # transformers' warmup, which speculators uses: step s at s / warmup (eaglekit's: (s + 1) / warmup)
            self.sched = torch.optim.lr_scheduler.LambdaLR(
                self.optim,
                lambda s: lr_factor(s - 1 if s < tc.warmup_steps else s, tc.warmup_steps, args.steps, tc.min_lr_ratio),
            )
        if put_back != "optimizer":
            for group in self.optim.param_groups:
                group["betas"] = SPECULATORS_BETAS
        self.speculators_mask = put_back != "mask"
        self.own_batches = None
        if put_back == "batches":
            from eaglekit.data.shards import plan_shards
            from eaglekit.training.data import RunBatches

            store = samples_store(cfg)  # online, the train stage's blocks are the shard plan of the token store
            blocks = plan_shards(store.lengths.tolist(), cfg.extract.shard_tokens)
            self.own_batches = RunBatches(cfg, store, blocks, None, 1, 0)
            self.epoch_rows: tuple[int, list] = (-1, [])

    def row(self, step: int, speculators_row: list[int]) -> list[int]:
        """The step's packed row: speculators' (token-store indices), or eaglekit's own order."""
        if self.own_batches is None:
            return speculators_row
        epoch, pos = self.own_batches.position(step)
        if self.epoch_rows[0] != epoch:
            self.epoch_rows = (epoch, self.own_batches.epoch(epoch))
        return self.epoch_rows[1][pos][0]  # one row per step (batch_size 1)

    def step(self, samples: TargetSamples, row: list[int]) -> tuple[float, float, float]:
        """The loop's step (training/loop.py: optimizer_step, then optimizer and schedule); (loss, grad norm, lr)."""
        lr = float(self.sched.get_last_lr()[0])
        loss, _ = self.ttt(*eaglekit_row(samples, row, self.speculators_mask))
        loss.backward()
        grad_norm = float(clip_grad_norm([p for _, p in self.named], self.clip))
        self.optim.step()
        self.sched.step()
        return float(loss.detach()), grad_norm, lr

    def zero_grad(self) -> None:
        self.optim.zero_grad(set_to_none=True)


def samples_store(cfg):
    from eaglekit.data.tokens import TokenStore

    return TokenStore(Path(cfg.run_dir) / "prepare" / "tokens.safetensors")


def eaglekit_config(cfg, args, put_back: str | None):
    """The race's run config with eaglekit's train keys set as speculators' (or one of them put back)."""
    from eaglekit.config import TrainConfig

    cfg = cfg.model_copy(deep=True)
    tc = cfg.train
    tc.max_steps, tc.lr, tc.warmup_steps, tc.min_lr_ratio = args.steps, args.lr, args.warmup, 0.0
    ttt = tc.ttt  # step_weights first: each assignment is validated, the weights against the steps
    ttt.step_weights, ttt.steps, ttt.decay, ttt.loss = None, args.ttt_steps, args.decay, "kl_div"  # type: ignore[assignment]
    ttt.loss_normalization, ttt.noise = "token", "none"
    tc.optimizer, tc.freeze_lm_head, tc.seed, tc.batch_size, tc.grad_accum = "adamw", True, args.seed, 1, 1
    tc.packing, tc.pack_length = True, args.seq
    tc.draft.intermediate_size = args.intermediate
    tc.draft.fc_norm = tc.draft.norm_output = False  # speculators' drafter is the plain EAGLE-3 form
    defaults = TrainConfig.model_fields
    own = put_back == "optimizer"
    tc.weight_decay = defaults["weight_decay"].default if own else SPECULATORS_DECAY
    tc.grad_clip = defaults["grad_clip"].default if own else SPECULATORS_CLIP
    return cfg


def load_speculators_weights(drafter, speculators_model) -> None:
    """Copy speculators' weights into an eaglekit drafter; the two must hold the same tensors by name."""
    from eaglekit.errors import EaglekitError

    theirs = {eaglekit_name(k): v for k, v in speculators_model.state_dict().items()}
    theirs = {k: v for k, v in theirs.items() if not k.startswith("verifier_")}  # its copy of the target's head
    ours = drafter.state_dict()
    if set(theirs) != set(ours):
        raise EaglekitError(
            f"speculators' drafter and eaglekit's hold other tensors: only speculators' {sorted(set(theirs) - set(ours))}, "
            f"only eaglekit's {sorted(set(ours) - set(theirs))}",
            "build both with the same shape (norm_before_residual false, no fc_norm/norm_before_fc, one layer)",
        )
    drafter.load_state_dict(theirs)


# -------------------------------------------------------------------------------------------- compare


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def tensor_differences(side: EaglekitSide, speculators_model) -> tuple[dict[str, float], dict[str, float]]:
    """Per trainable tensor (eaglekit's names): relative difference of the gradient (after clipping), of the weights."""
    theirs = {eaglekit_name(k): p for k, p in speculators_model.named_parameters()}
    grads, params = {}, {}
    for name, p in side.named:
        q = theirs[name]
        if p.grad is None or q.grad is None:
            grads[name] = math.inf if (p.grad is None) != (q.grad is None) else 0.0
        else:
            grads[name] = relative(p.grad, q.grad)
        params[name] = relative(p.detach(), q.detach())
    return grads, params


def resync(side: EaglekitSide, speculators_model, speculators_optim) -> None:
    """Speculators' weights and AdamW moments into the lockstep drafter, so the next step starts equal."""
    theirs = {eaglekit_name(k): p for k, p in speculators_model.named_parameters()}
    with torch.no_grad():
        for name, p in side.named:
            q = theirs[name]
            p.copy_(q)
            for key, value in speculators_optim.state[q].items():
                side.optim.state[p][key] = value.clone()


# ----------------------------------------------------------------------------------------------- main


def main() -> None:
    args = parse_args()
    try:
        from speculators.models.eagle3 import Eagle3DraftModel  # noqa: F401
    except ImportError as err:
        sys.exit(
            f"speculators is not importable ({err}): run this with benchmarks/.venv-speculators/bin/python "
            "(bash benchmarks/setup_speculators.sh makes it) and PYTHONPATH=src"
        )
    from transformers import AutoConfig

    from eaglekit.config import TargetConfig
    from eaglekit.data.vocab import load_vocab
    from eaglekit.drafters.eagle3.init import build_drafter
    from eaglekit.drafters.eagle3.model import Eagle3Drafter
    from eaglekit.model.target import aux_layer_ids, embedding_and_head, load_target
    from eaglekit.training.data import split_indices
    from eaglekit.training.loop import seed_everything

    torch.set_num_threads(args.threads)
    t_start = time.monotonic()
    cfg = race_config(args)
    run_dir = Path(cfg.run_dir)

    # the race child's order up to its drafter's init, so that the seed gives its very weights
    torch.manual_seed(args.seed)
    store = samples_store(cfg)
    train_idx, _ = split_indices(store, cfg.data.eval_fraction)
    d2t, t2d = load_vocab(run_dir)
    target_cfg = TargetConfig(model=cfg.target.model)
    target = load_target(target_cfg, "cpu")
    hf = AutoConfig.from_pretrained(cfg.target.model)
    aux_ids = aux_layer_ids(target_cfg, hf.num_hidden_layers)
    samples = TargetSamples(store, target, aux_ids, t2d)
    trainer, recorded = speculators_trainer(cfg, args, samples, train_idx, hf, aux_ids, d2t, t2d)
    spec_model, spec_optim = trainer.model, trainer.optimizers[0]

    embed, head = embedding_and_head(target)
    sides: list[EaglekitSide] = []
    for put_back in [None, None, *args.put_back]:
        ek_cfg = eaglekit_config(cfg, args, put_back)
        if put_back == "init":  # the train stage's own start: seeded, then built (training/loop.py)
            seed_everything(args.seed)
        drafter: Eagle3Drafter = build_drafter(ek_cfg, hf, d2t, t2d, embed, head, aux_ids)[0]
        if put_back != "init":
            load_speculators_weights(drafter, spec_model)
        name = put_back or ("lockstep" if not sides else "resynced")
        sides.append(EaglekitSide(name, drafter, ek_cfg, args, put_back))
    # "resynced" starts every step from speculators' weights and AdamW state, so its difference is that step's own
    # (what the first divergence is judged on); "lockstep" runs free, so its drift is rounding grown over the run.
    lockstep, resynced, put_backs = sides[0], sides[1], sides[2:]
    print(
        f"lockstep: {args.steps} steps of up to {args.seq} packed tokens, {len(train_idx)} train samples, "
        f"{len(trainer.train_loader)} speculators batches per epoch; eaglekit drafters: "
        f"{', '.join(s.name for s in sides)}; noise threshold {NOISE:g} relative (judged on 'resynced')",
        flush=True,
    )
    head_row = f"{'step':>5} {'lr':>9} {'loss spec':>10} {'Δloss':>8} {'Δ|g|':>8} {'worst Δgrad (one step)':>30} "
    head_row += f"{'worst Δparam (one step)':>30} {'drift (free run)':>30}"
    head_row += "".join(f" {'loss ' + s.name:>14}" for s in put_backs)
    print(head_row, flush=True)

    rows: list[dict] = []
    first: dict | None = None

    def after_step() -> None:
        nonlocal first
        step = trainer.global_step - 1
        row = [train_idx[i] for i in recorded.fetched]
        recorded.fetched.clear()
        figures = {s.name: s.step(samples, s.row(step, row)) for s in sides}
        loss, grad_norm, lr = figures["resynced"]
        grads, params = tensor_differences(resynced, spec_model)
        drift = tensor_differences(lockstep, spec_model)[1]
        worst_grad, worst_param = max(grads, key=grads.__getitem__), max(params, key=params.__getitem__)
        worst_drift = max(drift, key=drift.__getitem__)
        r = {
            "step": step + 1,
            "lr": [recorded.lr, lr],
            "loss": [recorded.loss, loss],
            "grad_norm": [recorded.grad_norm, grad_norm],
            "d_loss": abs(loss - recorded.loss) / max(abs(recorded.loss), 1e-30),
            "d_grad_norm": abs(grad_norm - recorded.grad_norm) / max(recorded.grad_norm, 1e-30),
            "d_grad": grads,
            "d_param": params,
            "drift_param": drift,
            "drift_loss": abs(figures["lockstep"][0] - recorded.loss) / max(abs(recorded.loss), 1e-30),
            "put_back_loss": {s.name: figures[s.name][0] for s in put_backs},
        }
        rows.append(r)
        over = [(f"lr ({recorded.lr:.6g} vs {lr:.6g})", abs(lr - recorded.lr) / max(abs(recorded.lr), 1e-30), LR_NOISE)]
        over += [("loss", r["d_loss"], NOISE), ("gradient norm", r["d_grad_norm"], NOISE)]
        over += [(f"gradient of {n}", v, NOISE) for n, v in grads.items()]
        over += [(f"weights of {n}", v, NOISE) for n, v in params.items()]
        beyond = [(what, v) for what, v, limit in over if v > limit]
        if beyond and first is None:
            what, v = beyond[0]
            first = {"step": step + 1, "what": what, "relative": v, "all": beyond}
            print(
                f"FIRST DIVERGENCE at step {step + 1}: {what} differs by {v:.3g} relative (> noise); also beyond: "
                + ", ".join(f"{w} {x:.2g}" for w, x in beyond[1:8]),
                flush=True,
            )
        if (step + 1) % args.compare_every == 0 or step == 0 or step + 1 == args.steps:
            line = f"{step + 1:>5} {lr:>9.3g} {recorded.loss:>10.5f} {r['d_loss']:>8.1e} {r['d_grad_norm']:>8.1e} "
            line += (
                f"{worst_grad[-21:]:>21} {grads[worst_grad]:>8.1e} {worst_param[-21:]:>21} {params[worst_param]:>8.1e} "
            )
            line += f"{worst_drift[-21:]:>21} {drift[worst_drift]:>8.1e}"
            line += "".join(f" {figures[s.name][0]:>14.5f}" for s in put_backs)
            print(line, flush=True)
        resync(resynced, spec_model, spec_optim)
        for s in sides:
            s.zero_grad()

    for epoch in range(trainer.config.num_epochs):
        trainer.train_epoch(epoch, step_callback=after_step)
        if trainer.global_step >= args.steps:
            break
    print(f"lockstep: {trainer.global_step} steps in {time.monotonic() - t_start:.0f} s", flush=True)
    if first is None:
        print(f"no divergence beyond {NOISE:g} relative in {trainer.global_step} steps", flush=True)

    drafters = {"speculators": spec_drafter(spec_model, Eagle3Drafter(lockstep.drafter.config))}
    drafters |= {f"eaglekit-{s.name}": s.drafter for s in [lockstep, *put_backs]}
    tag = "-".join(["lockstep", *args.put_back])
    summary_path = args.out / f"{tag}-steps{args.steps}.json"
    summary = {"argv": sys.argv, "noise": NOISE, "first_divergence": first, "steps": rows}
    atomic.write_json(summary_path, summary)  # written again as each slower figure below arrives
    if args.tau:
        saved = save_drafters(args.out, drafters, spec_model)
    summary["held_out"] = held_out_taus(cfg, args, drafters, target, t2d, aux_ids)
    atomic.write_json(summary_path, summary)
    if args.tau:
        summary["evaluate_tau"] = evaluate_taus(cfg, args, saved)
        atomic.write_json(summary_path, summary)
    print(f"summary: {summary_path}", flush=True)


def spec_drafter(spec_model, drafter):
    """speculators' trained drafter as an eaglekit drafter (same weights), for eaglekit's held-out figures."""
    load_speculators_weights(drafter, spec_model)
    return drafter


def held_out_taus(cfg, args, drafters: dict, target, t2d, aux_ids) -> dict:
    """Held-out simulated τ and per-step accuracy of each drafter: the train stage's figure (training/loop.HeldOut),
    eaglekit's mask convention for every drafter."""
    import contextlib

    from eaglekit.drafters.eagle3.objective import TTT
    from eaglekit.training.data import RunBatches
    from eaglekit.training.features import Features
    from eaglekit.training.loop import HeldOut

    ek_cfg = eaglekit_config(cfg, args, None)
    features = Features(Path(cfg.run_dir), t2d, torch.device("cpu"), aux_ids, torch.float32, target)
    batches = RunBatches(ek_cfg, samples_store(cfg), [], None, 1, 0)
    out = {}
    print("\nheld-out (the train stage's figure: teacher-forced, eaglekit's mask)", flush=True)
    for name, drafter in drafters.items():
        ttt = TTT(drafter, ek_cfg.train.ttt)
        held = HeldOut(ttt, drafter, features, batches, contextlib.nullcontext, False, args.ttt_steps, ttt.step_weights)
        f = held.figures()
        out[name] = {"tau": f["tau"], "acc_k": f["acc_k"], "loss": f["loss"]}
        acc = " / ".join(f"{a:.4f}" for a in f["acc_k"])
        print(f"  {name:<22} simulated τ {f['tau']:.3f}   acc_k {acc}   loss {f['loss']:.4f}", flush=True)
    return out


def save_drafters(out: Path, drafters: dict, spec_model) -> dict[str, Path]:
    """Each drafter in a folder of --out: speculators' in its own form (save_pretrained), eaglekit's in the legacy one."""
    from eaglekit.drafters.eagle3.checkpoint import save_legacy

    folders = {}
    for name, drafter in drafters.items():
        folders[name] = out / f"lockstep-{name}"
        if name == "speculators":
            spec_model.save_pretrained(folders[name])
        else:
            save_legacy(drafter, folders[name])
    return folders


def evaluate_taus(cfg, args, folders: dict[str, Path]) -> dict:
    """τ of each saved drafter from eaglekit's evaluate stage, as the race measures its drafters. Its pre-flight is
    skipped: it wants the run's train stage finished, and the lockstep trains outside it (the drafter is
    evaluate.checkpoint). A drafter whose evaluation fails is reported and the others are measured."""
    from tau_vs_speculators import taus

    from eaglekit.pipeline import run_stage
    from eaglekit.rundir import RunDir

    cfg = cfg.model_copy(deep=True)
    ev = cfg.evaluate
    ev.num_samples, ev.num_speculative_tokens, ev.temperatures = args.eval_prompts, args.ks, args.temperatures
    ev.max_new_tokens = args.max_new_tokens
    out: dict[str, dict] = {}
    for name, folder in folders.items():
        ev.checkpoint = str(folder)
        try:
            with RunDir(cfg.run_dir).lock:
                run_stage(cfg, "evaluate", force=True, skip_preflight=True)
            report = json.loads((Path(cfg.run_dir) / "evaluate" / "report.json").read_text())
        except Exception as err:  # noqa: BLE001 - one drafter's failure is a result; the others are still measured
            print(f"evaluate {name}: failed: {type(err).__name__}: {err}", flush=True)
            out[name] = {"error": f"{type(err).__name__}: {err}"}
            continue
        atomic.write_json(args.out / f"report-lockstep-{name}.json", report)
        out[name] = taus(report)["tau"]
    print("\nevaluate τ (eaglekit's evaluate stage on the held-out prompts):", flush=True)
    for name, by_key in out.items():
        print(f"  {name:<22} " + "  ".join(f"K={key} {tau}" for key, tau in by_key.items()), flush=True)
    return out


if __name__ == "__main__":
    main()
