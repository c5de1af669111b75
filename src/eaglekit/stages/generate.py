"""generate: collect the target's own replies — reasoning included — to the run's prompts.

Writes ``generate/responses.jsonl`` (one line per complete sample, docs/formats.md §4) and
``generate/errors.jsonl`` (samples whose requests failed for good). Two backends: ``local`` generates
in this process with transformers, ``openai`` asks OpenAI-compatible servers (vLLM, SGLang, …).

Resume: a rerun skips the ids already in responses.jsonl and those in errors.jsonl; ``--retry-failed``
clears errors.jsonl and tries those samples again. Sample ids are the prompt records' ids.

Changed prompts: the prompts are identified by their rows (each row's id and messages, ``prompts.prompt_key``),
never by the file's name or place. When they change under the same generation settings — rows added or removed,
``data.max_samples`` raised after a pilot — the stage goes on from the replies it has (``continues``): it asks only
the prompts without a reply, keeps every reply whose prompt is still asked, and sets the others aside (kept in
generate/set_aside.jsonl, not read by later stages; a prompt asked again takes its reply back from there).

Served traffic (``data.traffic``, docs/traffic.md): the stage asks no server. It copies the conversations the gateway
log holds of the run's target (data/traffic.py: checked, deduplicated, selected) into responses.jsonl, the same
records in the same file, so every stage after it reads the run directory alone; the lines it rejects are named in
generate/traffic_rejects.jsonl (where and why, never their content). The traffic is identified by its
conversations as prompts are by their rows: lines appended to the log add only the new conversations.

The reasoning gate: when reasoning is required (by default, when the target's chat template has think
tags), the first ``gate_samples`` completions of every run are held back until they are checked; if
more than ``gate_max_empty_share`` of them have no reasoning the stage stops — naming the fields the
server sent — and none of them reaches the file. This is what stops a twelve-hour run that reads the
wrong field (or a server started without its reasoning parser) after its first few samples.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from eaglekit import atomic
from eaglekit.config import RunConfig
from eaglekit.contract import Estimate, Sizes, Stage, StageContext
from eaglekit.data.chat import TEMPLATE_REMEDY, ServedPrompts
from eaglekit.data.prompts import PromptRecord, prompt_key, prompts_identity, run_prompts
from eaglekit.data.reasoning import explain_missing_reasoning, target_reasoning_mode
from eaglekit.data.responses import (
    RESPONSES,
    SET_ASIDE,
    ResponseStore,
    failed_ids,
    make_record,
    quick_counts,
    stored_keys,
    summarize,
)
from eaglekit.data.traffic import log_files, traffic_identity, traffic_model
from eaglekit.errors import EaglekitError
from eaglekit.preflight import dataset, files, gpus, run_directory
from eaglekit.preflight import servers as server_checks
from eaglekit.preflight import traffic as traffic_checks
from eaglekit.progress import Meter, console
from eaglekit.resolved import ResolvedRun
from eaglekit.rundir import content_identity
from eaglekit.serving.client import ChatClient, RequestFailed, api_key_from_env

NAME = "generate"
UPSTREAM = None
TRAFFIC_REJECTS = "traffic_rejects.jsonl"  # the traffic lines left out: where and why, never their content


def live_counts(stage_dir: Path) -> dict:
    """What `status` shows while a long generate is running or was killed."""
    return quick_counts(stage_dir)


def kept(ctx: StageContext) -> str:
    """What a stopped generate leaves: complete lines only (a torn one is cut back), each a finished sample."""
    done = quick_counts(ctx.dir)["done"]
    return f"{done} responses are safely in {ctx.dir / RESPONSES} (a rerun resumes after them)"


def params(run: ResolvedRun) -> dict:
    """What the responses depend on. Not the server URLs, concurrency or batch size: adding a server or
    changing the batching must not invalidate a run."""
    cfg = run.cfg
    g = cfg.generate
    if cfg.data.traffic is not None:
        return {  # the conversations taken (which lines, checked against what), not the log's name or place
            "traffic": traffic_identity(cfg),
            "backend": "traffic",
            "model": traffic_model(cfg),
            "chat_template": files.chat_template_identity(cfg.target.chat_template),
            "chat_template_kwargs": g.extra_body.get("chat_template_kwargs"),
        }
    return {
        "prompts": prompts_identity(cfg),  # the rows read (data.max_samples, data.on_bad_row applied), not the file
        "backend": g.backend,
        "model": files.target_identity(cfg) if g.backend == "local" else g.model,
        "temperature": g.temperature,
        "top_p": g.top_p,
        "max_tokens": g.max_tokens,
        "seed": g.seed,
        "extra_body": g.extra_body,
        "return_token_ids": g.return_token_ids,
        "reasoning": g.reasoning,
        "chat_template": files.chat_template_identity(cfg.target.chat_template),
    }


# --- changed prompts --------------------------------------------------------------------------------

WHICH_PROMPTS = ("prompts", "max_samples", "on_bad_row", "traffic")  # parameters that say which prompts are asked
# (older ledgers recorded max_samples and on_bad_row beside the file); the others say how a prompt is answered


@dataclass
class Plan:
    """What a run does with the prompts it asks and the replies in its folder."""

    asked: int  # prompts in the set
    kept: int  # their replies already in responses.jsonl
    pending: list[PromptRecord]  # prompts to ask (those that failed before are left out unless retried)
    set_aside: set[str] = field(default_factory=set)  # ids whose replies answer no prompt asked now
    new: int = 0  # prompts with no reply stored (added, or beyond a raised data.max_samples)
    edited: int = 0  # ids whose prompt's messages changed since their reply
    failed_before: int = 0  # prompts without a reply whose requests failed before: left out unless retried
    traffic: bool = False  # the conversations come from a traffic log: taken, not generated

    def words(self) -> str:
        changes = [
            f"{n} {what}"
            for n, what in (
                (self.new, "added"),
                (len(self.set_aside) - self.edited, "removed"),
                (self.edited, "edited"),
            )
            if n
        ]
        aside = (
            f"; the replies to {len(self.set_aside) - self.edited} prompts no longer asked go to generate/{SET_ASIDE} "
            "(kept there, not read by later stages)"
            if len(self.set_aside) > self.edited
            else ""
        )
        failed = (
            f"; {self.failed_before} that failed before are left out (--retry-failed retries them)"
            if self.failed_before
            else ""
        )
        items, verb = ("conversations of the traffic", "take") if self.traffic else ("prompts", "generate")
        what = f"the {items} changed since it ran ({', '.join(changes)})" if changes else f"the same {items}"
        return f"{what}: {verb} {len(self.pending)} new of {self.asked}; {self.kept} kept{aside}{failed}"


def plan(records: list[PromptRecord], stored: dict[str, str], failed: set[str]) -> Plan:
    """Which of ``records`` to ask, given the replies ``stored`` (id -> prompt key) and the ids that ``failed``."""
    wanted = {r.id: prompt_key(r.id, r.messages) for r in records}
    edited = {rid for rid, key in wanted.items() if rid in stored and stored[rid] != key}
    return Plan(
        asked=len(records),
        kept=sum(stored.get(rid) == key for rid, key in wanted.items()),
        pending=[r for r in records if stored.get(r.id) != wanted[r.id] and r.id not in failed],
        set_aside={rid for rid, key in stored.items() if wanted.get(rid) != key},
        new=sum(rid not in stored for rid in wanted),
        edited=len(edited),
        failed_before=sum(stored.get(rid) != key and rid in failed for rid, key in wanted.items()),
    )


def continues(ctx: StageContext) -> str | None:
    """The folder holds another run's replies (other prompts, or older parameters' layout) under the same
    generation settings: they are this run's to keep, so the stage goes on from them instead of replacing them
    (with --force or not). Says what it will generate and keep; None when the settings differ."""
    marker = ctx.run.read_marker(NAME) or {}
    recorded = next(
        (
            start.get("params")
            for start, _ in reversed(ctx.run.attempts(NAME))
            if start.get("fingerprint") == marker.get("fingerprint")
        ),
        None,
    )
    if not isinstance(recorded, dict) or _answering(recorded) != _answering(params(ctx.resolved)):
        return None
    try:
        if ctx.cfg.data.traffic is not None:
            samples = traffic_checks.traffic_read(ctx).samples
            return replace(plan(traffic_prompts(samples), stored_keys(ctx.dir), set()), traffic=True).words()
        records = run_prompts(ctx.cfg).records
        stored = stored_keys(ctx.dir)
        failed = set() if ctx.options.get("retry_failed") else failed_ids(ctx.dir)
    except EaglekitError:
        return None  # the prompts check (or the run) names what is unreadable
    return plan(records, stored, failed).words()


def traffic_prompts(samples: list[dict]) -> list[PromptRecord]:
    """The traffic's conversations as the prompts they answer (the plan's terms)."""
    return [PromptRecord(s["id"], s["messages"], s["source"]) for s in samples]


def _answering(p: dict) -> Any:
    """The parameters that say how a prompt is answered, as the ledger holds them (JSON), without their paths."""
    return content_identity(json.loads(json.dumps({k: v for k, v in p.items() if k not in WHICH_PROMPTS}, default=str)))


def checks(cfg: RunConfig) -> list:
    from eaglekit.preflight import environment  # lazy: heavy (torch)

    if cfg.data.traffic is not None:
        return [run_directory.target_folder, traffic_checks.traffic]
    if cfg.generate.backend == "local":
        return [
            dataset.prompts,
            server_checks.prompts_loaded,
            dataset.prompt_length,
            run_directory.target_folder,
            files.target_weights,
            environment.software,
            environment.devices,
            gpus.gpus,
            server_checks.reasoning_mode,
        ]
    return [
        dataset.prompts,
        server_checks.prompts_loaded,
        dataset.prompt_length,
        server_checks.reasoning_mode,
        server_checks.api_key,
        server_checks.servers,
        server_checks.health,
        server_checks.context_length,
        server_checks.smoke,
        gpus.gpus,
    ]


TEXT_BYTES = 4  # bytes of JSON text per token of prompt and reply (English averages ~4 characters)
ID_BYTES = 7  # bytes per token id written as JSON (`123456, `)


def estimate(ctx: StageContext, sizes: Sizes | None) -> Estimate:
    """The responses file: its text, and the reply's token ids when they are kept (local backend or
    generate.return_token_ids). Pre-flight sizes the prompts as loaded with replies of generate.max_tokens."""
    cfg, g = ctx.cfg, ctx.cfg.generate
    ids = g.return_token_ids or g.backend == "local"
    if cfg.data.traffic is not None:  # at most the log's own size: its conversations without the gateways' fields
        try:
            logged = sum(f.stat().st_size for f in log_files(cfg.data.traffic.path))
        except (EaglekitError, OSError):
            return Estimate()  # the traffic check says what is wrong
        return Estimate(bytes=logged, how=[f"at most the traffic log's {logged:,} bytes"])
    if sizes is None:
        try:
            records = run_prompts(cfg).records
        except EaglekitError:
            return Estimate()  # the prompts check says what is wrong
        prompt_bytes = sum(len(str(r.messages)) for r in records)
        return Estimate(bytes=prompt_bytes + len(records) * g.max_tokens * (TEXT_BYTES + (ID_BYTES if ids else 0)))
    est = Estimate()
    n, t, out_tokens = sizes.samples, sizes.mean_tokens, sizes.output_tokens
    if n is not None and t is not None and out_tokens is not None:
        per_token = f"{TEXT_BYTES} B of text" + (f" + {ID_BYTES} B of token ids per reply token" if ids else "")
        est.per_sample_bytes = t * TEXT_BYTES + (out_tokens * ID_BYTES if ids else 0)
        est.bytes = n * est.per_sample_bytes
        est.how.append(
            f"{n:,.0f} samples × ({t:,.0f} tok × {TEXT_BYTES} B"
            + (f" + {out_tokens:,.0f} reply tok × {ID_BYTES} B" if ids else "")
            + f") [{per_token}]"
        )
        if sizes.gen_tok_per_s:
            est.seconds = n * out_tokens / sizes.gen_tok_per_s
            est.how.append(f"time: {n:,.0f} × {out_tokens:,.0f} reply tok ÷ {sizes.gen_tok_per_s:,.0f} tok/s")
    return est


# --- collecting finished samples ---------------------------------------------------------------------


class Collector:
    """Takes each finished sample: quality figures, the reasoning gate, the store, the progress meter."""

    def __init__(
        self,
        store: ResponseStore,
        meter: Meter,
        mode: str,
        gate_samples: int,
        max_empty_share: float,
        max_failures_in_a_row: int,
        backend: str = "openai",
    ):
        self.store, self.meter, self.mode, self.backend = store, meter, mode, backend
        self.gate_samples, self.max_empty_share = gate_samples, max_empty_share
        self.max_failures_in_a_row = max_failures_in_a_row
        self.held: list[tuple[dict, list[str]]] = []  # completions waiting for the gate
        self.gate: dict[str, Any] | None = None if mode == "required" else {"mode": mode, "checked": False}
        self.counts: Counter = Counter()
        self.output_tokens = 0
        self.failures_in_a_row = 0
        self.template_example: str | None = None  # the first prompt the server rendered another way
        self.t0 = time.monotonic()

    def add(self, record: dict, seen: list[str]) -> None:
        if self.gate is not None and self.gate.get("passed") is False:
            return  # the gate stopped this run; a request still in flight then must not reach the file
        self.failures_in_a_row = 0
        self.counts["new"] += 1
        self.counts["empty_reasoning"] += not record["reasoning"]
        self.output_tokens += record["completion_tokens"] or 0
        if self.gate is None:
            self.held.append((record, seen))
            if len(self.held) >= self.gate_samples:
                self.check_gate()
        else:
            self.store.add(record)
        elapsed = max(time.monotonic() - self.t0, 1e-9)
        self.meter.update(
            1,
            **{
                "tok/s": round(self.output_tokens / elapsed, 1),
                "failed": self.counts["failed"],
                "no_reasoning": self.counts["empty_reasoning"],
            },
        )

    def served_prompt(self, rid: str, problem: str | None) -> None:
        """Count a response whose prompt the server rendered otherwise than the target's chat template."""
        if problem:
            self.counts["template_mismatch"] += 1
            self.template_example = self.template_example or f"prompt '{rid}': {problem}"

    def fail(self, rid: str, reason: str, attempts: int) -> None:
        self.store.add_error(rid, reason, attempts)
        self.counts["failed"] += 1
        self.failures_in_a_row += 1
        self.meter.update(0, failed=self.counts["failed"])
        if self.failures_in_a_row >= self.max_failures_in_a_row:
            raise EaglekitError(
                f"generate: the last {self.failures_in_a_row} requests all failed; the last one: {reason}",
                "fix what the error says (see generate/errors.jsonl), then rerun with --retry-failed",
            )

    def check_gate(self) -> None:
        """Judge the held completions; write them if enough have reasoning, else stop the run."""
        n = len(self.held)
        records = [r for r, _ in self.held]
        empty = sum(not r["reasoning"] for r in records)
        seen = Counter(f for _, fields in self.held for f in fields)
        length = sum(r["finish_reason"] == "length" for r in records)
        self.gate = {
            "mode": self.mode,
            "checked": True,
            "samples": n,
            "empty_reasoning": empty,
            "empty_share": round(empty / n, 4),
            "max_empty_share": self.max_empty_share,
            "length_stopped": length,
            "fields_seen": dict(seen),
            "sources": dict(Counter(r["reasoning_source"] for r in records)),
            "passed": empty / n <= self.max_empty_share,
        }
        if not self.gate["passed"]:
            self.held = []
            fix = "the server or the config" if self.backend == "openai" else "the config (chat template, extra_body)"
            raise EaglekitError(
                f"generate: reasoning gate failed: {empty} of the first {n} responses have no reasoning "
                f"(at most {self.max_empty_share:.0%} may lack it): "
                f"{explain_missing_reasoning(seen, n, length, empty, self.backend)}. Nothing of this run was written.",
                f"fix {fix} as said, then rerun the same command; or set generate.reasoning: optional if this target "
                "really answers without reasoning",
            )
        for record, _ in self.held:
            self.store.add(record)
        self.held = []
        console.print(
            f"generate: reasoning gate passed ({n - empty}/{n} responses have reasoning; sources "
            f"{dict(self.gate['sources'])})"
        )

    def finish(self) -> None:
        """The run is out of work: a gate that never filled judges what it holds."""
        if self.held:
            self.check_gate()

    def rates(self) -> dict[str, float]:
        elapsed = max(time.monotonic() - self.t0, 1e-9)
        n = self.counts["new"]
        return {
            "seconds": round(elapsed, 2),
            "req_per_s": round(n / elapsed, 3),
            "output_tok_per_s": round(self.output_tokens / elapsed, 1),
            "mean_output_tokens": round(self.output_tokens / n, 1) if n else 0.0,
        }


