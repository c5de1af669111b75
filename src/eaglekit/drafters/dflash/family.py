"""The DFlash family: a block drafter (several Qwen3-style layers drafting a block in one non-causal pass) over the
target's whole vocabulary, with the target's embedding and head frozen in.

Its parts: the model and its config (``model/dflash.py``), its one export form, vLLM's (``model/dflash_checkpoint.py``),
the objective (``training/block.py``), the proposer (``speculative/block.py``). DSpark (``drafters/dspark.py``)
extends this family as its model extends DFlash's.
"""

from __future__ import annotations

from math import prod
from pathlib import Path
from typing import Any

import torch

from eaglekit import atomic
from eaglekit.config import DFlashDraft, RunConfig, TrainConfig
from eaglekit.contract import StageContext
from eaglekit.data.chat import load_tokenizer
from eaglekit.drafters.dflash import checkpoint as dflash_checkpoint
from eaglekit.drafters.dflash import diagnosis as block_diagnosis
from eaglekit.drafters.dflash import model as dflash
from eaglekit.drafters.dflash import sglang_form
from eaglekit.drafters.dflash.memory import block_step_memory
from eaglekit.drafters.dflash.model import DFlashConfig, DFlashDrafter
from eaglekit.drafters.dflash.objective import DEFAULT_ANCHORS, BlockObjective
from eaglekit.drafters.dflash.proposer import BlockProposer
from eaglekit.drafters.diagnosis import ServedDrafter
from eaglekit.drafters.family import LoadChecked, Verdict, Written, one_object, verifier_id
from eaglekit.errors import EaglekitError, UsageError
from eaglekit.model.checkpoint_files import CheckpointInfo
from eaglekit.model.run_shapes import target_and_aux
from eaglekit.model.target import text_config
from eaglekit.progress import console
from eaglekit.serving import engine_features
from eaglekit.serving.engine_features import export_check
from eaglekit.training.context_parallel import ContextGroup
from eaglekit.training.data import pack_length
from eaglekit.training.memory import StepMemory
from eaglekit.training.objective import Built, Objective


