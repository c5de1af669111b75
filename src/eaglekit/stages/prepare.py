"""prepare: render each regenerated conversation with the target's chat template, tokenize, mask the loss.

Reads ``generate/responses.jsonl``; writes ``prepare/tokens.safetensors`` (flat token ids, loss mask,
offsets) and ``prepare/stats.json``. The loss mask covers exactly the assistant reply — reasoning inside
the template's think tags, content, and its end-of-turn token — because those are the tokens the target
generated and the drafter must learn to predict.
"""

from __future__ import annotations

from pathlib import Path

from eaglekit import atomic
from eaglekit.config import RunConfig
from eaglekit.contract import Estimate, Sizes, Stage, StageContext, measured_time
from eaglekit.data.chat import load_tokenizer, render_sample, use_generated_tokens
from eaglekit.data.reasoning import has_think_tags
from eaglekit.data.responses import read_responses
from eaglekit.errors import EaglekitError
from eaglekit.preflight import files, run_directory
from eaglekit.progress import Meter, console
from eaglekit.resolved import ResolvedRun

NAME = "prepare"
UPSTREAM = "generate"
TOKENS = "tokens.safetensors"
DROP_WARN_SHARE = 0.10  # a cause that drops more than this share of the responses is worth a warning
DROP_CAUSES = {  # why a response is dropped -> (what it means, what to do)
    "length_stopped": (
        "cut off at generate.max_tokens (finish_reason=length)",
        "raise generate.max_tokens, or keep them with prepare.keep_length_stopped: true",
    ),
    "overlong": ("longer than prepare.max_length", "raise prepare.max_length, or set prepare.overlong: truncate"),
    "empty": ("without a reply to train on", "look at generate/responses.jsonl: the target returned empty replies"),
}


def params(run: ResolvedRun) -> dict:
    cfg = run.cfg
    p = cfg.prepare.model_dump()
    p["chat_template"] = files.chat_template_identity(cfg.target.chat_template)
    p["chat_template_kwargs"] = cfg.generate.extra_body.get("chat_template_kwargs")
    p["tokenizer"] = files.tokenizer_identity(cfg)  # the tokenizer files decide the token ids; the weights don't
    return p | files.read_identities(cfg, "responses")  # what generate wrote, retried samples included


def checks(cfg: RunConfig) -> list:
    return [run_directory.target_folder]


BYTES_PER_TOKEN = 5  # int32 token id + uint8 loss mask


def estimate(ctx: StageContext, sizes: Sizes | None) -> Estimate:
    """The token store. Pre-flight counts about one token per 4 bytes of the responses' JSON text."""
    if sizes is None:
        responses = ctx.run.stage_dir("generate") / "responses.jsonl"
        return Estimate(bytes=int(responses.stat().st_size / 4 * BYTES_PER_TOKEN) if responses.exists() else None)
    est = Estimate()
    n, t = sizes.samples, sizes.mean_tokens
    if n is not None and t is not None:
        est.per_sample_bytes = t * BYTES_PER_TOKEN + 8
        est.bytes = n * est.per_sample_bytes
        est.how.append(f"{n:,.0f} × {t:,.0f} tok × {BYTES_PER_TOKEN} B (int32 id + uint8 mask)")
    measured_time(est, sizes, "samples")
    return est


