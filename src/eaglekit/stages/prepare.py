"""prepare: render each regenerated conversation with the target's chat template, tokenize, mask the loss.

Reads ``generate/responses.jsonl``; writes ``prepare/tokens.safetensors`` (flat token ids, loss mask,
offsets) and ``prepare/stats.json``. The loss mask covers exactly the assistant reply — reasoning inside
the template's think tags, content, and its end-of-turn token — because those are the tokens the target
generated and the drafter must learn to predict.

Grown data: when only the responses changed since the folder's outputs were made (generate went on from its replies
after prompts were added, removed or edited), the stage goes on from them (``continues``): ``prepare/samples.json``
records each response row's hash and what prepare made of it, so a row kept byte for byte keeps its sample and only
the others are tokenized; samples of rows no longer in the responses leave the store.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglekit import atomic, rundir
from eaglekit.config import RunConfig
from eaglekit.contract import Estimate, Sizes, Stage, StageContext, measured_time
from eaglekit.data.chat import load_tokenizer, render_sample, use_generated_tokens
from eaglekit.data.reasoning import has_think_tags
from eaglekit.data.responses import RESPONSES, read_responses
from eaglekit.data.tokens import TokenStore, write_token_store
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


SAMPLES = "samples.json"  # each response row's hash and what prepare made of it, for the store it goes with


def row_hash(row: dict) -> str:
    """A response row's content: a row kept byte for byte by generate is tokenized once."""
    return hashlib.sha256(json.dumps(row, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]


@dataclass
class Outcome:
    """What prepare made of one response row: its sample (id, token ids, loss mask), or why it was dropped."""

    sample: tuple[str, Any, Any] | None
    dropped: str | None = None
    truncated: bool = False
    generated_ids: bool = False

    def record(self, sha: str) -> dict:
        return {"sha": sha, "dropped": self.dropped, "truncated": self.truncated, "generated_ids": self.generated_ids}


def earlier_outcomes(ctx: StageContext) -> dict[str, dict]:
    """What the outputs in prepare's folder made of each response row (samples.json), when they go with the token
    store there (a store written by a stopped run, or one without samples.json, is made again from every row)."""
    folder = ctx.dir
    try:
        made = json.loads((folder / SAMPLES).read_text())
        if made.get("tokens") != rundir.sha256_file(folder / TOKENS):
            return {}
        return dict(made["rows"])
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def continues(ctx: StageContext) -> str | None:
    """Only the generated responses changed since the outputs in the folder were made (generate went on from its
    replies): the rows it kept byte for byte keep their samples, only the others are tokenized."""
    if not files.changed_only(ctx, ("responses",)):
        return None
    responses = ctx.run.stage_dir("generate") / RESPONSES
    try:
        rows = list(read_responses(responses))
    except EaglekitError:
        return None  # the run names what is unreadable
    earlier = earlier_outcomes(ctx)
    kept = sum((earlier.get(row["id"]) or {}).get("sha") == row_hash(row) for row in rows)
    return (
        f"the generated responses changed since it ran: {len(rows) - kept} new to tokenize of {len(rows)}; {kept} kept"
    )


def run(ctx: StageContext) -> dict:
    cfg = ctx.cfg
    responses_path = ctx.run.stage_dir("generate") / RESPONSES
    rows = list(read_responses(responses_path))
    earlier = earlier_outcomes(ctx)
    store = TokenStore(ctx.dir / TOKENS) if earlier else None
    position = {sample_id: i for i, sample_id in enumerate(store.ids)} if store else {}
    tokenizer = None
    outcomes: dict[str, dict] = {}
    samples, dropped = [], dict.fromkeys(DROP_CAUSES, 0)
    truncated = exact_ids = reused = reused_samples = 0
    with Meter("prepare", total=len(rows), unit="samples") as meter:
        for row in rows:
            meter.update(1)
            sha = row_hash(row)
            made = earlier.get(row["id"])
            if made and made["sha"] == sha and (made["dropped"] or row["id"] in position):
                assert store is not None
                outcome = Outcome(
                    None if made["dropped"] else store[position[row["id"]]],
                    made["dropped"],
                    made["truncated"],
                    made["generated_ids"],
                )
                reused += 1
                reused_samples += outcome.sample is not None
            else:
                if tokenizer is None:
                    tokenizer = load_tokenizer(cfg.target.model, cfg.target.chat_template, cfg.target.trust_remote_code)
                outcome = tokenize_row(cfg, tokenizer, row, responses_path)
            outcomes[row["id"]] = outcome.record(sha)
            if outcome.dropped:
                dropped[outcome.dropped] += 1
            elif outcome.sample is not None:
                samples.append(outcome.sample)
            truncated += outcome.truncated
            exact_ids += outcome.generated_ids
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
    if store is None or [sid for sid, _, _ in samples] != store.ids or reused_samples < len(samples):
        write_token_store(ctx.dir / TOKENS, samples)
    # else the same samples: the store stays as it is (safetensors orders its metadata anew at every write, so a
    # rewrite would change the bytes the stages after prepare are fingerprinted over)
    atomic.write_json(ctx.dir / SAMPLES, {"tokens": rundir.sha256_file(ctx.dir / TOKENS), "rows": outcomes})
    lengths = sorted(len(ids) for _, ids, _ in samples)
    assistant = sum(int(sum(m)) for _, _, m in samples)
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
    if earlier:
        console.print(f"prepare: {len(rows) - reused} new samples tokenized, {reused} kept")
    console.print(
        f"prepare: {stats['samples']} samples, {stats['tokens']} tokens ({assistant} assistant), "
        f"mean length {stats['mean_length']}, p95 {stats['p95_length']}; dropped {dropped}, truncated {truncated}"
    )
    return {k: stats[k] for k in ("samples", "tokens", "assistant_tokens", "mean_length", "p95_length")} | {
        "dropped": sum(dropped.values()),
        "tokenized": len(rows) - reused,
        "kept": reused,
    }


def tokenize_row(cfg: RunConfig, tokenizer, row: dict, responses_path: Path) -> Outcome:
    """The training sample of one response — its token ids and loss mask — or why it makes none."""
    if row.get("finish_reason") == "length" and not cfg.prepare.keep_length_stopped:
        return Outcome(None, "length_stopped")
    if not (row.get("content") or row.get("reasoning")):
        return Outcome(None, "empty")
    # The template must render exactly as it did for the server (e.g. enable_thinking), or the masks drift.
    template_kwargs = cfg.generate.extra_body.get("chat_template_kwargs") or None
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
    # replaced: the generated token ids differ from a re-tokenization of the text, and are used
    ids, mask, replaced = use_generated_tokens(
        tokenizer, sample.input_ids, sample.loss_mask, row.get("completion_token_ids")
    )
    truncated = False
    max_len = cfg.prepare.max_length
    if len(ids) > max_len:
        if cfg.prepare.overlong == "drop":
            return Outcome(None, "overlong", generated_ids=bool(replaced))
        ids, mask, truncated = ids[:max_len], mask[:max_len], True
    if not any(mask):
        return Outcome(None, "empty", truncated, bool(replaced))
    return Outcome((row["id"], ids, mask), None, truncated, bool(replaced))


STAGE = Stage(
    name=NAME,
    upstream=UPSTREAM,
    reads="generate/responses.jsonl and the target's tokenizer and chat template",
    writes="prepare/tokens.safetensors, prepare/stats.json",
    params=params,
    checks=checks,
    run=run,
    estimate=estimate,
    continues=continues,
)
