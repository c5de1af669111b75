"""The prompts dataset: readable, how many rows (cheaply), and whether its first rows are usable.

Rows are counted without parsing them: newlines of a JSONL file (estimated from its first 64 MB when it is
larger than 2 GB), Parquet's footer metadata, a ``datasets`` folder's own length. The first ``SAMPLE_ROWS``
rows are parsed the way ``generate`` will: bad rows are named by ``file:line`` — a ``fail`` when
``data.on_bad_row`` is ``fail`` (the run would stop there), a ``warn`` when it is ``skip`` — and the share
of rows without a user turn and of duplicates is reported.
"""

from __future__ import annotations

from pathlib import Path

from jinja2 import TemplateError

from eaglekit.contract import StageContext
from eaglekit.data.chat import local_target_tokenizer
from eaglekit.data.prompts import SKIP_REMEDY, load_prompts, run_prompts
from eaglekit.errors import EaglekitError
from eaglekit.preflight import CheckResult, fail, ok, skip, warn
from eaglekit.resolved import ResolvedRun

SAMPLE_ROWS = 1000
EXACT_COUNT_LIMIT = 2 << 30  # JSONL files up to this size have their lines counted exactly
DUPLICATE_WARN_SHARE = 0.05


def count_rows(path: Path) -> tuple[int | None, str]:
    """(rows, how they were counted); None when counting would mean reading the whole dataset."""
    if path.is_dir():
        import datasets  # lazy: heavy (datasets)

        try:
            ds = datasets.load_from_disk(str(path))
        except Exception:  # noqa: BLE001 - the parse below names the problem
            return None, "unreadable datasets folder"
        if isinstance(ds, datasets.DatasetDict):
            split = "train" if "train" in ds else next(iter(ds))
            return len(ds[split]), f"datasets folder, split '{split}'"
        return len(ds), "datasets folder"
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq  # lazy: heavy (pyarrow)

        try:
            return pq.ParquetFile(path).metadata.num_rows, "Parquet metadata"
        except Exception:  # noqa: BLE001 - the parse below names the problem
            return None, "unreadable Parquet footer"
    size = path.stat().st_size
    with open(path, "rb") as f:
        if f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"["):
            return None, "a JSON list (counted when loaded)"
        f.seek(0)
        if size <= EXACT_COUNT_LIMIT:
            lines = sum(block.count(b"\n") for block in iter(lambda: f.read(16 << 20), b""))
            f.seek(max(size - 1, 0))
            lines += size > 0 and f.read(1) != b"\n"  # a last line without its newline
            return lines, "lines"
        head = f.read(64 << 20)
    per_line = len(head) / max(head.count(b"\n"), 1)
    return int(size / per_line), f"estimated from the first 64 MB ({per_line:.0f} bytes per line)"


def prompts(ctx: StageContext) -> CheckResult:
    """``data.prompts`` exists, its first rows parse in a supported shape, and what the rest will be like."""
    name = "prompts"
    cfg = ctx.cfg.data
    if cfg.prompts is None:
        return skip(name, "the run reads data.traffic, not prompts")
    path = Path(cfg.prompts)
    if not path.exists():
        return fail(
            name, f"prompt data not found: {path}", "set data.prompts to a JSONL/JSON/Parquet file or a datasets folder"
        )
    try:
        rows, how = count_rows(path)
        head = load_prompts(path, max_samples=SAMPLE_ROWS, on_bad_row="skip")
    except EaglekitError as err:
        return fail(name, err.message, err.remedy or "fix the prompts file")
    except OSError as err:
        return fail(name, f"{path}: cannot be read ({err.strerror or err})", "fix its permissions or the mount")
    read = head.total_rows
    facts = [
        f"{rows:,} rows ({how})" if rows is not None else how,
        f"first {read:,} read: {len(head.records):,} prompts",
    ]
    no_user = sum("no user turn" in b.reason for b in head.bad_rows)
    if no_user:
        facts.append(f"{no_user / read:.1%} without a user turn")
    if head.duplicates:
        facts.append(f"{head.duplicates / read:.1%} duplicates (skipped)")
    if cfg.max_samples and rows is not None and rows < cfg.max_samples:
        facts.append(f"data.max_samples {cfg.max_samples:,} is more than the file holds")
    summary = f"{path}: " + ", ".join(facts)
    if head.bad_rows:
        first = head.bad_rows[0]
        bad = f"{len(head.bad_rows)} bad row(s) among the first {read:,}, e.g. {first.source}: {first.reason}"
        if cfg.on_bad_row == "fail":
            return fail(name, f"{bad}; {summary}", SKIP_REMEDY)
        return warn(name, f"{bad} (data.on_bad_row: skip drops them); {summary}", "fix them to keep those samples")
    if not head.records:
        return fail(name, f"{summary}: no usable prompt", "point data.prompts at a dataset with user turns")
    if head.duplicates / max(read, 1) >= DUPLICATE_WARN_SHARE:
        return warn(
            name,
            summary,
            "repeated prompts (same id or same turns) are skipped, so the run has fewer samples "
            "than rows; deduplicate the file or add rows if you need that many",
        )
    return ok(name, summary)


TOKENIZED_PROMPTS = 2000  # the longest prompts (by characters) tokenised exactly; ~1 s with a fast tokenizer
# A prompt's tokens are estimated at one per 3 characters when the target tokenizer is not at hand
# (English averages ~4; erring long makes the length checks strict rather than blind).
CHARS_PER_TOKEN = 3.0