# --- the backends' loops -----------------------------------------------------------------------------


async def generate_openai(cfg: RunConfig, pending: list[PromptRecord], collector: Collector, notes: list[str]) -> None:
    """Send every pending prompt; ``notes`` gets a line per server that was taken out of rotation."""
    queue = list(reversed(pending))
    served = ServedPrompts(cfg)  # each response's prompt tokens against the local rendering

    async with ChatClient(cfg.generate, api_key_from_env(cfg.generate.api_key_env, "generate.api_key_env")) as client:

        async def worker() -> None:
            while queue:
                prompt = queue.pop()
                try:
                    reply = await client.chat(prompt.messages)
                except RequestFailed as failure:
                    collector.fail(prompt.id, failure.reason, failure.attempts)
                    continue
                choice = reply.data["choices"][0]
                usage = reply.data.get("usage") or {}
                collector.served_prompt(prompt.id, served.check(prompt.messages, reply.data))
                collector.add(
                    *make_record(
                        prompt.id,
                        prompt.messages,
                        choice["message"],
                        choice.get("finish_reason"),
                        usage.get("prompt_tokens"),
                        usage.get("completion_tokens"),
                        reply.data.get("model") or cfg.generate.model or "",
                        reply.server,
                        choice.get("token_ids"),
                    )
                )

        capacity = sum(s.capacity for s in client.servers)
        tasks = [asyncio.create_task(worker()) for _ in range(min(capacity, len(pending)))]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                error = task.exception()
                if error is not None:
                    raise error
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            notes.extend(client.rotation_report())


