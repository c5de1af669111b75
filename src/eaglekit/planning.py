"""`eaglekit plan`: before committing days of GPU time, what each stage will take and whether it fits.

Per stage: the time, the bytes it writes, the peak disk use of the run directory once it has written them
(everything the run keeps), the write rate it needs against the rate the disk was probed at, and a verdict —
fits / does not fit / unknown — with the arithmetic shown. Every figure says where it comes from:

    measured   this run directory's ledger and outputs: a pilot (the same config with data.max_samples at
               10 or 1,000) measures the generation rate, the reply and sample lengths, the extract and
               training rates — then `plan --samples 25000` scales them to the real run
    flag       given on the command line (--samples, --mean-tokens, --gen-tok-per-s, ...)
    config     read from the run config or the target's config.json
    counted    counted in the files (the prompts' rows), or probed (free space, write rate)
    assumed    a stand-in, said as such (e.g. every sample as long as prepare.max_length)

When the run does not fit, the alternatives are computed: streamed features (``extract.mode: stream``: the disk is
the spool, the time the slower of the trainer and the vLLM servers), online features (nothing stored), 8-bit
features, and how many samples would fit; the first that fits is recommended.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from eaglekit import pipeline
from eaglekit.config import RunConfig
from eaglekit.contract import Sizes
from eaglekit.data.shard_files import bytes_per_token
from eaglekit.data.traffic import log_files
from eaglekit.errors import EaglekitError
from eaglekit.preflight.dataset import count_rows
from eaglekit.preflight.disk import existing_ancestor, probe_write_rate
from eaglekit.progress import format_duration, human_bytes
from eaglekit.resolved import ResolvedRun
from eaglekit.rundir import RunDir


@dataclass
class Figure:
    value: float | None
    source: str  # "measured: …", "flag …", "config …", "counted: …", "assumed: …", or why it is unknown

    @property
    def known(self) -> bool:
        return self.value is not None


@dataclass
class StagePlan:
    stage: str
    done: bool  # finished with this config's fingerprint: nothing left to write or wait for
    bytes: float | None = None
    per_sample_bytes: float | None = None  # the part of `bytes` that scales with the number of samples
    fixed_bytes: float | None = None  # the rest
    seconds: float | None = None
    peak_bytes: float | None = None
    need_write_rate: float | None = None
    verdict: str = "unknown"
    how: list[str] = field(default_factory=list)


def parse_bytes(text: str) -> int:
    """'2.8TB', '2.8 T', '2.5TiB', '2800000000000' -> bytes (decimal units unless the unit says 'i')."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgtp]?)(i?)b?\s*", text.lower())
    if not m:
        raise ValueError(f"not a size: {text!r} (e.g. 2.8TB, 500GB, 2.5TiB or a number of bytes)")
    power = "_kmgtp".index(m.group(2) or "_")
    return int(float(m.group(1)) * (1024 if m.group(3) else 1000) ** power)


# ----------------------------------------------------------------------------------------------- inputs


def _ledger_end(run: RunDir, stage: str) -> dict:
    end = (run.last_events().get(stage) or {}).get("end") or {}
    return end if end.get("state") == "done" else {}


def _when(end: dict) -> str:
    return f"{end.get('ts', '?')[:16]}"


def _target_shape(cfg: RunConfig) -> dict[str, Figure]:
    """hidden size and layers from the target's config.json (no weights needed, never a download)."""
    path = Path(cfg.target.model) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        why = f"unknown: {cfg.target.model} has no readable config.json here"
        return {"hidden_size": Figure(None, why), "num_hidden_layers": Figure(None, why)}
    text = config.get("text_config") or config
    return {k: Figure(text.get(k) or config.get(k), f"config: {path}") for k in ("hidden_size", "num_hidden_layers")}


def _pick(flag_value: float | None, flag: str, measured: tuple[float | None, str], otherwise: Figure) -> Figure:
    """A figure from its flag, else from this run's measurement, else ``otherwise`` (assumed or unknown)."""
    if flag_value is not None:
        return Figure(flag_value, f"flag {flag}")
    if measured[0]:
        return Figure(measured[0], f"measured: {measured[1]}")
    return otherwise


