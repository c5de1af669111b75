"""evaluate's report (evaluate/report.json) as Markdown: read by evaluate and by export, which ships it."""

from __future__ import annotations

METHODS = ("eagle", "eagle_start", "ngram")  # eagle_start: the drafter train.init_from started from


METHOD_NAMES = {"eagle": "eagle", "eagle_start": "eagle (init_from, untouched)", "ngram": "ngram"}


def report_markdown(report: dict, tables_only: bool = False) -> str:
    results, temperatures = report["results"], report["temperatures"]
    ks = report["num_speculative_tokens"]
    by = {(r["method"], r["k"], r["temperature"]): r for r in results}
    lines = (
        []
        if tables_only
        else [
            "# Evaluation",
            "",
            f"Drafter `{report['checkpoint']}` ({report['checkpoint_form']} form) on target `{report['target']}`, "
            f"{report['prompts']} prompts, up to {report['max_new_tokens']} new tokens, {report['device']} {report['dtype']}. "
            f"Chain drafting, {report['draft_selection']}; n-gram = vLLM's `ngram` "
            f"(n {report['ngram']['min']}..{report['ngram']['max']}).",
            "",
            "τ = tokens emitted per target verify pass, bonus token included (1 ≤ τ ≤ K+1); speedup = tokens/s "
            "against plain decoding with the same target and cache. Compare τ only at equal K.",
            "",
        ]
    )
    head = "| method | K | " + " | ".join(f"τ T={t:g} | speedup T={t:g}" for t in temperatures) + " |"
    lines += [head, "|" + "---|" * (2 + 2 * len(temperatures))]
    methods = [m for m in METHODS if any(r["method"] == m for r in results)]
    for method in methods:
        for k in ks:
            cells = []
            for t in temperatures:
                r = by.get((method, k, t))
                cells += [f"{r['tau']:.3f}", f"{r['speedup']:.2f}x" if r["speedup"] else "–"] if r else ["–", "–"]
            lines.append(f"| {METHOD_NAMES[method]} | {k} | " + " | ".join(cells) + " |")
    kmax = max(ks)
    lines += [
        "",
        f"Acceptance rate by draft position (K={kmax}):",
        "",
        "| method | T | " + " | ".join(str(i + 1) for i in range(kmax)) + " |",
        "|" + "---|" * (2 + kmax),
    ]
    for method in methods:
        for t in temperatures:
            r = by.get((method, kmax, t))
            if r:
                rates = " | ".join(f"{a:.2f}" for a in r["acceptance_by_position"])
                lines.append(f"| {METHOD_NAMES[method]} | {t:g} | {rates} |")
    lines += context_table(results, report.get("context_groups") or [])
    lossless = report["lossless"]
    checked = report["lossless_checks"]
    verdict = (
        "not checked (no temperature 0)"
        if lossless is None
        else f"**{'yes' if lossless else 'NO'}**: greedy speculative output equals plain greedy output, for every "
        f"method and K, on {sum(c['lossless'] for c in checked)}/{len(checked)} prompts"
    )
    lines += ["", f"Lossless: {verdict}."]
    finetune = report.get("finetune")
    if finetune:
        lines += [
            "",
            f"Finetuned drafter vs the drafter it started from (`{finetune['init_from']}`, untouched):",
            "",
            "| prompts | K | T | τ finetuned | τ start | ratio |",
            "|---|---|---|---|---|---|",
        ]
        for s in finetune["sets"]:
            for r in s["rows"]:
                lines.append(
                    f"| {s['prompts']} ({s['count']}) | {r['k']} | {r['temperature']:g} | "
                    f"{r['finetuned_tau']:.3f} | {r['start_tau']:.3f} | {r['ratio']:.3f} |"
                )
        lines += ["", f"**{finetune['verdict']}**."]
    if not tables_only:
        lines += ["", "![acceptance by position](acceptance_by_position.png) ![tau vs K](tau_vs_k.png)"]
        if context_rows(results):
            lines[-1] += " ![tau by context length](tau_by_context.png)"
    return "\n".join(lines) + "\n"


def context_rows(results: list[dict]) -> list[dict]:
    """The drafter's result rows whose verify passes started in more than one context group (evaluate's τ by
    context length shows them: as a table, and as ``tau_by_context.png``)."""
    return [r for r in results if r["method"] != "ngram" and len(r.get("tau_by_context") or {}) > 1]


def context_table(results: list[dict], groups: list[str]) -> list[str]:
    """τ by the context length each verify pass started at, for the drafter's rows: drafters trained on short rows
    lose acceptance far beyond them. Empty when every pass fell in one group."""
    rows = context_rows(results)
    if not rows:
        return []
    lines = [
        "",
        "τ by context length (the context each verify pass started at; passes counted in brackets):",
        "",
        "| method | K | T | " + " | ".join(groups) + " |",
        "|" + "---|" * (3 + len(groups)),
    ]
    for r in rows:
        cells = context_cells(r["tau_by_context"], groups, digits=3)
        lines.append(f"| {METHOD_NAMES[r['method']]} | {r['k']} | {r['temperature']:g} | " + " | ".join(cells) + " |")
    return lines


def context_cells(by_context: dict, groups: list[str], digits: int = 2) -> list[str]:
    """One table cell per context group: "τ (verify passes)", or "–" where no pass started in it."""
    return [
        f"{by_context[g]['tau']:.{digits}f} ({by_context[g]['rounds']})" if g in by_context else "–" for g in groups
    ]
