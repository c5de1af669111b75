"""The drafter a run evaluates, exports and verifies, checked: its family found by the registry, loaded for the
target, refused by name when it does not fit or holds non-finite weights; and the inputs of a decode loop with it
(the drafter on the target's device, the prompts of ``speculative/inputs.py``).

Shared by evaluate and verify (and export, which ships the same drafter), so that every stage that decodes uses the
same drafter.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from eaglekit.config import RunConfig
from eaglekit.data.chat import end_of_turn_token_ids, load_tokenizer
from eaglekit.drafters.family import DrafterFamily
from eaglekit.drafters.paths import checkpoint_path as checkpoint_path
from eaglekit.drafters.registry import family_named, family_of_folder
from eaglekit.errors import EaglekitError
from eaglekit.hub import cached_drafter, is_hub_id
from eaglekit.model.checkpoint_files import CheckpointInfo
from eaglekit.model.run_shapes import target_and_aux
from eaglekit.model.target import decoder_parts
from eaglekit.speculative.inputs import eval_prompts, tokenize_prompts
from eaglekit.training.checkpoint_integrity import refuse_damaged_drafter


def load_checked_drafter(cfg: RunConfig):
    """(drafter, checkpoint info, target HF config, aux layer ids), or an EaglekitError naming what does not fit."""
    path = checkpoint_path(cfg)
    if not path.exists():
        remedy = (
            "set evaluate.checkpoint to a drafter folder"
            if cfg.evaluate.checkpoint
            else "train it: `eaglekit run CONFIG --until train` (it writes train/checkpoints/best)"
        )
        raise EaglekitError(f"drafter checkpoint {path} does not exist", remedy)
    refuse_damaged_drafter(path)  # checkpoint integrity: its files are the bytes written
    hf, aux = target_and_aux(cfg)
    family = family_of_folder(path) or family_named(None)  # none of theirs: the default's loader says why
    drafter, info = family.reading.load_checkpoint(cfg, path, aux)
    problems = family.reading.fit_problems(drafter, hf, aux)
    if problems:
        raise EaglekitError(
            f"drafter {path} does not fit the target {cfg.target.model}: " + "; ".join(problems),
            "evaluate a drafter trained for this target (evaluate.checkpoint), or retrain",
        )
    refuse_non_finite(drafter, path)
    return drafter, info, hf, aux


def refuse_non_finite(drafter: torch.nn.Module, path: Path) -> None:
    """A checkpoint with NaN or Inf weights drafts garbage and would be measured and shipped as such: refused,
    naming each such tensor and how many of its values are not finite."""
    bad = [
        (name, int((~torch.isfinite(t)).sum()), t.numel())
        for name, t in drafter.state_dict().items()
        if t.is_floating_point() and not bool(torch.isfinite(t).all())
    ]
    if not bad:
        return
    listed = ", ".join(f"{name} ({n:,} of {total:,} values)" for name, n, total in bad[:5])
    more = f" and {len(bad) - 5} more tensors" if len(bad) > 5 else ""
    raise EaglekitError(
        f"drafter {path} holds non-finite weights (NaN or Inf): {listed}{more}",
        "use a checkpoint from before training diverged (evaluate.checkpoint: a train/checkpoints/step-N folder), "
        "or retrain with a lower train.lr",
    )


def load_starting_drafter(cfg: RunConfig, hf, aux):
    """The drafter ``train.init_from`` names, as it was before finetuning (None when training started fresh)."""
    path = cfg.train.init_from
    if not path:
        return None
    if not Path(path).exists():
        raise EaglekitError(
            f"train.init_from {path} does not exist (evaluate measures the finetune against it)",
            "restore that drafter folder, or remove train.init_from",
        )
    family = family_of_folder(path) or family_named(None)
    drafter, info = family.reading.load_checkpoint(cfg, Path(path), aux)
    problems = family.reading.fit_problems(drafter, hf, aux)
    if problems:
        raise EaglekitError(
            f"train.init_from {path} does not fit the target: " + "; ".join(problems),
            "point train.init_from at the drafter this run finetuned",
        )
    return drafter, info


@dataclass
class DecodingInputs:
    """What a decode loop against the target needs: the checked drafter (on the target's device and dtype),
    its aux layers, the stop ids, and the prompts' token ids."""

    drafter: Any  # its family's model: drafters.registry.proposer_for picks the proposer
    info: CheckpointInfo
    aux: list[int]
    stop_ids: set[int]
    prompts: list[tuple[str, list[int]]]  # (id, prompt token ids)
    skipped_too_long: int
    dtype: torch.dtype
    hf: object = None  # the target's HF config
    tokenizer: object = None  # the target's tokenizer, as prepare used it


def on_target(drafter, info, target, device: torch.device):
    """The drafter on the target's device, in its dtype (as in vLLM and SGLang), with the target's embedding where
    the checkpoint left it out."""
    dtype = next(target.parameters()).dtype
    drafter = drafter.to(device, dtype)
    if info.missing_embeddings:
        embedding = cast(torch.nn.Embedding, decoder_parts(target)[0].embed_tokens)
        drafter.embed_tokens.weight.data.copy_(embedding.weight.to(device, dtype))
    return drafter


def decoding_inputs(
    cfg: RunConfig,
    target,
    device: torch.device,
    max_new_tokens: int,
    num_samples: int | None = None,
    stage: str = "evaluate",
) -> DecodingInputs:
    """The drafter and the evaluation prompts, tokenized exactly as prepare did and as an engine is sent them.

    Shared by evaluate and verify, so that both decode the same prompts with the same drafter.
    """
    drafter, info, hf, aux = load_checked_drafter(cfg)
    drafter = on_target(drafter, info, target, device)
    tokenizer = load_tokenizer(cfg.target.model, cfg.target.chat_template, cfg.target.trust_remote_code)
    prompts, skipped = tokenize_prompts(cfg, tokenizer, hf, eval_prompts(cfg, num_samples), max_new_tokens, stage)
    return DecodingInputs(
        drafter,
        info,
        aux,
        end_of_turn_token_ids(tokenizer),
        prompts,
        skipped,
        next(target.parameters()).dtype,
        hf,
        tokenizer,
    )


def drafter_family(cfg: RunConfig) -> DrafterFamily:
    """The family of the drafter evaluate and export read: the trained checkpoint's when it exists, else
    train.init_from's (a folder, or a hub id already in the cache), else train.draft.architecture's. Decides the
    forms export writes before the drafter is loaded."""
    folders: list[Path | None] = [checkpoint_path(cfg)]
    init_from = cfg.train.init_from
    if init_from:
        folders.append(cached_drafter(init_from) if is_hub_id(init_from) else Path(init_from))
    return next(filter(None, map(family_of_folder, folders)), None) or family_named(cfg.train.draft.architecture)


def written_forms(cfg: RunConfig) -> list[str]:
    """The forms export writes with this config (verify serves these by default)."""
    return drafter_family(cfg).engine.written_forms(list(dict.fromkeys(cfg.export.formats)))