def run(ctx: StageContext) -> dict:
    if ctx.cfg.data.traffic is not None:
        return take_traffic(ctx)
    prompt_set = run_prompts(ctx.cfg)
    mode, why = target_reasoning_mode(ctx.cfg)
    with ResponseStore(ctx.dir) as store:
        retried = store.forget_errors() if ctx.options.get("retry_failed") else 0
        asked = plan(prompt_set.records, store.keys, set())
        aside = store.set_aside(asked.set_aside)
        back = store.take_back({p.id: prompt_key(p.id, p.messages) for p in asked.pending})
        if aside or back:
            console.print(
                f"generate: {aside} replies to prompts no longer asked (or asked otherwise) moved to "
                f"{store.set_aside_path} (kept there; later stages read {RESPONSES} alone)"
                + (f"; {back} replies taken back from there for prompts asked again" if back else "")
            )
        existing = sum(p.id in store.done_ids for p in prompt_set.records)
        skipped_failed = {p.id for p in prompt_set.records if p.id in store.errors and p.id not in store.done_ids}
        pending = plan(prompt_set.records, store.keys, skipped_failed).pending
        console.print(
            f"generate: {prompt_set.summary()}; {existing} already done, {len(pending)} to generate"
            + (
                f", {len(skipped_failed)} failed before (skipped; --retry-failed retries them)"
                if skipped_failed
                else ""
            )
            + (f", retrying {retried} failed" if retried else "")
            + f"; reasoning {mode} ({why})"
        )
        notes: list[str] = []
        collector = collect(ctx, store, pending, mode, len(prompt_set.records), existing, notes)

    summary = summarize(ctx.dir)
    print_summary(summary, collector, ctx.ledger_extra["rates"], notes, store)
    mismatched = collector.counts["template_mismatch"]
    if mismatched:
        ctx.warn(
            f"{mismatched} of {collector.counts['new']} responses came from a prompt the server rendered otherwise "
            f"than the target's chat template ({collector.template_example}): training would learn on renderings "
            f"the target did not see; {TEMPLATE_REMEDY}"
        )
    return {
        **summary,
        "template_mismatch": mismatched,
        "new": collector.counts["new"],
        "skipped_existing": existing,
        "skipped_failed": len(skipped_failed),
        "set_aside": aside,
        "taken_back": back,
        "prompt_duplicates": prompt_set.duplicates,
        "bad_rows": len(prompt_set.bad_rows),
    }


