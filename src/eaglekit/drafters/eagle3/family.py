"""The EAGLE-3 families: one decoder layer fed the target's fused aux states, drafting a chain over a draft
vocabulary, trained with training-time test. Llama attention (``drafters/eagle3_llama.py``) and multi-head latent
attention (``drafters/eagle3_mla.py``) differ only in the layer; what they share is here.

Its parts: the model and its config (``model/eagle3.py``), its forms and their loader (``model/eagle3_checkpoint.py``:
the plain form vLLM and SGLang load, and the speculators form), the objective (``training/objective.py``,
``training/ttt.py``), the first drafter of a run (``training/init.py``), the proposer (``speculative/decode.py``).
"""

from __future__ import annotations

import json
import shlex
from math import prod
from pathlib import Path
from typing import Any

import torch

from eaglekit import atomic
from eaglekit.config import Eagle3Draft, RunConfig, TrainConfig
from eaglekit.contract import StageContext
from eaglekit.data.chat import load_tokenizer
from eaglekit.drafters.diagnosis import ServedDrafter
from eaglekit.drafters.eagle3 import checkpoint as eagle3_checkpoint
from eaglekit.drafters.eagle3 import diagnosis as eagle3_diagnosis
from eaglekit.drafters.eagle3 import sglang_form as eagle3_sglang
from eaglekit.drafters.eagle3.fused import compile_drafter, step_kernels
from eaglekit.drafters.eagle3.init import build_drafter
from eaglekit.drafters.eagle3.memory import step_memory
from eaglekit.drafters.eagle3.model import FLAGS, DrafterConfig, Eagle3Drafter
from eaglekit.drafters.eagle3.objective import TTT
from eaglekit.drafters.eagle3.proposer import EagleProposer
from eaglekit.drafters.family import LoadChecked, Verdict, Written, verifier_id
from eaglekit.errors import EaglekitError
from eaglekit.model.checkpoint_files import CheckpointInfo
from eaglekit.model.run_shapes import target_and_aux
from eaglekit.model.target import embedding_and_head, rope_from_config, text_config
from eaglekit.progress import console
from eaglekit.resolved import ResolvedRun
from eaglekit.serving.engine_features import export_check
from eaglekit.training.context_parallel import ContextGroup
from eaglekit.training.memory import StepMemory
from eaglekit.training.objective import Built, Objective


