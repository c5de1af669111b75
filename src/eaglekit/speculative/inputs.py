"""The prompts a decode loop against the target is given: the evaluation prompts (``evaluate.prompts`` or the run's
held-out split), tokenized exactly as prepare tokenized the training data; the checked drafter they are decoded with
is ``drafters/checked.py``'s.

Shared by evaluate and verify, so that every stage that decodes uses the same prompts and the same tokenization as
prepare used for the training data.
"""

from __future__ import annotations

import contextlib

import torch

from eaglekit.config import RunConfig
from eaglekit.data.chat import render_sample
from eaglekit.data.prompts import load_prompts
from eaglekit.data.responses import RESPONSES, read_responses
from eaglekit.data.split import is_held_out
from eaglekit.errors import UsageError
from eaglekit.progress import console

SMALL_MODEL_PARAMETERS = 50_000_000


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
