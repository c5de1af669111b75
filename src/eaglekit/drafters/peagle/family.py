"""The P-EAGLE family (parallel EAGLE-3, arXiv 2602.01469): EAGLE-3's Llama layer drafting all K tokens in one pass.

What it shares with EAGLE-3 it takes from there (``drafters/eagle3/``): the layer, the flags, the forms, the memory
model, training-time test's attention and loss. Its own parts: the slots (``model.py``: mask_hidden and the slot
token), the objective (training-time test whose draft step d is slot d, ``PEagleDrafter.draft_step_input``), the
proposer (``proposer.py``), the forms with the slot token (``checkpoint.py``) and the served-as-a-chain cause
(``diagnosis.py``).

How the peers train it, and why this objective is theirs in expectation (speculators ``models/peagle/``, SpecForge
``algorithms/peagle/``): a depth-d element anchored at t holds the slot token and mask_hidden at position t+d,
attends the real positions up to t and its own chain's depths 1..d, and is trained on the target's distribution at
t+d; every element weighs the same, and COD sampling keeps about max(0.7^d, 0.2) of the chains at depth d, so depth
d weighs max(0.7^d, 0.2) of depth 0 in expectation. Training-time test's attention is exactly that mask (step d of
chain t: step-0 keys up to t, the chain's own keys of steps 1..d, RoPE t+d, target t+1+d), and it needs no (nK)²
score matrix, so every chain trains at every depth (no sampling) under ``train.ttt.weights``.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path
from typing import Any

import torch

from eaglekit.config import PEagleDraft, RunConfig
from eaglekit.contract import StageContext
from eaglekit.data.chat import load_tokenizer
from eaglekit.drafters.dflash.model import default_mask_token_id
from eaglekit.drafters.diagnosis import ServedDrafter
from eaglekit.drafters.eagle3.family import (
    decoder_layers,
    describe_layer,
    forms_to_write,
    local_verifier_warning,
    serving_problems,
    write_forms,
)
from eaglekit.drafters.eagle3.init import (
    build_drafter,
    drafter_folder,
    freeze_head,
    remap_vocab,
    take_target_embedding,
)
from eaglekit.drafters.eagle3.llama import Eagle3LlamaFamily
from eaglekit.drafters.family import LoadChecked, Verdict, Written, one_object, verifier_id
from eaglekit.drafters.peagle import checkpoint as peagle_checkpoint
from eaglekit.drafters.peagle.diagnosis import diagnose
from eaglekit.drafters.peagle.model import PEagleConfig, PEagleDrafter
from eaglekit.drafters.peagle.proposer import ParallelProposer
from eaglekit.errors import EaglekitError
from eaglekit.model.checkpoint_files import CheckpointInfo
from eaglekit.model.run_shapes import target_and_aux
from eaglekit.model.target import embedding_and_head
from eaglekit.serving.engine_features import export_check
from eaglekit.training.distributed import say
from eaglekit.training.objective import Built

NO_SGLANG = "SGLang does not serve parallel drafting (sglang#23171 is open)"


class PEagleFamily(Eagle3LlamaFamily):
    name = "peagle"
    title = "P-EAGLE"
    forms = ("eagle3", "speculators")
    draft_model = PEagleDraft
    drafter_class = PEagleDrafter  # type: ignore[assignment]  # built from a PEagleConfig, EAGLE-3's from its own
    card_form = "EAGLE-3's plain Llama config with pard_token and mask_hidden, served with parallel_drafting"

    # ---- the drafter a fresh run builds
    def draft_settings(self, cfg: RunConfig) -> dict[str, Any]:
        """EAGLE-3's Llama settings (fc_norm on unless set); norm_output off unless set: no draft feeds another, so
        the feature it would norm is never read."""
        settings = super().draft_settings(cfg)
        if cfg.train.draft_as(PEagleDraft).norm_output is None:
            settings["norm_output"] = False
        settings["architecture"] = "llama"
        settings.pop("mask_token_id", None)
        return settings

    def mask_token(self, cfg: RunConfig, vocab_size: int) -> int:
        """train.draft.mask_token_id, else the tokenizer's mask, pad or eos token (DFlash's choice)."""
        token = cfg.train.draft_as(PEagleDraft).mask_token_id
        if token is not None:
            return int(token)
        tokenizer = load_tokenizer(cfg.target.model, cfg.target.chat_template, cfg.target.trust_remote_code)
        return default_mask_token_id(tokenizer, vocab_size)

    def drafter_config(self, cfg: RunConfig, hf: Any, aux: list[int]) -> PEagleConfig:
        base = super().drafter_config(cfg, hf, aux)
        return PEagleConfig(**dataclasses.asdict(base), mask_token_id=self.mask_token(cfg, base.vocab_size))

    # ---- pre-flight
    def shape_line(self, dc: Any) -> str:
        return "P-EAGLE, " + super().shape_line(dc)

    def shape_check(self, cfg: RunConfig) -> Verdict:
        verdict = super().shape_check(cfg)
        if verdict.level == "fail":
            return verdict
        try:
            dc = self.drafter_config(cfg, *target_and_aux(cfg))
        except EaglekitError as err:
            return Verdict("fail", err.message, err.remedy or "fix train.draft")
        detail = f"{verdict.detail}; slot token {dc.mask_token_id}, {cfg.train.ttt.steps} parallel depths trained"
        k = cfg.export.num_speculative_tokens
        if k > cfg.train.ttt.steps:
            return Verdict(
                "warn",
                detail + f"; export.num_speculative_tokens {k} serves {k - cfg.train.ttt.steps} untrained slots",
                f"set train.ttt.steps to at least {k} (each trains one parallel slot)",
            )
        return Verdict(verdict.level, detail, verdict.remedy)

    def target_advice(self, cfg: RunConfig, hf: Any, detail: str) -> Verdict | None:
        return None  # asked for by name: no other family to suggest

    def reads_folder(self, folder: Path) -> bool:
        return peagle_checkpoint.is_peagle_folder(folder)

    def finetune_check(self, cfg: RunConfig, folder: Path, path: str) -> Verdict:
        try:
            drafter, _ = peagle_checkpoint.load_drafter(folder)
        except EaglekitError as err:
            return Verdict("fail", f"{path}: {err.message}", err.remedy or "check the drafter folder")
        hf, aux = target_and_aux(cfg)
        problems = self.fit_problems(drafter, hf, aux)
        if problems:
            return Verdict(
                "fail",
                f"{path} does not fit the target {cfg.target.model}: " + "; ".join(problems),
                "finetune a drafter made for this target, or train a new one (remove train.init_from)",
            )
        return Verdict("ok", f"{path} fits the target (P-EAGLE drafter, slot token {drafter.config.mask_token_id})")

    # ---- training
    def build(self, cfg, hf, d2t, t2d, embed, head, aux) -> Built:
        """Fresh: EAGLE-3's drafter of the same settings with the slots added. train.init_from: a P-EAGLE folder,
        its own vocabulary kept unless train.remap_vocab."""
        if not cfg.train.init_from:
            base, fresh = build_drafter(cfg, hf, d2t, t2d, embed, head, aux, self.draft_settings(cfg))
            drafter = as_parallel(base, self.mask_token(cfg, base.config.vocab_size))
            fresh["slot_token"] = drafter.config.mask_token_id
            return Built(drafter, drafter.t2d.cpu(), fresh)
        loaded, _ = peagle_checkpoint.load_drafter(drafter_folder(cfg.train.init_from))
        drafter = loaded.float()
        notes: dict[str, Any] = {"draft_vocab": "init_from checkpoint"}
        has_rows = True
        if cfg.train.remap_vocab:
            remapped, new_rows = remap_vocab(drafter, d2t, t2d, head if cfg.train.init_lm_head_from_target else None)
            drafter = as_parallel(remapped, drafter.config.mask_token_id, drafter.mask_hidden)
            notes = {"draft_vocab": "vocab stage (remapped)", "new_lm_head_rows": new_rows}
            has_rows = new_rows == 0 or (
                cfg.train.init_lm_head_from_target and head.shape[1] == drafter.config.hidden_size
            )
        say(f"train: finetuning the P-EAGLE drafter {cfg.train.init_from}")
        take_target_embedding(drafter, embed)
        notes["lm_head"] = freeze_head(drafter, cfg, has_rows)
        return Built(drafter, drafter.t2d.cpu(), notes)

    def save_checkpoint(self, dc: Any, state: dict[str, torch.Tensor], out: Path) -> None:
        cpu = PEagleDrafter(dc)
        cpu.load_state_dict(state)
        peagle_checkpoint.save_legacy(cpu, out)

    # ---- decoding
    def load_checkpoint(self, cfg: RunConfig, path: Path, aux: list[int]) -> tuple[PEagleDrafter, CheckpointInfo]:
        return peagle_checkpoint.load_drafter(path)

    def proposer(self, drafter: Any, aux: list[int] | None) -> Any:
        return ParallelProposer(drafter, aux)

    # ---- export
    def planned_configs(self, dc: Any, forms: list[str], k: int) -> dict[str, dict]:
        return {
            form: peagle_checkpoint.speculators_config(dc, None, None, k)
            if form == "speculators"
            else peagle_checkpoint.legacy_config(dc)
            for form in forms
        }

    def vllm_options(self, form: str) -> dict[str, Any]:
        """The plain form needs parallel_drafting said (nothing in its config.json turns it on); the speculators
        form says it itself (speculators_model_type peagle)."""
        return {} if form == "speculators" else {"parallel_drafting": True}

    def sglang_check(self, cfg: RunConfig, formats: list[str]) -> Verdict:
        return Verdict("ok", f"{NO_SGLANG}: no SGLang command is written")

    def write(self, ctx: StageContext, load: LoadChecked, requested: list[str]) -> Written:
        return write_peagle(self, ctx, load, requested)

    # ---- verify
    def read_config(self, folder: Path) -> PEagleConfig:
        return peagle_checkpoint.read_config(folder)[1]

    def diagnose(self, served: ServedDrafter) -> list[dict]:
        return diagnose(served)


def as_parallel(drafter: Any, mask_token_id: int, mask_hidden: torch.Tensor | None = None) -> PEagleDrafter:
    """An EAGLE-3 drafter's weights (and their trainability) in a P-EAGLE drafter with slot token ``mask_token_id``;
    ``mask_hidden`` a P-EAGLE drafter's, else a fresh one (drawn from the global RNG, seeded by the loop)."""
    out = PEagleDrafter(PEagleConfig(**dataclasses.asdict(drafter.config), mask_token_id=int(mask_token_id)))
    out = out.to(drafter.fc.weight.dtype)
    missing = out.load_state_dict(drafter.state_dict(), strict=False).missing_keys
    assert missing == ["mask_hidden"], missing
    if mask_hidden is not None:
        with torch.no_grad():
            out.mask_hidden.copy_(mask_hidden)
    for (name, param), (_, source) in zip(out.named_parameters(), drafter.named_parameters(), strict=False):
        if name != "mask_hidden":
            param.requires_grad_(source.requires_grad)
    return out