class Eagle3Family:
    """What the Llama and MLA drafters share; each subclass names its layer."""

    name: str
    forms: tuple[str, ...]
    draft_model: type[Eagle3Draft]
    card_form: str  # what export/eagle3/ holds, for the model card
    drafter_class = Eagle3Drafter

    @property
    def windowed(self) -> bool:
        return "sliding_window" in self.draft_model.model_fields  # the Llama layer's, not MLA's

    vllm_cpu_refusal = None

    # ---- the drafter a fresh run builds
    def draft_settings(self, cfg: RunConfig) -> dict[str, Any]:
        """``train.draft`` as a fresh drafter of this family is built from it (its window as auto resolves it)."""
        return cfg.train.draft.model_dump() | {"sliding_window": ResolvedRun(cfg).window.window}

    def drafter_config(self, cfg: RunConfig, hf: Any, aux: list[int]) -> DrafterConfig:
        return DrafterConfig.from_target_config(hf, cfg.vocab.draft_vocab_size, aux, **self.draft_settings(cfg))

    def parameter_counts(self, dc: DrafterConfig) -> tuple[int, int]:
        """Everything but the frozen [V, H] embedding trains."""
        weights = {
            k: prod(shape) for k, (shape, dtype) in eagle3_checkpoint.expected_state(dc).items() if dtype is None
        }
        total = sum(weights.values())
        return total, total - weights["embed_tokens.weight"]

    def step_memory(
        self, cfg: RunConfig, tokens: int, context_parallel: int = 1
    ) -> tuple[StepMemory, StepMemory] | None:
        dc = self.drafter_config(cfg, *target_and_aux(cfg))
        total, trainable = self.parameter_counts(dc)
        if cfg.train.freeze_lm_head:  # the draft head keeps its rows: no gradient, no AdamW moments
            trainable -= dc.draft_vocab_size * dc.hidden_size
        return tuple(  # type: ignore[return-value]
            step_memory(
                dc,
                tokens,
                cfg.train.ttt.steps,
                trainable=trainable,
                frozen=total - trainable,
                checkpoint=c,
                context_parallel=context_parallel,
                loss=cfg.train.ttt.loss,
            )
            for c in (False, True)
        )

    # ---- pre-flight
    def shape_line(self, dc: DrafterConfig) -> str:
        """Its attention's shape in words."""
        raise NotImplementedError

    def layer_line(self, dc: DrafterConfig) -> str:
        """Its decoder layer in words, for the model card."""
        raise NotImplementedError

    def target_advice(self, cfg: RunConfig, hf: Any, detail: str) -> Verdict | None:
        """A better family for this target, when there is one."""
        return None

    def shape_check(self, cfg: RunConfig) -> Verdict:
        """The drafter this run trains, derived from the target and train.draft."""
        try:
            hf, aux = target_and_aux(cfg)
            # a draft vocab larger than the target's is the vocab stage's failure: not named twice
            draft_vocab = min(cfg.vocab.draft_vocab_size, int(getattr(text_config(hf), "vocab_size", None) or 1 << 62))
            dc = DrafterConfig.from_target_config(hf, draft_vocab, aux, **self.draft_settings(cfg))
        except EaglekitError as err:
            return Verdict("fail", err.message, err.remedy or "fix train.draft")
        _, trainable = self.parameter_counts(dc)
        flags = [name for name in FLAGS if getattr(dc, name)]
        detail = f"{self.shape_line(dc)}, hidden {dc.hidden_size}, {trainable / 1e6:.2f}M trainable" + (
            f", {', '.join(flags)}" if flags else ""
        )
        problems = eagle3_checkpoint.serving_problems(dc)
        if problems:
            return Verdict("fail", detail + ": " + "; ".join(problems), "set train.draft.q_lora_rank")
        advice = self.target_advice(cfg, hf, detail)
        if advice:
            return advice
        ignored = eagle3_checkpoint.sglang_ignores(dc)
        if ignored:
            return Verdict(
                "warn",
                detail + f"; SGLang does not read {', '.join(ignored)} (vLLM does)",
                "serve this drafter with vLLM, or drop those flags to serve it with SGLang too",
            )
        return Verdict("ok", detail)

    def reads_folder(self, folder: Path) -> bool:
        try:
            return eagle3_checkpoint.read_config(Path(folder))[1].architecture == self.name
        except EaglekitError:
            return False

    def finetune_check(self, cfg: RunConfig, folder: Path, path: str) -> Verdict:
        """A drafter to finetune must fit the target: hidden sizes, vocab, aux layers, heads, positions, tokenizer."""
        try:
            drafter, _info = eagle3_checkpoint.load_drafter(folder)
            hf, aux = target_and_aux(cfg)
            problems = eagle3_checkpoint.check_compatible(
                drafter.config, hf, aux, tokenizer_vocab_size=_tokenizer_size(cfg)
            )
        except EaglekitError as err:
            return Verdict("fail", f"{path}: {err.message}", err.remedy or "check the drafter folder")
        if problems:
            return Verdict(
                "fail",
                f"{path} does not fit the target {cfg.target.model}: " + "; ".join(problems),
                "finetune a drafter made for this target, or train a new one (remove train.init_from)",
            )
        vocab = "remapped onto this run's draft vocab" if cfg.train.remap_vocab else "its own draft vocab kept"
        where = f" (cached in {folder})" if str(folder) != path else ""
        detail = (
            f"{path}{where} fits the target ({drafter.config.architecture} drafter, "
            f"{drafter.config.draft_vocab_size} draft tokens, {vocab})"
        )
        asked = getattr(cfg.train.draft, "num_layers", None)
        if asked is not None and asked != drafter.config.num_layers:  # the finetune keeps the checkpoint's layers
            return Verdict(
                "warn",
                detail + f"; it has {drafter.config.num_layers} decoder layer(s), train.draft.num_layers {asked} "
                "does not apply to a finetune",
                "remove train.draft.num_layers, or train a new drafter with it (remove train.init_from)",
            )
        return Verdict("ok", detail)

    # ---- training
    def build(self, cfg, hf, d2t, t2d, embed, head, aux) -> Built:
        drafter, notes = build_drafter(cfg, hf, d2t, t2d, embed, head, aux, self.draft_settings(cfg))
        return Built(drafter, drafter.t2d.cpu(), notes)

    def objective(
        self, drafter: Any, tc: TrainConfig, device: torch.device, context: ContextGroup | None = None
    ) -> Objective:
        """Training-time test over ``train.ttt.steps`` (the GPU's fused kernels where they apply)."""
        settings = tc.ttt
        kernels = step_kernels(
            settings.attention, settings.head_loss, device, settings.activation_checkpointing, context
        )
        if settings.compile:
            compile_drafter(drafter)
        ttt = TTT(drafter, settings, kernels)
        return Objective(
            ttt,
            settings.steps,
            ttt.step_weights,
            kernels.describe() + (", drafter compiled" if settings.compile else ""),
            settings.steps,
            "distribution",
        )

    def save_checkpoint(self, dc: Any, state: dict[str, torch.Tensor], out: Path) -> None:
        cpu = Eagle3Drafter(dc)
        cpu.load_state_dict(state)
        eagle3_checkpoint.save_legacy(cpu, out)

    # ---- decoding
    def load_checkpoint(self, cfg: RunConfig, path: Path, aux: list[int]) -> tuple[Eagle3Drafter, CheckpointInfo]:
        return eagle3_checkpoint.load_drafter(path)

    def fit_problems(self, drafter: Any, hf: Any, aux: list[int]) -> list[str]:
        return eagle3_checkpoint.check_compatible(drafter.config, hf, aux)

    def vocab_line(self, dc: Any) -> str:
        return f"{dc.draft_vocab_size}/{dc.vocab_size}"

    def proposer(self, drafter: Any, aux: list[int] | None) -> Any:
        return EagleProposer(drafter, aux)

    # ---- export
    def written_forms(self, requested: list[str]) -> list[str]:
        return [f for f in requested if f in self.forms] or requested

    def planned_configs(self, dc: DrafterConfig, forms: list[str], k: int) -> dict[str, dict]:
        return {
            form: eagle3_checkpoint.speculators_config(dc, None, None, k)
            if form == "speculators"
            else eagle3_checkpoint.legacy_config(dc)
            for form in forms
        }

    def vllm_method(self, form: str) -> str:
        return "eagle3"

    def vllm_options(self, form: str) -> dict[str, Any]:
        return {}

    def verifier_check(self, cfg: RunConfig, formats: list[str]) -> Verdict:
        if "speculators" not in formats:
            return Verdict("ok", "speculators form not requested")
        if "speculators" not in self.forms:
            return Verdict("ok", self.no_speculators)
        warning = local_verifier_warning(cfg)
        if warning:
            return Verdict(
                "warn", warning, "set export.verifier to the target's hub id (the rest is written either way)"
            )
        return Verdict("ok", f"speculators config names {verifier_id(cfg)}")

    no_speculators = ""  # pre-flight's word when a family has no speculators form
    no_speculators_reason = ""  # and export's

    def sglang_check(self, cfg: RunConfig, formats: list[str]) -> Verdict:
        problem = sglang_aux_problem(cfg, formats)
        if problem and "speculators" not in self.forms:
            return Verdict(
                "warn",
                f"{problem}; the {self.title} drafter's only form is written for vLLM alone (it reads "
                "the top-level hidden_states indices verbatim), without an SGLang command",
                MLA_SGLANG_AUX_REMEDY,
            )
        if problem:
            return Verdict("fail", problem, SGLANG_AUX_REMEDY)
        return Verdict(
            "ok",
            "legacy form not requested"
            if "eagle3" not in formats
            else "eagle_config ids mean the trained layers in every SGLang version",
        )

    title: str

    def write(self, ctx: StageContext, load: LoadChecked, requested: list[str]) -> Written:
        return write_eagle3(self, ctx, load, requested)

    # ---- verify
    def read_config(self, folder: Path) -> DrafterConfig:
        return eagle3_checkpoint.read_config(folder)[1]

    def diagnose(self, served: ServedDrafter) -> list[dict]:
        return eagle3_diagnosis.diagnose(served)


