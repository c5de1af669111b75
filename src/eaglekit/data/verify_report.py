"""verify's report (verify/report.json) as Markdown, as the console summary, as the failure message and as the
ledger's counts: written by verify, read by whoever reads its outputs."""

from __future__ import annotations

# The likely causes of a served drafter accepting less than offline, in order of how often each has made one
# collapse (sglang#25454, #32334; vllm#43671, ...): verify's diagnosis checks them and the report lists them so.
CAUSES = (
    "aux-layer ids",
    "norm_before_residual",
    "rope / max_position_embeddings",
    "d2t offsets",
    "embedding sharing",
    "EAGLE 3.1 flags",
)
# An engine release that loads the drafter but does not read one of its features (serving/engine_features.py).
ENGINE_DROPS = "engine drops a trained feature"
KNOWN_DEFECT = "known engine defect"
# The engine's speculative settings (rejection and draft sampling, a K schedule, the drafter's own kernels): not the
# drafter's, so any family's (verify's settings_cause, serving/engine_settings.py).
ENGINE_SETTINGS = "engine speculative settings"
# The block drafters' (DFlash, DSpark) own causes, in the order drafters/block_diagnosis.BLOCK_DIAGNOSIS checks them.
BLOCK_CAUSES = (
    "target_layer_ids",
    "mask token / block size",
    CAUSES[2],  # rope / max_position_embeddings
    "DSpark block-slot convention",
    KNOWN_DEFECT,
    ENGINE_DROPS,
)
ORDER = tuple(dict.fromkeys((*CAUSES, ENGINE_DROPS, *BLOCK_CAUSES, ENGINE_SETTINGS)))


def verdict_counts(report: dict) -> dict:
    counts = {"verdict": report["verdict"], "engine": report["engine"], "prompts": report["prompts"]}
    for r in report["runs"]:
        counts[f"tau_{r['form']}_k{r['k']}"] = f"served {r['tau']['served']:.3f} / offline {r['tau']['offline']:.3f}"
        for label, g in (r.get("tau_by_context") or {}).items():
            if g["served"] and g["offline"]:
                counts[f"tau_{r['form']}_k{r['k']}_{label}"] = (
                    f"served {g['served']['tau']:.3f} / offline {g['offline']['tau']:.3f}"
                )
        for s in r.get("suites") or []:
            counts[f"tau_{r['form']}_k{r['k']}_{s['suite']}_{s['mode']}"] = (
                f"served {s['served_tau']:.3f} / offline {s['offline_tau']:.3f}"
            )
    return counts


def likely_causes(report: dict) -> list[dict]:
    """The diagnosis rows of all served folders, suspects first, each group in the usual order."""
    rows = [dict(row, folder=name) for name, rows in report["diagnosis"].items() for row in rows]
    return sorted(rows, key=lambda r: (r["status"] != "suspect", ORDER.index(r["cause"])))


def failure_message(report: dict) -> str:
    bad = [r for r in report["runs"] if not r["passed"]]
    parts = []
    for r in bad:
        failed = [name for name, good in r["checks"].items() if not good]
        parts.append(
            f"{r['form']} K={r['k']}: τ served {r['tau']['served']:.3f} vs offline {r['tau']['offline']:.3f}, "
            f"largest position difference {r['largest_position_difference']:.3f}, greedy identical "
            f"{r['greedy']['identical']}/{r['greedy']['prompts']} (failed: {', '.join(failed)})"
        )
    suspects = [r for r in likely_causes(report) if r["status"] == "suspect"]
    if suspects:
        cause = "; ".join(f"{s['cause']} ({s['folder']}): {s['detail']}" for s in suspects)
        if not bad:
            taus = ", ".join(
                f"{r['form']} K={r['k']} τ served {r['tau']['served']:.3f} vs offline {r['tau']['offline']:.3f}"
                for r in report["runs"]
            )
            return (
                f"verify: FAIL — acceptance agrees on these {report['prompts']} prompts ({taus}), but the engine "
                f"reads a config that differs from the trained drafter. Likely cause: {cause}"
            )
        return f"verify: FAIL — {' | '.join(parts)}. Likely cause: {cause}"
    checked = [cause for cause in ORDER if any(r["cause"] == cause for r in likely_causes(report))]
    return (
        f"verify: FAIL — {' | '.join(parts)}. The exported config.json reads as trained; check in order: "
        + ", ".join(checked or CAUSES)
        + ", then the engine's numerics (dtype) and version"
    )


