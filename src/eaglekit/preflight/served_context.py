"""Pre-flight of verify: the context the engine will serve, against what verify sends it and what the drafter was
made for.

vLLM serves at most ``max_model_len`` tokens a request (``--max-model-len``; without it, the target's
``max_position_embeddings``): a request whose prompt and ``max_tokens`` do not fit is answered with a 400
(``max_tokens=96 cannot be greater than max_model_len=64``) — once the engine is up, which on a real target takes
minutes. So the evaluation prompts plus ``verify.max_new_tokens`` are compared with it first (a failure, with the
figure to set); and a drafter trained on rows longer than the served context, or with a sliding window the served
context can never fill, is said (a warning): neither fails, both mean the drafter was made for another context than
the one it is served at. The served context is read from ``verify.engine_args`` for the vLLM eaglekit starts, and from
the server's own ``/v1/models`` (``max_model_len``, which vLLM and SGLang list) for ``verify.server``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import httpx

from eaglekit.contract import StageContext
from eaglekit.data.chat import load_tokenizer  # transformers comes with the call
from eaglekit.errors import EaglekitError
from eaglekit.model.checkpoint_files import layer_window
from eaglekit.preflight import CheckResult, fail, ok, skip, warn, will_be_produced
from eaglekit.serving.client import get_json
from eaglekit.serving.speculation import root_of

NAME = "served context"
MAX_MODEL_LEN = ("--max-model-len", "--max_model_len")
# vLLM's human_readable_int: 1k = 1,000, 1K = 1,024 (vllm/utils/argparse_utils.py)
HUMAN = re.compile(r"(\d+(?:\.\d+)?)([kKmMgG])")
DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9}
BINARY = {"K": 2**10, "M": 2**20, "G": 2**30}


def engine_args_context(args: Sequence[str]) -> int | None:
    """The context ``--max-model-len`` sets among vLLM's arguments (``N``, ``=N``, ``1k``/``1K`` as vLLM reads
    them); None where they leave it to the model (absent, ``-1``, ``auto``) or give no number eaglekit can read
    (vLLM then names it itself)."""
    value = None
    for i, arg in enumerate(args):
        name, eq, rest = str(arg).partition("=")
        if name in MAX_MODEL_LEN:
            value = rest if eq else (str(args[i + 1]) if i + 1 < len(args) else None)
    if value is None or value.strip() in ("-1", "auto"):
        return None
    value = value.strip()
    if value.isdigit():
        return int(value)
    human = HUMAN.fullmatch(value)
    if human:
        number, suffix = human.groups()
        return int(float(number) * DECIMAL[suffix]) if suffix in DECIMAL else int(float(number)) * BINARY[suffix]
    return None


def server_context(url: str) -> int | None:
    """``max_model_len`` of the model a running server lists first at ``/v1/models`` (the one verify sends to);
    None when it does not say or does not answer (the engine check names that)."""
    try:
        status, body = get_json(f"{root_of(url)}/v1/models", None)
    except httpx.HTTPError:
        return None
    models = body.get("data") if status == 200 and isinstance(body, dict) else None
    if not models or not isinstance(models[0], dict):
        return None
    value = models[0].get("max_model_len")
    return int(value) if isinstance(value, int) and value > 0 else None


def served(ctx: StageContext) -> tuple[int, str] | None:
    """(the context the engine verify talks to serves, where that figure comes from), or None: the target's whole
    context (vLLM's default), which the evaluation prompts are already cut to."""
    vc = ctx.cfg.verify
    if vc.server:
        limit = server_context(vc.server)
        return (limit, f"max_model_len at {root_of(vc.server)}/v1/models") if limit else None
    if vc.engine == "vllm":
        limit = engine_args_context(list(vc.engine_args))
        return (limit, "--max-model-len in verify.engine_args") if limit else None
    return None


def longest_prompt(ctx: StageContext, n: int) -> tuple[int, str, int]:
    """(the longest evaluation prompt verify sends, in tokens as eaglekit renders them; its id; how many prompts)."""
    from eaglekit.speculative.inputs import eval_prompts, prompt_ids  # lazy: heavy (torch)

    cfg = ctx.cfg
    tokenizer = load_tokenizer(cfg.target.model, cfg.target.chat_template, cfg.target.trust_remote_code)
    template_kwargs = cfg.generate.extra_body.get("chat_template_kwargs") or None
    prompts = eval_prompts(cfg, n)
    lengths = [(len(prompt_ids(tokenizer, messages, template_kwargs)), pid) for pid, messages in prompts]
    longest, pid = max(lengths)
    return longest, pid, len(lengths)


def prompts_fit(ctx: StageContext, num_samples: int, max_new_tokens: int) -> CheckResult:
    """The evaluation prompts plus ``max_new_tokens`` fit the served context (else the engine refuses them)."""
    context = served(ctx)
    if context is None:
        return ok(NAME, "the engine serves the target's whole context (no --max-model-len below it)")
    limit, source = context
    if will_be_produced(ctx, NAME, "generate") and not ctx.cfg.evaluate.prompts:
        return skip(NAME, f"the engine serves {limit:,} tokens ({source}); the held-out prompts are not there yet")
    try:
        longest, pid, count = longest_prompt(ctx, num_samples)
    except EaglekitError as err:
        return skip(NAME, f"the evaluation prompts cannot be read yet ({err.message})")
    need = longest + max_new_tokens
    if need > limit:
        room = limit - longest
        lower = f", or lower verify.max_new_tokens to {room:,}" if room > 0 else ""
        return fail(
            NAME,
            f"the engine serves {limit:,} tokens a request ({source}), but the longest of the {count} evaluation "
            f"prompts ('{pid}', {longest:,} tokens) plus verify.max_new_tokens {max_new_tokens:,} needs {need:,}: "
            "the engine would refuse it after starting",
            f"serve at least {need:,} tokens (verify.engine_args: [--max-model-len, '{need}'], or restart your "
            f"server so){lower}",
        )
    return ok(NAME, f"{limit:,} tokens ({source}) ≥ the longest prompt {longest:,} + max_new_tokens {max_new_tokens:,}")


def drafter_fits(ctx: StageContext, folders: dict[str, Path]) -> list[CheckResult]:
    """Warnings where the drafter was made for another context than the one served: trained on rows longer than it,
    or with a sliding window it can never fill."""
    context = served(ctx)
    if context is None:
        return []
    limit, source = context
    out = []
    trained = ctx.resolved.lengths  # the run's documents, as plan, train and the serving-context check read them
    if trained is not None and trained.prepared and trained.longest > limit:
        out.append(
            warn(
                "served context: training rows",
                f"the drafter trained on rows of up to {trained.longest:,} tokens, longer than the {limit:,} tokens "
                f"served ({source}): it is served at a context it was not made for",
                f"serve at least {trained.longest:,} tokens, or cut the training rows to the served context "
                f"(prepare.max_length: {limit}) and retrain",
            )
        )
    for form, folder in folders.items():
        window = exported_window(folder)
        if window is not None and window >= limit:
            out.append(
                warn(
                    f"served context: {form} window",
                    f"the drafter's {window:,}-token sliding window never fills at the {limit:,} tokens served "
                    f"({source}): it attends every position it is served, as a drafter without a window would",
                    f"serve longer contexts, or train with train.draft.sliding_window below {limit:,} (or null)",
                )
            )
    return out


def exported_window(folder: Path) -> int | None:
    """The sliding window of an exported drafter's one draft layer, as vLLM reads its config.json."""
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    layer = raw.get("transformer_layer_config") if isinstance(raw.get("transformer_layer_config"), dict) else raw
    return layer_window(layer) if isinstance(layer, dict) else None