def _tokenizer_size(cfg: RunConfig) -> int | None:
    try:
        from transformers import AutoTokenizer  # lazy: heavy (transformers)

        return len(AutoTokenizer.from_pretrained(cfg.target.model, trust_remote_code=cfg.target.trust_remote_code))
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------------------------------------ export


def local_verifier_warning(cfg: RunConfig) -> str | None:
    vid = verifier_id(cfg)
    if cfg.export.verifier or not Path(vid).exists():
        return None
    return (
        f"the speculators config names the local folder {vid} as verifier: `vllm serve DIR` works on this "
        "machine, but not for anyone you publish the drafter to; set export.verifier to the target's hub id "
        "before publishing"
    )


def forms_to_write(family: Eagle3Family, requested: list[str]) -> tuple[list[str], list[str]]:
    """(forms, warnings): a family without the speculators form writes the plain one (its ``no_speculators_reason``)."""
    if "speculators" in family.forms or "speculators" not in requested:
        return requested, []
    if requested == ["speculators"]:
        raise EaglekitError(
            f"export.formats is [speculators], but {family.no_speculators_reason}",
            "set export.formats: [eagle3] (the plain form, which vLLM and SGLang load)",
        )
    reason = family.no_speculators_reason
    return [f for f in requested if f != "speculators"], [f"speculators form not written: {reason}"]