def traffic_samples(traffic) -> Figure:
    """At most the traffic log's lines (each a conversation), capped by data.traffic.newest and max_samples."""
    try:
        rows = sum(count_rows(f)[0] or 0 for f in log_files(traffic.path))
    except (EaglekitError, OSError):
        return Figure(None, f"unknown: pass --samples ({traffic.path} unreadable)")
    caps = [c for c in (traffic.newest, traffic.max_samples) if c]
    return Figure(
        min([rows, *caps]),
        f"counted: at most {rows:,} lines in {traffic.path}" + (f", capped at {min(caps):,}" if caps else ""),
    )


def gather_inputs(
    cfg: RunConfig,
    samples: int | None = None,
    mean_tokens: float | None = None,
    gen_tok_per_s: float | None = None,
    extract_tok_per_s: float | None = None,
    train_tok_per_s: float | None = None,
    free_bytes: int | None = None,
    write_bytes_per_s: float | None = None,
) -> dict[str, Figure]:
    run = RunDir(cfg.run_dir)
    gen, prep = _ledger_end(run, "generate"), _ledger_end(run, "prepare")
    ext, trn = _ledger_end(run, "extract"), _ledger_end(run, "train")
    inputs: dict[str, Figure] = {}

    # samples: the flag, else the config's cap on what the prompts file holds
    if samples is not None:
        inputs["samples"] = Figure(samples, "flag --samples")
    elif cfg.data.traffic is not None:
        inputs["samples"] = traffic_samples(cfg.data.traffic)
    else:
        try:
            rows, how = count_rows(Path(cfg.data.prompts or ""))  # one of prompts and traffic is set
        except OSError:
            rows, how = None, "unreadable"
        cap = cfg.data.max_samples
        if rows is not None:
            n = min(rows, cap) if cap else rows
            inputs["samples"] = Figure(
                n,
                f"counted: {rows:,} rows in {cfg.data.prompts} ({how})"
                + (f", capped by data.max_samples {cap:,}" if cap and cap < rows else ""),
            )
        elif cap:
            inputs["samples"] = Figure(cap, "config: data.max_samples (the prompts' rows could not be counted)")
        else:
            inputs["samples"] = Figure(None, f"unknown: pass --samples ({cfg.data.prompts}: {how})")

    # tokens per sample (prompt + reply, as trained)
    counts = prep.get("counts") or {}
    inputs["mean_tokens"] = _pick(
        mean_tokens,
        "--mean-tokens",
        (counts.get("mean_length"), f"prepare of this run, {counts.get('samples', '?')} samples ({_when(prep)})"),
        Figure(
            cfg.prepare.max_length,
            "assumed: every sample as long as prepare.max_length (an upper bound; pass --mean-tokens)",
        ),
    )
    rates = gen.get("rates") or {}
    inputs["output_tokens"] = _pick(
        None,
        "",
        (rates.get("mean_output_tokens"), f"generate of this run ({_when(gen)})"),
        Figure(
            min(cfg.generate.max_tokens, inputs["mean_tokens"].value or cfg.prepare.max_length),
            "assumed: min(generate.max_tokens, tokens per sample)",
        ),
    )
    inputs["gen_tok_per_s"] = _pick(
        gen_tok_per_s,
        "--gen-tok-per-s",
        (
            rates.get("output_tok_per_s"),
            f"generate of this run, {(gen.get('counts') or {}).get('new', '?')} samples ({_when(gen)})",
        ),
        Figure(None, "unknown: run a pilot generate or pass --gen-tok-per-s"),
    )
    ext_counts = ext.get("counts") or {}
    trn_counts = trn.get("counts") or {}
    streamed = (trn_counts.get("stream") or {}).get("server_tokens_per_s")  # a streamed pilot's servers
    inputs["extract_tok_per_s"] = _pick(
        extract_tok_per_s,
        "--extract-tok-per-s",
        (ext_counts.get("tokens_per_s"), f"extract of this run, {ext_counts.get('tokens', '?')} tokens ({_when(ext)})")
        if ext_counts.get("tokens_per_s") or not streamed
        else (streamed, f"the servers' feature rate in this run's streamed train ({_when(trn)})"),
        Figure(None, "unknown: run a pilot extract or pass --extract-tok-per-s"),
    )
    trained = (
        trn_counts["tokens"] / trn_counts["seconds"] if trn_counts.get("tokens") and trn_counts.get("seconds") else None
    )
    inputs["train_tok_per_s"] = _pick(
        train_tok_per_s,
        "--train-tok-per-s",
        (trained, f"train of this run, {trn_counts.get('steps', '?')} steps ({_when(trn)})"),
        Figure(None, "unknown: run a pilot train or pass --train-tok-per-s"),
    )

    where = existing_ancestor(Path(cfg.run_dir))
    if free_bytes is not None:
        inputs["free_bytes"] = Figure(free_bytes, "flag --free-bytes")
    else:
        st = os.statvfs(where)
        inputs["free_bytes"] = Figure(st.f_bavail * st.f_frsize, f"counted: free on {where} (statvfs)")
    if write_bytes_per_s is not None:
        inputs["write_bytes_per_s"] = Figure(write_bytes_per_s, "flag --write-mb-per-s")
    elif cfg.preflight.disk_probe_mb and os.access(where, os.W_OK):
        written, seconds = probe_write_rate(
            where, int(cfg.preflight.disk_probe_mb * 1e6), cfg.preflight.disk_probe_seconds
        )
        inputs["write_bytes_per_s"] = Figure(
            written / max(seconds, 1e-9),
            f"counted: {human_bytes(written)} written and fsynced into {where} in {seconds:.2f} s",
        )
    else:
        inputs["write_bytes_per_s"] = Figure(
            None, "unknown: the write probe is off (preflight.disk_probe_mb: 0) or the folder is not writable"
        )
    inputs.update(_target_shape(cfg))
    return inputs


