"""What a decode loop against the target needs: the checked drafter and the evaluation prompts.

Shared by evaluate and verify (and export, which ships the same drafter), so that every stage that decodes
uses the same drafter, the same prompts and the same tokenization as prepare used for the training data.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from eaglekit.config import RunConfig
from eaglekit.data.chat import end_of_turn_token_ids, load_tokenizer, render_sample
from eaglekit.data.prompts import load_prompts
from eaglekit.data.responses import RESPONSES, read_responses
from eaglekit.data.split import is_held_out
from eaglekit.drafters.family import DrafterFamily
from eaglekit.drafters.registry import family_named, family_of_folder
from eaglekit.errors import EaglekitError, UsageError
from eaglekit.model.checkpoint_files import CheckpointInfo
from eaglekit.model.hub import cached_drafter, is_hub_id
from eaglekit.model.run_shapes import target_and_aux
from eaglekit.model.target import decoder_parts
from eaglekit.progress import console
from eaglekit.training.checkpoint_integrity import refuse_damaged_drafter

SMALL_MODEL_PARAMETERS = 50_000_000


def checkpoint_path(cfg: RunConfig) -> Path:
    """The drafter this run evaluates and exports."""
    return Path(cfg.evaluate.checkpoint) if cfg.evaluate.checkpoint else cfg.run_path / "train" / "checkpoints" / "best"


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
    drafter, info = family.load_checkpoint(cfg, path, aux)
    problems = family.fit_problems(drafter, hf, aux)
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
    drafter, info = family.load_checkpoint(cfg, Path(path), aux)
    problems = family.fit_problems(drafter, hf, aux)
    if problems:
        raise EaglekitError(
            f"train.init_from {path} does not fit the target: " + "; ".join(problems),
            "point train.init_from at the drafter this run finetuned",
        )
    return drafter, info


def eval_prompts(cfg: RunConfig, n: int | None = None) -> list[tuple[str, list[dict]]]:
    """(id, messages) of up to ``n`` (default ``evaluate.num_samples``) prompts: ``evaluate.prompts`` or the
    run's held-out split."""
    n = n or cfg.evaluate.num_samples
    if cfg.evaluate.prompts:
        records = load_prompts(cfg.evaluate.prompts, max_samples=n, on_bad_row=cfg.data.on_bad_row).records
        return [(r.id, r.messages) for r in records]
    return heldout_prompts(cfg, n)


def heldout_prompts(cfg: RunConfig, n: int | None = None) -> list[tuple[str, list[dict]]]:
    """(id, messages) of up to ``n`` (default ``evaluate.num_samples``) prompts of the held-out split of
    generate/responses.jsonl."""
    n = n or cfg.evaluate.num_samples
    path = cfg.run_path / "generate" / RESPONSES
    out = []
    if path.exists():
        for row in read_responses(path):
            if is_held_out(row["id"], cfg.data.eval_fraction):
                out.append((row["id"], row["messages"]))
                if len(out) == n:
                    break
    if not out:
        raise UsageError(
            f"{path} has no held-out sample (data.eval_fraction = {cfg.data.eval_fraction})",
            "raise data.eval_fraction (and rerun from generate), or set evaluate.prompts to a prompts file",
        )
    return out


def prompt_ids(tokenizer, messages: list[dict], template_kwargs: dict | None) -> list[int]:
    """The generation prompt's token ids, rendered and tokenized exactly as prepare did for the training data."""
    sample = render_sample(tokenizer, messages, None, "", template_kwargs)
    return sample.input_ids[: sample.prompt_tokens]


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@contextlib.contextmanager
def decode_threads(model):
    """One intra-op thread for batch-1 decoding of a small model on the CPU.

    Its matrices are too small to split: extra threads only add synchronisation, which on a machine
    shared with other work made the tiny target's evaluation 16 times slower (373 s against 24 s).
    """
    small = sum(p.numel() for p in model.parameters()) < SMALL_MODEL_PARAMETERS
    threads = torch.get_num_threads()
    if small and next(model.parameters()).device.type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


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


def tokenize_prompts(
    cfg: RunConfig, tokenizer, hf, source: list[tuple[str, list[dict]]], max_new_tokens: int, stage: str = "evaluate"
) -> tuple[list[tuple[str, list[int]]], int]:
    """(id, prompt token ids) of the prompts that leave room for ``max_new_tokens``, and how many did not."""
    template_kwargs = cfg.generate.extra_body.get("chat_template_kwargs") or None  # as the target was served
    room = int(hf.max_position_embeddings) - max_new_tokens
    prompts: list[tuple[str, list[int]]] = []
    too_long: list[tuple[str, list[int]]] = []
    for pid, messages in source:
        ids = prompt_ids(tokenizer, messages, template_kwargs)
        (prompts if len(ids) <= room else too_long).append((pid, ids))
    if too_long:
        console.print(
            f"[yellow]{stage}: {len(too_long)} prompts skipped: longer than max_position_embeddings "
            f"{hf.max_position_embeddings} - max_new_tokens {max_new_tokens}[/]"
        )
    if not prompts:
        raise UsageError(
            f"no evaluation prompt fits in {room} tokens", f"lower {stage}.max_new_tokens or use shorter prompts"
        )
    return prompts, len(too_long)


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
    return drafter_family(cfg).written_forms(list(dict.fromkeys(cfg.export.formats)))