# ------------------------------------------------------------------------------------------------ export


def serve_commands(cfg: RunConfig, family: PEagleFamily, dirs: dict[str, Path]) -> list[tuple[str, str]]:
    k = cfg.export.num_speculative_tokens
    target = shlex.quote(verifier_id(cfg))
    out = []
    if "eagle3" in dirs:
        keys = {"method": "eagle3", "model": str(dirs["eagle3"].resolve()), "num_speculative_tokens": k}
        spec = json.dumps(keys | family.vllm_options("eagle3"), separators=(",", ":"))
        out.append(
            (
                "vLLM, plain form (all K drafts in one pass)",
                f"vllm serve {target} --speculative-config {shlex.quote(spec)}",
            )
        )
    if "speculators" in dirs:
        d = shlex.quote(str(dirs["speculators"].resolve()))
        out.append(
            (
                "vLLM, speculators form (speculators_model_type peagle; the target comes from its config)",
                f"vllm serve {d}",
            )
        )
    return out


@torch.no_grad()
def same_drafts(source: PEagleDrafter, written_dir: Path) -> None:
    """Load ``written_dir`` back and require the source drafter's logits, bit for bit, at real and slot positions."""
    loaded, info = peagle_checkpoint.load_drafter(written_dir)
    if info.missing_embeddings:
        loaded.embed_tokens.weight.copy_(source.embed_tokens.weight.to(loaded.embed_tokens.weight.dtype))
    g = torch.Generator().manual_seed(0)
    c = source.config
    ids = torch.randint(0, c.vocab_size, (1, 8), generator=g)
    aux = torch.randn(1, 8, 3 * c.target_hidden_size, generator=g).to(source.fc.weight.dtype)

    def logits(d: PEagleDrafter) -> torch.Tensor:
        hidden = torch.cat([d.fuse(aux.to(d.fc.weight.dtype)), d.slot_feature(4)[None]], dim=1)
        return d(torch.cat([ids[0], d.slot_ids(4, ids.device)])[None], hidden, torch.arange(12)[None])[0]

    want, got = logits(source), logits(loaded)
    if got.dtype != want.dtype or not torch.equal(got, want):
        raise EaglekitError(
            f"{written_dir}: loaded back, the drafter's logits differ from the source checkpoint's "
            f"(max abs difference {(got.float() - want.float()).abs().max().item():g})",
            "this is a bug in the exporter; keep the source checkpoint and report it",
        )