def context_limit(run: ResolvedRun) -> tuple[int, str]:
    """The most tokens a prompt may have: the target's max_position_embeddings (when its folder is here), or
    prepare.max_length where that is smaller (prepare drops or cuts a longer sample); and where it comes from."""
    cfg = run.cfg
    limit, why = cfg.prepare.max_length, f"prepare.max_length {cfg.prepare.max_length}"
    # unreadable: the target folder check says why
    context = run.max_position_embeddings if Path(cfg.target.model).is_dir() else None
    if context is not None and 0 < context < limit:
        limit, why = context, f"the target's max_position_embeddings {context}"
    return limit, why


def prompt_token_counts(cfg, records: list) -> tuple[list[tuple[int, str]], str, bool]:
    """(tokens, id) per prompt, longest first, how they were counted, and whether every count is exact (rendered with
    the chat template and tokenised as generate does it). Past TOKENIZED_PROMPTS, the shorter prompts (by characters)
    are estimated at the tokenised ones' highest tokens per character; without the target's tokenizer here, every
    count is estimated from characters."""

    def chars(r) -> int:
        return sum(len(m["content"]) for m in r.messages)

    by_chars = sorted(records, key=lambda r: -chars(r))
    try:
        tokenizer = local_target_tokenizer(cfg)
    except EaglekitError:
        tokenizer = None  # the reasoning check names the tokenizer's problem
    if tokenizer is None:
        estimated = [(int(chars(r) / CHARS_PER_TOKEN) + 8 * len(r.messages), r.id) for r in by_chars]
        return estimated, f"estimated at {CHARS_PER_TOKEN:g} characters per token", False
    kwargs = cfg.generate.extra_body.get("chat_template_kwargs") or {}
    head = by_chars[:TOKENIZED_PROMPTS]
    texts = [_rendered(tokenizer, r, kwargs) for r in head]
    ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"] if texts else []
    counted = [(len(x), r.id) for x, r in zip(ids, head, strict=True)]
    rest = by_chars[TOKENIZED_PROMPTS:]
    if not rest:
        return sorted(counted, reverse=True), "tokenised with the target's tokenizer and chat template", True
    per_char = max(n / max(chars(r), 1) for (n, _), r in zip(counted, head, strict=True))
    counted += [(int(chars(r) * per_char), r.id) for r in rest]
    how = (
        f"the {len(head):,} longest tokenised; the other {len(rest):,} estimated at {per_char:.2f} tokens per character"
    )
    return sorted(counted, reverse=True), how, False


def prompt_tokens(ctx: StageContext) -> tuple[list[tuple[int, str]], str, bool]:
    """The run's prompts' ``prompt_token_counts``, counted once per pre-flight run of a stage: the prompt length
    check and the servers' context length check compare the same counts (up to TOKENIZED_PROMPTS tokenised)."""
    return ctx.once(_count_run_prompts)


def _count_run_prompts(ctx: StageContext) -> tuple[list[tuple[int, str]], str, bool]:
    return prompt_token_counts(ctx.cfg, run_prompts(ctx.cfg).records)


def _rendered(tokenizer, record, template_kwargs: dict) -> str:
    """The prompt as generate sends it to the target; a row the chat template refuses is named by its line."""
    try:
        return tokenizer.apply_chat_template(
            record.messages, tokenize=False, add_generation_prompt=True, **template_kwargs
        )
    except TemplateError as err:
        raise EaglekitError(
            f"{record.source}: the target's chat template refuses this prompt ({err})",
            "fix that row's turns (e.g. roles that must alternate), or set target.chat_template",
        ) from None


def prompt_length(ctx: StageContext) -> CheckResult:
    """Prompts with more tokens than the target's context (or prepare.max_length, if smaller): the target cannot
    answer them whole and prepare drops or cuts their samples. Some is a warning, all (counted exactly) a failure."""
    name = "prompt length"
    try:
        records = run_prompts(ctx.cfg).records
    except EaglekitError:
        return skip(name, "the prompts do not load (see the prompts checks)")
    if not records:
        return skip(name, "no prompts")
    limit, why = context_limit(ctx.resolved)
    counts, how, exact = prompt_tokens(ctx)
    over = [(n, rid) for n, rid in counts if n > limit]
    longest, rid = counts[0]
    if not over:
        return ok(name, f"longest prompt {longest:,} tokens ({how}) ≤ {limit:,} ({why})")
    by_prepare = why.startswith("prepare")
    consequence = (
        f"prepare {'drops' if ctx.cfg.prepare.overlong == 'drop' else 'cuts'} longer samples, so their replies are "
        "generated in vain"
        if by_prepare
        else "the target cannot read them whole, so their replies fail or ramble"
    )
    detail = (
        f"{ctx.cfg.data.prompts}: {len(over):,} of {len(records):,} prompts have more tokens than {limit:,} ({why}), "
        f"e.g. '{rid}' with "
        f"{longest:,} ({how}): {consequence}"
    )
    served = ctx.resolved.served if by_prepare else None
    if served is not None and served.long:
        # served long, the long rows are the ones that keep the drafter's acceptance there (docs/long-context.md)
        wanted = min(served.tokens, -(-(longest + ctx.cfg.generate.max_tokens) // 1024) * 1024)
        remedy = (
            f"raise prepare.max_length (to {wanted:,}: the longest prompt and generate.max_tokens): the drafter is "
            f"{served.words}, and long rows are what keeps its acceptance "
            "there (docs/long-context.md); or drop the longest prompts"
        )
    else:
        remedy = "drop the longest prompts from data.prompts" + (", or raise prepare.max_length" if by_prepare else "")
    if exact and len(over) == len(records):
        return fail(name, detail, remedy)
    return warn(name, detail, remedy)