def take_traffic(ctx: StageContext) -> dict:
    """The traffic's conversations into responses.jsonl without a request: those no longer taken set aside, the new
    ones appended (the kept lines stay byte for byte, so prepare tokenizes only the new); the rejected lines named."""
    read = traffic_checks.traffic_read(ctx)
    read.require_usable()
    rejects = [{"source": r.source, "why": r.why} for r in read.rejects]
    with ResponseStore(ctx.dir) as store:
        atomic.write_text(ctx.dir / TRAFFIC_REJECTS, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rejects))
        asked = replace(plan(traffic_prompts(read.samples), store.keys, set()), traffic=True)
        aside = store.set_aside(asked.set_aside)
        back = store.take_back({p.id: prompt_key(p.id, p.messages) for p in asked.pending})
        new = sum(store.add(s) for s in read.samples if s["id"] not in store.done_ids)
    console.print(f"generate: {read.summary()}")
    console.print(
        f"generate: {len(read.samples)} conversations of the traffic in {ctx.dir / RESPONSES} ({new + back} new, "
        f"{asked.kept} kept{f', {aside} no longer taken set aside' if aside else ''}); no server asked"
        + (f"; the rejected lines are named in {ctx.dir / TRAFFIC_REJECTS}" if rejects else "")
    )
    if len(read.rejects) > traffic_checks.REJECT_WARN_SHARE * read.lines:
        ctx.warn(f"{len(read.rejects)} of {read.lines} traffic lines rejected: {read.rejects_summary()}")
    ctx.ledger_extra["traffic"] = {
        "path": read.path,
        "lines": read.lines,
        "rejected": dict(Counter(r.reason for r in read.rejects)),
        "duplicates": read.duplicates,
        "left_out": read.left_out,
        "unchecked_model": read.unchecked_model,
        "unchecked_template": read.unchecked_template,
    }
    return {
        **summarize(ctx.dir),
        "new": new + back,
        "set_aside": aside,
        "taken_back": back,
        "traffic_lines": read.lines,
        "rejected": len(read.rejects),
        "duplicates": read.duplicates,
    }