def sglang_aux_problem(cfg: RunConfig, formats: list[str]) -> str | None:
    """Why the legacy (SGLang) form cannot carry this run's aux layers, or None."""
    aux = cfg.target.aux_layers
    if "eagle3" not in formats or aux is None or eagle3_checkpoint.sglang_aux_layer_ids(aux) is not None:
        return None
    return (
        f"target.aux_layers {list(aux)} cannot be written for SGLang: {eagle3_checkpoint.SGLANG_AUX_RULE}; only aux layers "
        f"starting at hidden_states[2] (written [1, ...]) mean the same layers in every SGLang version"
    )


SGLANG_AUX_REMEDY = (
    "for vLLM export the speculators form alone (`eaglekit export CONFIG --format speculators`: vLLM "
    "reads hidden_states indices verbatim); for SGLang train with target.aux_layers starting at 2"
)


MLA_SGLANG_AUX_REMEDY = "serve it with vLLM; for SGLang train with target.aux_layers starting at 2"


def serving_problems(drafter_cfg, hf) -> list[str]:
    """RoPE scaling must be the target's (check_compatible compares max_position_embeddings and rope_theta), and the
    engines must be able to load the drafter's layout at all."""
    problems = eagle3_checkpoint.serving_problems(drafter_cfg)
    _, scaling = rope_from_config(hf)
    if (drafter_cfg.rope_scaling or None) != (scaling or None):
        problems.append(f"rope_scaling: the drafter's is {drafter_cfg.rope_scaling}, the target's {scaling}")
    return problems