def report_markdown(report: dict, summary_only: bool = False) -> str:
    """The whole report (report.md), or with ``summary_only`` the verdict and the τ tables the console shows."""
    tables = runs_table(report) + suites_table(report) + context_table(report)
    if summary_only:
        return "\n".join([f"verify: **{report['verdict']}**", ""] + tables) + "\n"
    lines = header(report) + tables
    for r in report["runs"]:
        lines += run_section(r)
    lines += diagnosis_section(report)
    lines += ["", "![served vs offline acceptance by position](acceptance.png)"]
    return "\n".join(lines) + "\n"


CARD_HEADING = "## Served (eaglekit verify)"  # a model card's section of verify's figures (export's, publish's)


def card_markdown(report: dict, form: str | None = None) -> str:
    """A model card's section: the engine and its version, the τ tables, and the speculative settings each run of
    ``form`` (all forms: None) was served with."""
    engine = report.get("engine_version") or report.get("engine") or "the engine"
    measured = (
        f" — {report['prompts']} prompts, up to {report['max_new_tokens']} new tokens, T=0"
        if "prompts" in report and "max_new_tokens" in report
        else ""
    )
    lines = [
        CARD_HEADING,
        "",
        f"verify: **{report['verdict']}** in {engine}{measured}; served τ against eaglekit's offline τ on the same "
        "prompts.",
        "",
    ]
    lines += runs_table(report) + suites_table(report) + context_table(report)
    for r in report["runs"]:
        if form is None or r["form"] == form:
            settings = [line for line in settings_lines(r) if line]
            if settings:
                lines += ["", f"{r['form']}, K={r['k']}:", ""] + settings
    return "\n".join(lines) + "\n"


def header(report: dict) -> list[str]:
    tol = report["tolerance"]
    engine = report.get("engine_version") or report["engine"]
    return [
        "# Verify: served acceptance against offline acceptance",
        "",
        f"**{report['verdict']}** — {engine}, "
        + (f"server {report['server']}" if report["server"] else "started by eaglekit for each form and K")
        + f"; {report['prompts']} prompts sent as token ids, up to {report['max_new_tokens']} new tokens, T=0; "
        f"offline: eaglekit's decode loop with the trained checkpoint ({report['offline_dtype']}), counted as "
        "the engine counts.",
        "",
        f"Pass: |τ served − τ offline| ≤ {tol['tau_relative']:.0%} of τ offline, every draft position within "
        f"{tol['position']:.2f}, served greedy output = plain greedy decoding on at least "
        f"{1 - tol['greedy_share']:.0%} of the prompts, and the engine reads the config the drafter was trained "
        "with (no suspect in the diagnosis below).",
        "",
    ]


def runs_table(report: dict) -> list[str]:
    lines = [
        "| form | K | τ served | τ offline | largest position Δ | greedy identical | result |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        lines.append(
            f"| {r['form']} | {r['k']} | {r['tau']['served']:.3f} | {r['tau']['offline']:.3f} | "
            f"{r['largest_position_difference']:.3f} | {r['greedy']['identical']}/{r['greedy']['prompts']} | "
            f"{'pass' if r['passed'] else '**FAIL**'} |"
        )
    return lines


def suites_table(report: dict) -> list[str]:
    suite_rows = [(r, s) for r in report["runs"] for s in r.get("suites") or []]
    if not suite_rows:
        return []
    return [
        "",
        "Per benchmark suite (served = offline within the τ tolerance; each suite sent as a batch of its own):",
        "",
        "| suite | mode | form | K | prompts | τ served | τ offline | relative Δ | result |",
        "|---|---|---|---|---|---|---|---|---|",
    ] + [
        f"| {s['suite']} | {s['mode']} | {r['form']} | {r['k']} | {s['prompts']} | {s['served_tau']:.3f} | "
        f"{s['offline_tau']:.3f} | {s['relative_difference']:.2%} | {'pass' if s['passed'] else '**FAIL**'} |"
        for r, s in suite_rows
    ]