class DFlashFamily:
    name = "dflash"
    title = "DFlash"
    forms: tuple[str, ...] = (dflash_checkpoint.FORM,)
    exported_architecture = dflash_checkpoint.ARCHITECTURE  # its form's config.json architectures
    draft_model: type[DFlashDraft] = DFlashDraft
    drafter_class: type[DFlashDrafter] = DFlashDrafter

    @property
    def windowed(self) -> bool:
        return "sliding_window" in self.draft_model.model_fields  # a causal window over its context (model/dflash.py)

    vllm_cpu_refusal: str | None = None
    anchor_slot_drafts = False  # its block's first slot holds the verified token; the mask slots draft

    # ---- its form on disk (model/dflash_checkpoint.py)
    def expected_state(self, dc: Any) -> dict[str, tuple[int, ...]]:
        return dflash_checkpoint.expected_state(dc)

    def save_exported(self, drafter: Any, out: Path) -> None:
        dflash_checkpoint.save_dflash(drafter, out)

    def load_exported(self, path: str | Path, embed: torch.Tensor, head: torch.Tensor) -> DFlashDrafter:
        return dflash_checkpoint.load_dflash(path, embed, head)

    def load_for_target(self, cfg: RunConfig, path: str | Path) -> DFlashDrafter:
        return dflash_checkpoint.load_for_target(path, cfg.target.model, cfg.target.trust_remote_code)

    def reads_folder(self, folder: Path) -> bool:
        return dflash_checkpoint.is_dflash_checkpoint(folder)

    def save_checkpoint(self, dc: Any, state: dict[str, torch.Tensor], out: Path) -> None:
        dflash_checkpoint.save_from_state(dc, state, out)  # the form its export writes

    # ---- the drafter a fresh run builds
    def drafter_config(self, cfg: RunConfig, hf: Any, aux: list[int]) -> DFlashConfig:
        return dflash.config_for_run(cfg, hf, aux, int(text_config(hf).vocab_size))

    def parameter_counts(self, dc: DFlashConfig) -> tuple[int, int]:
        """The target's embedding and head stay frozen: everything its export holds trains."""
        trainable = sum(prod(shape) for shape in self.expected_state(dc).values())
        return trainable + 2 * dc.vocab_size * dc.hidden_size, trainable

    def step_memory(
        self, cfg: RunConfig, tokens: int, context_parallel: int = 1
    ) -> tuple[StepMemory, StepMemory] | None:
        """The block step (``training/block_memory.py``): it has no activation checkpointing, so both figures are
        the same step."""
        dc = self.drafter_config(cfg, *target_and_aux(cfg))
        total, trainable = self.parameter_counts(dc)
        length = min(tokens, pack_length(cfg))
        draft = cfg.train.draft_as(self.draft_model)
        step = block_step_memory(
            dc,
            length,
            -(-tokens // length),
            draft.max_anchors or DEFAULT_ANCHORS,
            trainable=trainable,
            frozen=total - trainable,
            context_parallel=context_parallel,
            drafter_class=self.drafter_class,
        )
        return step, step

    # ---- pre-flight
    def shape_check(self, cfg: RunConfig) -> Verdict:
        try:
            hf, aux = target_and_aux(cfg)
            dc = self.drafter_config(cfg, hf, aux)
        except EaglekitError as err:
            return Verdict("fail", err.message, err.remedy or "fix train.draft")
        detail = (
            f"{self.name}: {dc.num_hidden_layers} layers, block {dc.block_size}, mask token {dc.mask_token_id}, "
            f"heads {dc.num_attention_heads} / kv {dc.num_key_value_heads} x {dc.head_dim}{self.shape_extra(dc)}, "
            f"aux layers {aux}"
        )
        problem = mla_target_problem(hf)
        if problem:
            return Verdict(
                "warn",
                f"{detail}: {problem}",
                "serve it with SGLang (export prints its command), or train an EAGLE-3 drafter for this target "
                "(train.draft.architecture: mla, the shape published for Kimi-K2.5/K2.6), which vLLM serves too",
            )
        notes = self.serving_notes(cfg)
        if cfg.train.remap_vocab:  # the key is EAGLE-3's and P-EAGLE's: here it would be ignored without a word
            notes.append(
                f"train.remap_vocab is set, but a {self.title} drafter drafts over the target's whole vocabulary: "
                "there is no draft vocabulary to remap, and the key changes nothing"
            )
        if notes:
            remedy = "see docs/drafters.md: 'Choosing a drafter family'"
            if cfg.train.remap_vocab:
                remedy = "remove train.remap_vocab; " + remedy
            return Verdict("warn", detail + "; " + "; ".join(notes), remedy)
        return Verdict("ok", detail)

    def shape_extra(self, dc: Any) -> str:
        return ""

    def serving_notes(self, cfg: RunConfig) -> list[str]:
        """What pre-flight warns about serving this drafter (empty when nothing applies)."""
        if cfg.train.draft_as(self.draft_model).shared_k_norm:
            return []
        return [
            "train.draft.shared_k_norm is false: vLLM 0.32's CPU build would serve this drafter with other drafts "
            "(it applies layer 0's k_norm to every layer's context keys); GPU engines are not affected"
        ]

    def finetune_check(self, cfg: RunConfig, folder: Path, path: str) -> Verdict:
        try:
            drafter = self.load_for_target(cfg, folder)
            _, aux = target_and_aux(cfg)
        except EaglekitError as err:
            return Verdict("fail", f"{path}: {err.message}", err.remedy or "check the drafter folder")
        if drafter.config.aux_layer_ids != aux:
            return Verdict(
                "fail",
                f"{path} taps target layers {drafter.config.aux_layer_ids}, this run {aux}",
                f"set target.aux_layers: {drafter.config.aux_layer_ids}",
            )
        return Verdict("ok", f"{path}: {self.name} drafter, {drafter.config.num_hidden_layers} layers, fits the target")

    # ---- training
    def build(self, cfg, hf, d2t, t2d, embed, head, aux) -> Built:
        """Fresh from the target's config, or ``train.init_from`` an exported one (``export/dflash/``) re-imported
        to finetune. It drafts over the whole vocabulary: its features cover it all."""
        drafter: DFlashDrafter
        if cfg.train.init_from:
            drafter = self.load_exported(cfg.train.init_from, embed, head).float()
            if drafter.config.aux_layer_ids != list(aux):
                raise UsageError(
                    f"train.init_from {cfg.train.init_from} taps target layers {drafter.config.aux_layer_ids}, "
                    f"this run {list(aux)}",
                    f"set target.aux_layers: {drafter.config.aux_layer_ids}",
                )
            notes = {"draft_vocab": f"the target's ({self.name})", "init_from": cfg.train.init_from}
        else:
            drafter = self.drafter_class(self.drafter_config(cfg, hf, aux))
            drafter.take_target(embed, head)
            notes = {"draft_vocab": f"the target's ({self.name})", "mask_token_id": drafter.config.mask_token_id}
        return Built(drafter, torch.ones(head.shape[0], dtype=torch.bool), notes)

    def objective(
        self, drafter: Any, tc: TrainConfig, device: torch.device, context: ContextGroup | None = None
    ) -> Objective:
        """The block objective with ``train.draft``'s options (speculators' DFlash defaults where unset); its
        draft positions are weighted alike."""
        draft = tc.draft_as(self.draft_model)
        module = BlockObjective(
            drafter,
            max_anchors=draft.max_anchors or DEFAULT_ANCHORS,
            weighting=draft.position_weighting or "dpace",
            dpace_alpha=draft.dpace_alpha if draft.dpace_alpha is not None else 0.5,
            gamma=draft.decay_gamma if draft.decay_gamma is not None else 4.0,
            context=context,
        )
        return Objective(
            module, module.positions, [1.0] * module.positions, f"{self.name} block objective", module.halo, "argmax"
        )

    # ---- decoding
    def load_checkpoint(self, cfg: RunConfig, path: Path, aux: list[int]) -> tuple[DFlashDrafter, CheckpointInfo]:
        """The drafter with the target's embedding and head, refused when its taps differ."""
        drafter = self.load_for_target(cfg, path)
        if drafter.config.aux_layer_ids != list(aux):
            raise EaglekitError(
                f"drafter {path} taps target layers {drafter.config.aux_layer_ids}, this config {aux}",
                f"set target.aux_layers: {drafter.config.aux_layer_ids}, or retrain",
            )
        return drafter, CheckpointInfo(self.name, path, missing_embeddings=False, aux_layer_ids=list(aux))

    def fit_problems(self, drafter: Any, hf: Any, aux: list[int]) -> list[str]:
        return []  # its taps are checked as it loads; embedding and head are the target's

    def vocab_line(self, dc: Any) -> str:
        return f"{dc.vocab_size} (the target's)"

    def proposer(self, drafter: Any, aux: list[int] | None) -> Any:
        return BlockProposer(drafter)

    # ---- export
    def written_forms(self, requested: list[str]) -> list[str]:
        return list(self.forms)  # one form, vLLM's

    def planned_configs(self, dc: DFlashConfig, forms: list[str], k: int) -> dict[str, dict]:
        """Its one form, whatever was asked for."""
        window = dc.sliding_window
        layers = {"layer_types": ["sliding_attention"], "sliding_window": window} if window else {}
        return {self.forms[0]: {"architectures": [self.exported_architecture], **layers}}

    def vllm_method(self, form: str) -> str:
        return form  # its one form is its method

    def vllm_options(self, form: str) -> dict[str, Any]:
        return {}

    def verifier_check(self, cfg: RunConfig, formats: list[str]) -> Verdict:
        return Verdict("ok", "block drafter: its vLLM form names no verifier (vLLM is given the target)")

    def sglang_check(self, cfg: RunConfig, formats: list[str]) -> Verdict:
        return Verdict(
            "ok",
            "block drafter: SGLang captures the target layers its config names plus one "
            "(set_dflash_layers_to_capture), the layers it was trained on",
        )

    def export_warnings(self, drafter: Any) -> list[str]:
        problem = dflash_checkpoint.cpu_build_problem(drafter.state_dict(), drafter.config)
        if not problem:
            return []
        return [f"on vLLM's CPU build: {problem} (train with train.draft.shared_k_norm: true to serve it there)"]

    def write(self, ctx: StageContext, load: LoadChecked, requested: list[str]) -> Written:
        """The drafter in the form vLLM 0.32 serves, re-read and compared (one form, whatever is requested)."""
        cfg = ctx.cfg
        drafter, info, hf, _ = load(cfg)
        form = self.forms[0]
        dest = ctx.dir / form
        planned = self.planned_configs(drafter.config, [form], cfg.export.num_speculative_tokens)
        export_check(cfg, planned)  # refuses a form the installed engine would serve wrong
        with atomic.atomic_dir(dest, digests=True) as tmp:  # verify and evaluate check the bytes served
            self.save_exported(drafter, tmp)
            again = self.load_for_target(cfg, tmp)
            mine, read = drafter.state_dict(), again.state_dict()
            if mine.keys() != read.keys() or any(not torch.equal(mine[k], read[k].to(mine[k])) for k in mine):
                raise EaglekitError(f"export: {dest} does not read back as the drafter written", "report this bug")
            tokenizer = load_tokenizer(cfg.target.model, cfg.target.chat_template, cfg.target.trust_remote_code)
            tokenizer.save_pretrained(tmp)
            no_sglang = sglang_form.export_check(tmp, tokenizer.get_vocab())  # SGLang's reading, before the swap
        console.print(f"export: {form} form written to {dest} (keys, shapes and weights checked)")
        k = cfg.export.num_speculative_tokens
        warnings = []
        trained = drafter.config.block_size - drafter.first_drafting_slot
        if k > trained:
            warnings.append(
                f"export.num_speculative_tokens {k} exceeds the {trained} draft slots the drafter was trained with"
            )
        warnings += self.export_warnings(drafter)
        method = self.vllm_method(form)  # DFlash2's form is served with DFlash's method
        no_vllm = mla_target_problem(hf)
        commands = [
            (f"vLLM (method {method})", dflash_checkpoint.serve_command(verifier_id(cfg), dest, k, method=method))
        ]
        if no_vllm:
            commands, warnings = [], warnings + [f"no vLLM command: {no_vllm}"]
        config = sglang_form.read_folder(dest)[0]
        algorithm = sglang_form.ALGORITHMS[sglang_form.architecture(config)]
        if no_sglang:
            warnings.append(f"no SGLang command: {no_sglang}")
        else:
            commands.append(
                (f"SGLang {sglang_form.SGLANG_READ} (--speculative-algorithm {algorithm})",
                 sglang_form.serve_command(verifier_id(cfg), dest, config, k))
            )  # fmt: skip
        served = [f"the form vLLM 0.32 serves (`--speculative-config` method `{method}`)"] * (not no_vllm)
        served += [f"the form SGLang {sglang_form.SGLANG_READ} loads as is (`{algorithm}`)"] * (not no_sglang)
        c = drafter.config
        return Written(
            drafter,
            info,
            {form: dest},
            commands,
            warnings,
            title=f"{self.title} drafter",
            drafter_line=f"{c.num_hidden_layers} layers, block {c.block_size}, aux layers {c.aux_layer_ids}",
            holds={form: " and ".join(served) or "the form vLLM 0.32 and SGLang load, neither for this drafter"},
        )

    # ---- verify
    def read_config(self, folder: Path) -> DFlashConfig:
        return dflash_checkpoint.read_dflash_config(folder)

    def diagnose(self, served: ServedDrafter) -> list[dict]:
        try:
            trained = self.read_config(served.checkpoint)
        except EaglekitError:
            trained = None  # the drafter check says why
        return block_diagnosis.diagnose(served, trained, self.anchor_slot_drafts)


def mla_target_problem(hf_config: Any) -> str | None:
    """Why vLLM cannot serve a block drafter on this target, or None: the engine-feature table's ``mla_target`` row.
    SGLang can (sglang#29218): its DeepSeek-V2/V3 and Kimi-K2.5 targets capture the drafter's layers
    (``set_dflash_layers_to_capture``, pinned in tests/drafters/test_sglang_forms.py)."""
    if not getattr(text_config(hf_config), "kv_lora_rank", None):
        return None
    why = engine_features.target_refusal("mla_target", engine_features.VLLM, engine_features.DFLASH)
    return (
        f"the target uses multi-head latent attention (DeepSeek-V3/Kimi): {why}; "
        f"SGLang serves it (sglang#29218, read in SGLang {sglang_form.SGLANG_READ})"
    )


DFLASH = one_object(DFlashFamily())