@torch.no_grad()
def same_logits(source, written_dir: Path) -> None:
    """Load ``written_dir`` back and require the source drafter's logits, bit for bit, on random inputs."""
    loaded, info = eagle3_checkpoint.load_drafter(written_dir)
    if info.missing_embeddings:  # written without embed_tokens: servers take the target's, so must we
        loaded.embed_tokens.weight.copy_(source.embed_tokens.weight.to(loaded.embed_tokens.weight.dtype))
    g = torch.Generator().manual_seed(0)
    c = source.config
    ids = torch.randint(0, c.vocab_size, (1, 12), generator=g)
    aux = torch.randn(1, 12, 3 * c.target_hidden_size, generator=g).to(source.fc.weight.dtype)
    positions = torch.arange(12)[None]
    want, _ = source(ids, source.fuse(aux), positions)
    got, _ = loaded(ids, loaded.fuse(aux.to(loaded.fc.weight.dtype)), positions)
    if got.dtype != want.dtype or not torch.equal(got, want):
        diff = (got.float() - want.float()).abs().max().item()
        raise EaglekitError(
            f"{written_dir}: loaded back, the drafter's logits differ from the source checkpoint's "
            f"(max abs difference {diff:g}, dtypes {got.dtype} vs {want.dtype})",
            "this is a bug in the exporter; keep the source checkpoint and report it",
        )


def exported_window(folder: Path) -> int | None:
    """The sliding window an exported EAGLE-3 folder's config.json asks vLLM for (None: full attention)."""
    try:
        return eagle3_checkpoint.layer_window(json.loads((folder / "config.json").read_text()))
    except (OSError, ValueError):
        return None


def serve_commands(cfg: RunConfig, dirs: dict[str, Path], sglang: bool = True) -> list[tuple[str, str]]:
    """(what, command) pairs for the written forms; ``sglang`` False when SGLang would serve the drafter wrong."""
    k = cfg.export.num_speculative_tokens
    target = shlex.quote(verifier_id(cfg))
    out = []
    if "eagle3" in dirs:
        d = str(dirs["eagle3"].resolve())
        spec = json.dumps({"method": "eagle3", "model": d, "num_speculative_tokens": k}, separators=(",", ":"))
        out.append(("vLLM, legacy form", f"vllm serve {target} --speculative-config {shlex.quote(spec)}"))
    if "eagle3" in dirs and sglang:
        # SGLang takes a drafter's window from its command line, not from the checkpoint (sglang#24664)
        window = exported_window(dirs["eagle3"])
        out.append(
            (
                "SGLang, legacy form (chain of K drafts: topk 1, K+1 draft tokens)",
                f"python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 "
                f"--speculative-draft-model-path {shlex.quote(d)} --speculative-num-steps {k} "
                f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}"
                + (f" --speculative-draft-window-size {window}" if window else ""),
            )
        )
    if "speculators" in dirs:
        d = shlex.quote(str(dirs["speculators"].resolve()))
        out.append(("vLLM, speculators form (the target comes from its config)", f"vllm serve {d}"))
    return out