def context_table(report: dict) -> list[str]:
    """τ by context group, served beside offline (vLLM's per-request metrics: the passes of each request placed
    where they drafted), for the runs whose prompts span more than one group."""
    rows = [(r, label, g) for r in report["runs"] for label, g in (r.get("tau_by_context") or {}).items()]
    if not rows:
        return []

    def cell(figures: dict | None) -> str:
        return f"{figures['tau']:.3f} ({figures['rounds']})" if figures else "–"

    return [
        "",
        "By context length (τ, verify passes in brackets; a pass belongs to the group where its draft starts):",
        "",
        "| form | K | context | τ served | τ offline |",
        "|---|---|---|---|---|",
    ] + [f"| {r['form']} | {r['k']} | {label} | {cell(g['served'])} | {cell(g['offline'])} |" for r, label, g in rows]


def run_section(r: dict) -> list[str]:
    """One form and K: how the engine started, acceptance by position, drafts, verify passes, greedy outputs."""
    lines = [
        "",
        f"## {r['form']}, K={r['k']}",
        "",
        f"Started as: `{r['launch']}`"
        + (f" (log `{r['log']}`)" if r["log"] else "")
        + (f"; attention backend {', '.join(r['attention_backends'])}" if r.get("attention_backends") else ""),
        "",
    ]
    lines += settings_lines(r)
    if r["positions"]:
        lines += ["| draft position | served acceptance | offline acceptance | difference |", "|---|---|---|---|"]
        lines += [
            f"| {p['position']} | {p['served']:.3f} | {p['offline']:.3f} | {p['difference']:+.3f} |"
            for p in r["positions"]
        ]
    lines += [
        "",
        f"Drafts (verify passes with drafts): served {r['served']['drafts']}, offline "
        f"{r['offline']['drafts']}; accepted per position: served {r['served']['accepted']}, offline "
        f"{r['offline']['accepted']}.",
    ]
    if r["rounds"]:
        lines.append(
            f"Per request, the accepted count of every verify pass equals eaglekit's on "
            f"{r['rounds']['identical']}/{r['rounds']['compared']} prompts."
        )
    for d in r["greedy"]["differing"][:5]:
        lines.append(
            f"- prompt {d['id']}: served output differs from plain greedy decoding at token {d['first_difference']}"
        )
    return lines


def settings_lines(r: dict) -> list[str]:
    """The speculative settings the engine served with, each with where it was read, and the drafts per verify pass
    its counters show (reports written before verify recorded them have none)."""
    recorded = r.get("engine_settings") or {}
    settings = recorded.get("settings") or {}
    lines = []
    if settings:
        lines.append(
            "Engine speculative settings: "
            + ", ".join(f"`{k}` {v['value']!r} ({v['source']})" for k, v in settings.items() if k != "model")
            + "."
        )
    elif recorded:
        lines.append(
            "Engine speculative settings: not exposed by this server (vLLM answers /server_info with "
            "VLLM_SERVER_DEV_MODE=1 only); its counters are read."
        )
    if r.get("drafts_per_pass") is not None:
        lines.append(f"Drafts per verify pass (the engine's counters): {r['drafts_per_pass']:.2f} of K={r['k']}.")
    lines += [f"- {e['setting']}: {e['detail']}" for e in r.get("setting_effects") or []]
    return lines + ([""] if lines else [])


def diagnosis_section(report: dict) -> list[str]:
    lines = [
        "",
        "## The exported config as the engine reads it",
        "",
        "Likely causes of a served drafter accepting less than offline, in order:",
        "",
        "| folder | cause | status | detail |",
        "|---|---|---|---|",
    ]
    for row in likely_causes(report):
        lines.append(
            f"| {row['folder']} | {row['cause']} | {'**suspect**' if row['status'] == 'suspect' else 'ok'} "
            f"| {row['detail']} |"
        )
    return lines