def run(ctx: StageContext) -> dict:
    from eaglekit.data.tokens import write_token_store  # lazy: heavy (torch)

    cfg = ctx.cfg
    tokenizer = load_tokenizer(cfg.target.model, cfg.target.chat_template, cfg.target.trust_remote_code)
    responses_path = ctx.run.stage_dir("generate") / "responses.jsonl"
    rows = list(read_responses(responses_path))
    samples, dropped, truncated, exact_ids = tokenize_responses(cfg, tokenizer, rows, responses_path)
    if not samples:
        raise EaglekitError(
            f"prepare: none of {len(rows)} responses in {responses_path} made a training sample (dropped: {dropped})",
            "; ".join(DROP_CAUSES[c][1] for c, n in dropped.items() if n) or "check generate's outputs",
        )
    for cause, n in dropped.items():
        if n > DROP_WARN_SHARE * len(rows):
            what, fix = DROP_CAUSES[cause]
            ctx.warn(f"{n} of {len(rows)} responses ({n / len(rows):.0%}) dropped as {what}: {fix}")
    tagged = sum(has_think_tags(row.get("content") or "") for row in rows)
    if tagged:
        ctx.warn(
            f"{tagged} of {len(rows)} replies keep think tags in their content: their reasoning was not separated "
            "from the answer, so the drafter learns it in the wrong place; serve the target with its "
            "--reasoning-parser (or fix the template), then regenerate"
        )
    write_token_store(ctx.dir / TOKENS, samples)
    lengths = sorted(len(ids) for _, ids, _ in samples)
    assistant = sum(sum(m) for _, _, m in samples)
    stats = {
        "samples": len(samples),
        "responses": len(rows),
        "dropped": dropped,
        "truncated": truncated,
        "think_tags_in_content": tagged,
        "generated_ids_used": exact_ids,
        "tokens": sum(lengths),
        "assistant_tokens": assistant,
        "mean_length": round(sum(lengths) / len(lengths), 1),
        "p95_length": lengths[min(len(lengths) - 1, int(0.95 * len(lengths)))],
        "max_length": lengths[-1],
    }
    atomic.write_json(ctx.dir / "stats.json", stats)
    console.print(
        f"prepare: {stats['samples']} samples, {stats['tokens']} tokens ({assistant} assistant), "
        f"mean length {stats['mean_length']}, p95 {stats['p95_length']}; dropped {dropped}, truncated {truncated}"
    )
    return {k: stats[k] for k in ("samples", "tokens", "assistant_tokens", "mean_length", "p95_length")} | {
        "dropped": sum(dropped.values())
    }


def tokenize_responses(
    cfg: RunConfig, tokenizer, rows: list[dict], responses_path: Path
) -> tuple[list[tuple[str, list[int], list[int]]], dict[str, int], int, int]:
    """(id, token ids, loss mask) of each response that makes a training sample, the dropped ones by cause, the
    number truncated, and the number whose generated token ids replaced a re-tokenization of their text."""
    max_len = cfg.prepare.max_length
    # The template must render exactly as it did for the server (e.g. enable_thinking), or the masks drift.
    template_kwargs = cfg.generate.extra_body.get("chat_template_kwargs") or None
    dropped = {"length_stopped": 0, "overlong": 0, "empty": 0}
    truncated = 0
    exact_ids = 0  # replies whose generated token ids differ from a re-tokenization of their text
    samples = []
    with Meter("prepare", total=len(rows), unit="samples") as meter:
        for row in rows:
            meter.update(1)
            if row.get("finish_reason") == "length" and not cfg.prepare.keep_length_stopped:
                dropped["length_stopped"] += 1
                continue
            if not (row.get("content") or row.get("reasoning")):
                dropped["empty"] += 1
                continue
            try:
                sample = render_sample(
                    tokenizer,
                    row["messages"],
                    row.get("reasoning") or "",
                    row.get("content") or "",
                    template_kwargs=template_kwargs,
                )
            except EaglekitError as err:
                raise EaglekitError(f"{responses_path}: sample {row['id']}: {err.message}", err.remedy) from None
            ids, mask, replaced = use_generated_tokens(
                tokenizer, sample.input_ids, sample.loss_mask, row.get("completion_token_ids")
            )
            exact_ids += replaced
            if len(ids) > max_len:
                if cfg.prepare.overlong == "drop":
                    dropped["overlong"] += 1
                    continue
                ids, mask = ids[:max_len], mask[:max_len]
                truncated += 1
            if not any(mask):
                dropped["empty"] += 1
                continue
            samples.append((row["id"], ids, mask))
    return samples, dropped, truncated, exact_ids


STAGE = Stage(
    name=NAME,
    upstream=UPSTREAM,
    reads="generate/responses.jsonl and the target's tokenizer and chat template",
    writes="prepare/tokens.safetensors, prepare/stats.json",
    params=params,
    checks=checks,
    run=run,
    estimate=estimate,
)