def write_eagle3(family: Eagle3Family, ctx: StageContext, load: LoadChecked, requested: list[str]) -> Written:
    """The plain form and, where the family has it, the speculators form; each checked key by key and logit by
    logit; the commands serving them."""
    cfg, xc = ctx.cfg, ctx.cfg.export
    sglang_aux = sglang_aux_problem(cfg, requested)
    if sglang_aux and "speculators" in family.forms:  # the speculators form serves it on vLLM instead
        raise EaglekitError(f"export: {sglang_aux}", SGLANG_AUX_REMEDY)
    drafter, info, hf, _ = load(cfg)
    problems = serving_problems(drafter.config, hf)
    if problems:
        raise EaglekitError(
            f"drafter {info.path} does not serve like the target {cfg.target.model}: " + "; ".join(problems),
            "retrain the drafter with this target's config (its RoPE settings are copied at train time)",
        )
    formats, warnings = forms_to_write(family, requested)
    planned = family.planned_configs(drafter.config, formats, cfg.export.num_speculative_tokens)
    warnings += export_check(cfg, planned)  # refuses a feature the installed engine would drop
    ignored = eagle3_checkpoint.sglang_ignores(drafter.config)
    if ignored:
        warnings.append(
            f"no SGLang command: SGLang's llama_eagle3.py / kimi_k25_eagle3.py do not read "
            f"{', '.join(ignored)} and would serve this drafter as if they were off; serve it with vLLM"
        )
    if sglang_aux:  # an MLA drafter: its plain form goes without eagle_config, for vLLM alone
        warnings.append(f"no SGLang command: {sglang_aux}; vLLM reads the top-level hidden_states indices verbatim")
    verifier_warning = local_verifier_warning(cfg) if "speculators" in formats else None
    if verifier_warning:
        warnings.append(verifier_warning)
    if info.missing_embeddings and xc.include_embeddings:
        embed, _ = embedding_and_head(cfg.target.model, cfg.target.trust_remote_code)
        drafter.embed_tokens.weight.data.copy_(embed.to(drafter.embed_tokens.weight.dtype))
    drafter.eval()
    tokenizer = load_tokenizer(cfg.target.model, cfg.target.chat_template, cfg.target.trust_remote_code)
    dirs = write_forms(ctx, drafter, hf, tokenizer, formats, warnings, sglang=not (ignored or sglang_aux))
    c = drafter.config
    return Written(
        drafter,
        info,
        dirs,
        serve_commands(cfg, dirs, sglang=not (ignored or sglang_aux)),
        warnings,
        title="EAGLE-3 drafter",
        drafter_line=(
            f"{decoder_layers(c)} ({describe_layer(family, c)}), hidden {c.hidden_size}, draft vocab "
            f"{c.draft_vocab_size} of {c.vocab_size}, aux hidden states "
            f"{c.aux_layer_ids or 'default [2, N//2, N-3]'} (HF hidden_states indices), max_position_embeddings "
            f"{c.max_position_embeddings}, rope_theta {c.rope_theta:g}"
            + (f", rope_scaling {c.rope_scaling}" if c.rope_scaling else "")
        ),
        holds={
            "eagle3": family.card_form,
            "speculators": "speculators config (`speculators_model_type: eagle3`), `layers.0.` keys",
        },
    )


def write_forms(
    ctx: StageContext,
    drafter,
    hf,
    tokenizer,
    formats: list[str],
    warnings: list[str],
    checkpoint: Any = eagle3_checkpoint,
    read_back: Any = None,
    sglang: bool = False,
) -> dict[str, Path]:
    """Each form in its folder, swapped in whole once its keys, shapes and logits are checked; a form's warning
    is added to ``warnings``. ``checkpoint`` writes the two forms (``save_legacy``, ``save_speculators``) and
    ``read_back(drafter, folder)`` checks what it wrote (EAGLE-3's: ``same_logits``); a drafter built on EAGLE-3's
    layer (P-EAGLE) passes its own. ``sglang``: the plain form is also checked as SGLang reads it
    (``sglang_form.py``), since export prints an SGLang command for it."""
    read_back = read_back or same_logits
    xc, verifier = ctx.cfg.export, verifier_id(ctx.cfg)
    dirs: dict[str, Path] = {}
    for form in formats:
        dest = ctx.dir / form
        with atomic.atomic_dir(dest, digests=True) as tmp:  # verify and evaluate check the bytes served
            # save_* write atomically themselves: into our (empty) temp folder, which is swapped in whole below
            if form == "eagle3":
                checkpoint.save_legacy(drafter, tmp, include_embeddings=xc.include_embeddings)
            else:
                warning = checkpoint.save_speculators(
                    drafter,
                    tmp,
                    verifier,
                    getattr(hf, "architectures", None),
                    xc.num_speculative_tokens,
                    include_embeddings=xc.include_embeddings,
                )
                if warning:
                    warnings.append(warning.replace(str(tmp), str(dest)))
            tokenizer.save_pretrained(tmp)
            read_back(drafter, tmp)
            if form == "eagle3" and sglang:
                eagle3_sglang.check_folder(tmp)
        dirs[form] = dest
        console.print(f"export: {form} form written to {dest} (keys, shapes and logits checked)")
    return dirs


def decoder_layers(c) -> str:
    """The drafter's decoder layers in words, for the model card."""
    return "one decoder layer" if c.num_layers == 1 else f"{c.num_layers} decoder layers"


def describe_layer(family: Eagle3Family, c) -> str:
    flags = [name for name in FLAGS if getattr(c, name)]
    return family.layer_line(c) + (f"; {', '.join(flags)}" if flags else "")