# ----------------------------------------------------------------------------------------------- stages


def stage_plans(
    cfg: RunConfig, inputs: dict[str, Figure], extract_dtype: str | None = None, mode: str | None = None
) -> list[StagePlan]:
    """Each stage's bytes and time (the stage's own ``estimate``) and the peak disk of the run so far;
    ``extract_dtype`` / ``mode`` replan an alternative."""
    planned = cfg.model_copy(deep=True)
    planned.extract.mode = mode or cfg.extract.mode  # type: ignore[assignment]
    run = RunDir(cfg.run_dir)
    figures = {name: fig.value for name, fig in inputs.items()}
    plans = []
    resolved = ResolvedRun(planned)  # the plan resolves the run once: every stage's estimate reads it
    for stage in pipeline.stages_for(planned):
        ctx = pipeline.make_context(planned, stage, resolved=resolved)  # an alternative's mode reaches the estimates
        sizes = Sizes(
            samples=figures["samples"],
            mean_tokens=figures["mean_tokens"],
            output_tokens=figures["output_tokens"],
            hidden_size=figures["hidden_size"],
            gen_tok_per_s=figures["gen_tok_per_s"],
            extract_tok_per_s=figures["extract_tok_per_s"],
            train_tok_per_s=figures["train_tok_per_s"],
            write_bytes_per_s=figures["write_bytes_per_s"],
            dtype=extract_dtype or cfg.extract.dtype,
            ledger_end=_ledger_end(run, stage),
        )
        est = ctx.stage_def.estimate(ctx, sizes)
        p = StagePlan(
            stage,
            done=run.done_fingerprint(stage) == ctx.fingerprint,
            bytes=est.bytes,
            per_sample_bytes=est.per_sample_bytes,
            seconds=est.seconds,
            need_write_rate=est.need_write_rate,
            how=list(est.how),
        )
        if p.bytes is not None:
            p.fixed_bytes = p.bytes - (p.per_sample_bytes or 0) * (sizes.samples or 0)
        plans.append(p)

    free = inputs["free_bytes"].value
    peak, unknown = 0.0, False
    for p in plans:
        if p.done:
            p.verdict, p.peak_bytes = "fits", peak  # its files are on disk already: counted in the free space
            p.how.insert(0, "done: its files are already on disk")
            continue
        if p.bytes is None:
            unknown = True
        else:
            peak += p.bytes
        p.peak_bytes = None if unknown else peak
        if unknown or free is None:
            p.verdict = "unknown"
        else:
            p.verdict = "fits" if peak <= free else "does not fit"
    return plans


# ------------------------------------------------------------------------------------------ alternatives