def collect(
    ctx: StageContext,
    store: ResponseStore,
    pending: list[PromptRecord],
    mode: str,
    total: int,
    existing: int,
    notes: list[str],
) -> Collector:
    """The pending prompts' responses into ``store`` through the reasoning gate; the gate, the rates and the
    servers' notes go to the ledger even when interrupted."""
    from eaglekit.model.local_generation import generate_local  # lazy: heavy (torch)

    cfg, g = ctx.cfg, ctx.cfg.generate
    capacity = g.concurrency * max(1, len(g.servers))
    with Meter("generate", total=total, unit="req", initial=existing) as meter:
        collector = Collector(
            store,
            meter,
            mode,
            g.gate_samples,
            g.gate_max_empty_share,
            max_failures_in_a_row=max(g.gate_samples, 2 * capacity),
            backend=g.backend,
        )
        try:
            if pending and g.backend == "local":
                generate_local(cfg, pending, collector.add)
            elif pending:
                asyncio.run(generate_openai(cfg, pending, collector, notes))
            collector.finish()
        except KeyboardInterrupt:
            held = len(collector.held)
            console.print(
                f"[yellow]generate: interrupted; {len(store.done_ids)} samples are on disk"
                + (f" ({held} completions still held for the reasoning gate were dropped)" if held else "")
                + "; rerun the same command to resume[/]"
            )
            raise
        finally:
            if collector.gate is not None:
                ctx.ledger_extra["gate"] = collector.gate
            ctx.ledger_extra["rates"] = collector.rates()
            if notes:
                ctx.ledger_extra["servers"] = notes
    return collector