def write_peagle(family: PEagleFamily, ctx: StageContext, load: LoadChecked, requested: list[str]) -> Written:
    """Both forms, each checked key by key and logit by logit (slots included), and the vLLM commands."""
    cfg, xc = ctx.cfg, ctx.cfg.export
    drafter, info, hf, _ = load(cfg)
    problems = serving_problems(drafter.config, hf)
    if problems:
        raise EaglekitError(
            f"drafter {info.path} does not serve like the target {cfg.target.model}: " + "; ".join(problems),
            "retrain the drafter with this target's config (its RoPE settings are copied at train time)",
        )
    formats, warnings = forms_to_write(family, requested)
    warnings += export_check(cfg, family.planned_configs(drafter.config, formats, xc.num_speculative_tokens))
    warnings.append(f"no SGLang command: {NO_SGLANG}")
    trained = int(cfg.train.ttt.steps)
    if xc.num_speculative_tokens > trained:
        warnings.append(
            f"export.num_speculative_tokens {xc.num_speculative_tokens} is more than the {trained} parallel slots "
            "trained (train.ttt.steps): the slots past them draft untrained"
        )
    verifier_warning = local_verifier_warning(cfg) if "speculators" in formats else None
    if verifier_warning:
        warnings.append(verifier_warning)
    if info.missing_embeddings and xc.include_embeddings:
        embed, _ = embedding_and_head(cfg.target.model, cfg.target.trust_remote_code)
        drafter.embed_tokens.weight.data.copy_(embed.to(drafter.embed_tokens.weight.dtype))
    drafter.eval()
    tokenizer = load_tokenizer(cfg.target.model, cfg.target.chat_template, cfg.target.trust_remote_code)
    dirs = write_forms(ctx, drafter, hf, tokenizer, formats, warnings, peagle_checkpoint, same_drafts)
    c = drafter.config
    return Written(
        drafter,
        info,
        dirs,
        serve_commands(cfg, family, dirs),
        warnings,
        title="P-EAGLE (parallel EAGLE-3) drafter",
        drafter_line=(
            f"{decoder_layers(c)} ({describe_layer(family, c)}) drafting all K tokens in one pass, slot token "
            f"{c.mask_token_id}, {trained} parallel slots trained, hidden {c.hidden_size}, draft vocab "
            f"{c.draft_vocab_size} of {c.vocab_size}, aux hidden states {c.aux_layer_ids} (HF hidden_states "
            f"indices), max_position_embeddings {c.max_position_embeddings}, rope_theta {c.rope_theta:g}"
            + (f", rope_scaling {c.rope_scaling}" if c.rope_scaling else "")
        ),
        holds={
            "eagle3": family.card_form,
            "speculators": "speculators config (`speculators_model_type: peagle`, `mask_token_id`), `layers.0.` keys "
            "and mask_hidden",
        },
    )


PEAGLE = one_object(PEagleFamily())