def samples_that_fit(plans: list[StagePlan], free: float) -> int | None:
    """How many samples fit: free space minus what does not scale with samples, over the bytes per sample."""
    pending = [p for p in plans if not p.done]
    if any(p.bytes is None for p in pending):
        return None
    per_sample = sum(p.per_sample_bytes or 0 for p in pending)
    fixed = sum(p.fixed_bytes or 0 for p in pending)
    if per_sample <= 0:
        return None
    return max(0, int((free - fixed) // per_sample))


def _total_peak(plans: list[StagePlan]) -> float | None:
    pending = [p for p in plans if not p.done]
    return None if any(p.bytes is None for p in pending) else sum(p.bytes or 0 for p in pending)


def alternatives(cfg: RunConfig, inputs: dict[str, Figure], plans: list[StagePlan]) -> list[dict[str, Any]]:
    free, n = inputs["free_bytes"].value, inputs["samples"].value
    assert free is not None, "a run that does not fit has a known free space"
    out = []

    def option(title: str, how: str, alt: list[StagePlan], extra: str = "") -> dict[str, Any]:
        peak = _total_peak(alt)
        fit_n = samples_that_fit(alt, free)
        verdict = "unknown" if peak is None else ("fits" if peak <= free else "does not fit")
        detail = (
            f"peak {human_bytes(peak)} of {human_bytes(free)} free: {verdict}" if peak is not None else "peak unknown"
        )
        if verdict == "does not fit" and fit_n is not None:
            detail += f"; {fit_n:,} samples would fit"
        return {
            "option": title,
            "how": how,
            "peak_bytes": peak,
            "verdict": verdict,
            "samples_that_fit": fit_n,
            "detail": detail + extra,
        }

    if cfg.extract.offline:
        alt = stage_plans(cfg, inputs, mode="stream")
        spool = cfg.extract.stream.spool_gb
        train = next((p for p in alt if p.stage == "train"), None)
        out.append(
            option(
                "stream features",
                f"extract.mode: stream, extract.backend: vllm (train asks the vLLM feature servers for each batch's "
                f"hidden states; disk: the spool, extract.stream.spool_gb: {spool:g})",
                alt,
                f"; train {format_duration(train.seconds)}, {train.how[-1].removeprefix('time: ')}"
                if train is not None and train.seconds is not None
                else "; time: the slower of the trainer and the servers (a rate is unknown)",
            )
        )
        alt = stage_plans(cfg, inputs, mode="online")
        forward = inputs["extract_tok_per_s"].value
        extra = ""
        if forward and n and inputs["mean_tokens"].value:
            trained = n * inputs["mean_tokens"].value * (1 - cfg.data.eval_fraction) * cfg.train.epochs
            extra = f"; training then runs the target too: + {format_duration(trained / forward)} of its forward"
        out.append(
            option("online features", "extract.mode: online (the target runs inside train; nothing stored)", alt, extra)
        )
        if cfg.extract.dtype != "fp8" and inputs["hidden_size"].value:
            alt = stage_plans(cfg, inputs, extract_dtype="fp8")
            h = int(inputs["hidden_size"].value)
            out.append(
                option(
                    "8-bit features",
                    f"extract.dtype: fp8 ({bytes_per_token(h, 'fp8'):,} B/token instead of "
                    f"{bytes_per_token(h, cfg.extract.dtype):,})",
                    alt,
                )
            )
    fit_n = samples_that_fit(plans, free)
    if fit_n is not None and n:
        out.append(
            {
                "option": "fewer samples",
                "how": f"data.max_samples: {fit_n:,} (or --samples {fit_n:,} to replan)",
                "peak_bytes": None,
                "verdict": "fits" if fit_n > 0 else "does not fit",
                "samples_that_fit": fit_n,
                "detail": f"{fit_n:,} of {int(n):,} samples fit in {human_bytes(free)}",
            }
        )
    peak = _total_peak(plans)
    if peak is not None and peak > free:
        out.append(
            {
                "option": "a larger volume",
                "how": "point run_dir at a volume with more free space",
                "peak_bytes": peak,
                "verdict": "fits",
                "samples_that_fit": None,
                "detail": f"{human_bytes(peak - free)} more free space (peak {human_bytes(peak)})",
            }
        )
    return out


# ------------------------------------------------------------------------------------------------- plan


def plan(cfg: RunConfig, **overrides: Any) -> dict[str, Any]:
    """The whole plan as one JSON-able document (what `eaglekit plan --json` prints)."""
    inputs = gather_inputs(cfg, **overrides)
    plans = stage_plans(cfg, inputs)
    verdicts = [p.verdict for p in plans]
    overall = "does not fit" if "does not fit" in verdicts else ("unknown" if "unknown" in verdicts else "fits")
    free, disk_rate = inputs["free_bytes"].value, inputs["write_bytes_per_s"].value
    known_times = [p.seconds for p in plans if not p.done and p.seconds is not None]
    options = alternatives(cfg, inputs, plans) if overall == "does not fit" else []
    doc = {
        "run_dir": cfg.run_dir,
        "verdict": overall,
        "inputs": {k: asdict(v) for k, v in inputs.items()},
        "stages": [asdict(p) | {"write_rate_probed": disk_rate if p.need_write_rate else None} for p in plans],
        "peak_bytes": _total_peak(plans),
        "free_bytes": free,
        "seconds_known": sum(known_times),
        "stages_without_time": [p.stage for p in plans if not p.done and p.seconds is None],
        "alternatives": options,
        "recommendation": recommendation(options),
    }
    return doc


def recommendation(options: list[dict[str, Any]]) -> str | None:
    """The first alternative that fits, in the order they are listed: streaming before online features (a large
    target cannot run inside the training process), both before fewer samples."""
    best = next((a for a in options if a["verdict"] == "fits" and a["peak_bytes"] is not None), None)
    return None if best is None else f"{best['option']}: {best['how']} ({best['detail']})"


def render(doc: dict[str, Any]):
    """The plan for a terminal: the inputs and their sources, a table per stage, the alternatives."""
    inputs = Table(title="plan: inputs", show_header=True)
    for col in ("figure", "value", "source"):
        inputs.add_column(col, overflow="fold")
    fmt = {"free_bytes": human_bytes, "write_bytes_per_s": lambda v: f"{human_bytes(v)}/s"}
    for name, fig in doc["inputs"].items():
        value = (
            "?"
            if fig["value"] is None
            else fmt.get(name, lambda v: f"{v:,.0f}" if v >= 100 else f"{v:g}")(fig["value"])
        )
        inputs.add_row(name, value, escape(fig["source"]))

    stages = Table(title=f"plan: {doc['run_dir']}", show_lines=True)
    for col in ("stage", "writes", "peak disk", "time", "write rate need / probed", "verdict", "arithmetic"):
        stages.add_column(col, overflow="fold")
    style = {"fits": "green", "does not fit": "bold red", "unknown": "yellow"}
    for s in doc["stages"]:
        rate = (
            f"{human_bytes(s['need_write_rate'])}/s / {human_bytes(s['write_rate_probed'])}/s"
            if s["need_write_rate"] and s["write_rate_probed"]
            else (f"{human_bytes(s['need_write_rate'])}/s / ?" if s["need_write_rate"] else "")
        )
        stages.add_row(
            s["stage"],
            "-" if s["done"] else (human_bytes(s["bytes"]) if s["bytes"] is not None else "?"),
            human_bytes(s["peak_bytes"]) if s["peak_bytes"] is not None else "?",
            "-" if s["done"] else (format_duration(s["seconds"]) if s["seconds"] is not None else "?"),
            rate,
            f"[{style[s['verdict']]}]{s['verdict']}[/]",
            escape("\n".join(s["how"])),
        )
    lines: list[Any] = [inputs, stages]
    peak = doc["peak_bytes"]
    summary = (
        f"verdict: {doc['verdict']} — peak {human_bytes(peak) if peak is not None else '?'} "
        f"of {human_bytes(doc['free_bytes'])} free"
    )
    if doc["seconds_known"]:
        summary += f"; time {format_duration(doc['seconds_known'])}"
    if doc["stages_without_time"]:
        summary += f" (+ {', '.join(doc['stages_without_time'])}: no rate yet)"
    lines.append(Text(summary, style=style[doc["verdict"]]))
    if doc.get("recommendation"):
        lines.append(Text(f"recommended: {doc['recommendation']}", style="green"))
    if doc["alternatives"]:
        alt = Table(title="alternatives", show_lines=False)
        for col in ("option", "how", "result"):
            alt.add_column(col, overflow="fold")
        for a in doc["alternatives"]:
            alt.add_row(a["option"], escape(a["how"]), escape(a["detail"]))
        lines.append(alt)
    return Group(*lines)