def print_summary(summary: dict, collector: Collector, rates: dict, notes: list[str], store: ResponseStore) -> None:
    for note in notes:
        console.print(f"[yellow]generate: {note}[/]")
    console.print(
        f"generate: {summary['done']} samples ({collector.counts['new']} new, {rates['req_per_s']} req/s, "
        f"{rates['output_tok_per_s']} output tok/s, mean {summary['mean_output_tokens']} tokens); "
        f"reasoning sources {summary['reasoning_sources']}; no reasoning {summary['empty_reasoning']}, "
        f"empty content {summary['empty_content']}, think tags left in content {summary['leftover_think']}, "
        f"stopped at max_tokens {summary['length_share']:.1%}, identical replies {summary['duplicate_replies']}"
    )
    if summary["failed"]:
        console.print(
            f"[yellow]generate: {summary['failed']} samples failed (reasons in {store.errors_path}); "
            f"retry them with `eaglekit generate CONFIG --retry-failed`[/]"
        )


def data_flags(counts: dict) -> list[str]:
    """Bad data the recorded figures show (`eaglekit status`)."""
    flags = []
    done = counts.get("done") or 0
    if counts.get("empty_reasoning"):
        flags.append(f"{counts['empty_reasoning']} of {done} responses have empty reasoning")
    if counts.get("leftover_think"):
        flags.append(
            f"{counts['leftover_think']} of {done} replies keep think tags in their content (reasoning not separated)"
        )
    if counts.get("template_mismatch"):
        flags.append(
            f"{counts['template_mismatch']} responses from prompts the server rendered otherwise than the target's "
            "chat template"
        )
    if counts.get("failed"):
        flags.append(f"{counts['failed']} samples failed (`eaglekit generate CONFIG --retry-failed` retries them)")
    if counts.get("rejected"):
        flags.append(
            f"{counts['rejected']} of {counts.get('traffic_lines', '?')} traffic lines rejected (generate/"
            f"{TRAFFIC_REJECTS} names each, the run's output says why)"
        )
    return flags


STAGE = Stage(
    name=NAME,
    upstream=UPSTREAM,
    reads="data.prompts, and the target (in process) or its OpenAI-compatible servers; or data.traffic, a gateway log",
    writes="generate/responses.jsonl, generate/errors.jsonl",
    params=params,
    checks=checks,
    run=run,
    estimate=estimate,
    kept=kept,
    continues=continues,
    live_counts=live_counts,
    data_flags=data_flags,
)
