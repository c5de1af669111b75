"""The PNG plots of eaglekit: training curves, acceptance by draft position, τ against K and by context length.

Figures are built with ``matplotlib.figure.Figure`` (no pyplot, so no global state and no display
needed) and written atomically.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from eaglekit.atomic import atomic_path

STYLE = {"eagle": "-o", "eagle_start": ":^", "ngram": "--s"}  # one line style per method


def _save(fig: Figure, path: Path) -> None:
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)


def _lines(results: list[dict]) -> list[tuple[str, float]]:
    """(method, temperature) pairs in a fixed order, so each keeps its colour across plots."""
    return sorted({(r["method"], r["temperature"]) for r in results})


def _series(ax, xs: list, ys: list, style: str = "-", **kw) -> None:
    """A line with markers when it has few points, so a series of one point still shows."""
    ax.plot(xs, ys, style + ("o" if len(xs) < 20 and "o" not in style else ""), **kw)


def training_curves(rows: list[dict], path: Path) -> Figure:
    """Train and held-out TTT loss (log scale: the first steps' loss is many times the rest) with held-out simulated
    τ, and accuracy per TTT step, against the optimizer step (rows of train/metrics.jsonl)."""
    train = [r for r in rows if r.get("kind") == "train"]
    held = [r for r in rows if r.get("kind") == "eval"]
    fig = Figure(figsize=(11, 4))
    ax_loss, ax_acc = fig.subplots(1, 2)
    _series(ax_loss, [r["step"] for r in train], [r["loss"] for r in train], label="train")
    if held:
        _series(ax_loss, [r["step"] for r in held], [r["loss"] for r in held], "o-", label="held-out")
    if all(r["loss"] > 0 for r in train + held) and (train or held):
        ax_loss.set_yscale("log")
    ax_loss.set(xlabel="step", ylabel="TTT loss", title="loss and held-out τ")
    ax_loss.legend(loc="upper left")
    if held and all("tau" in r for r in held):
        # on the loss's panel: τ falling while the loss still falls is overfitting (train.early_stop_patience)
        ax_tau = ax_loss.twinx()
        _series(ax_tau, [r["step"] for r in held], [r["tau"] for r in held], "o--", color="C3", label="held-out τ")
        ax_tau.set(ylabel="simulated τ")
        ax_tau.legend(loc="upper right")
    source = held or train
    for k in range(len(source[0]["acc_k"]) if source else 0):
        _series(ax_acc, [r["step"] for r in source], [r["acc_k"][k] for r in source], label=f"acc_{k}")
    ax_acc.set(
        xlabel="step", ylabel="accuracy", ylim=(0, 1), title=f"{'held-out' if held else 'train'} accuracy per TTT step"
    )
    if source:
        ax_acc.legend(fontsize="small", ncol=2)
    _save(fig, path)
    return fig


def acceptance_by_position(results: list[dict], path: Path) -> None:
    """Share of drafts accepted at each chain position, at the largest K, per method and temperature."""
    k = max(r["k"] for r in results)
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for i, (method, temperature) in enumerate(_lines(results)):
        r = next((r for r in results if (r["method"], r["k"], r["temperature"]) == (method, k, temperature)), None)
        if r:
            rates = r["acceptance_by_position"]
            ax.plot(
                range(1, len(rates) + 1),
                rates,
                STYLE.get(method, "-"),
                color=f"C{i}",
                label=f"{method} T={temperature:g}",
            )
    ax.set(
        xlabel="draft position",
        ylabel="acceptance rate",
        ylim=(0, 1.02),
        xticks=range(1, k + 1),
        title=f"acceptance by position (K={k})",
    )
    ax.legend()
    _save(fig, path)


def tau_vs_k(results: list[dict], path: Path) -> None:
    """Mean acceptance length τ against the number of drafts K, per method and temperature, under the K+1 bound."""
    ks = sorted({r["k"] for r in results})
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    ax.plot(ks, [k + 1 for k in ks], ":", color="grey", label="bound K+1")
    for i, (method, temperature) in enumerate(_lines(results)):
        rows = sorted(
            (r for r in results if (r["method"], r["temperature"]) == (method, temperature)), key=lambda r: r["k"]
        )
        ax.plot(
            [r["k"] for r in rows],
            [r["tau"] for r in rows],
            STYLE.get(method, "-"),
            color=f"C{i}",
            label=f"{method} T={temperature:g}",
        )
    ax.set(xlabel="K (drafts per round)", ylabel="τ (tokens per target pass)", xticks=ks, title="acceptance length")
    ax.legend()
    _save(fig, path)


def tau_by_context(rows: list[dict], groups: list[str], path: Path) -> Figure:
    """τ in each context group (the context a verify pass started at), one line per drafter row (method, K,
    temperature); a group without passes is left out of its line."""
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for i, r in enumerate(rows):
        at = [(x, r["tau_by_context"][g]["tau"]) for x, g in enumerate(groups) if g in r["tau_by_context"]]
        ax.plot(
            [x for x, _ in at],
            [tau for _, tau in at],
            STYLE.get(r["method"], "-o"),
            color=f"C{i}",
            label=f"{r['method']} K={r['k']} T={r['temperature']:g}",
        )
    ax.set(
        xlabel="context at the verify pass (tokens)",
        ylabel="τ (tokens per target pass)",
        xticks=range(len(groups)),
        xticklabels=groups,
        ylim=(0, None),
        title="acceptance length by context length",
    )
    ax.legend(fontsize="small")
    _save(fig, path)
    return fig


def served_vs_offline(runs: list[dict], path: Path) -> None:
    """Acceptance rate by draft position, served by the engine (crosses, dashed) against eaglekit offline
    (dots, solid): one panel per exported form, one colour per K (rows of verify/report.json's runs)."""
    groups = list(dict.fromkeys(r["form"] for r in runs if r["positions"])) or ["served"]
    fig = Figure(figsize=(5 * len(groups), 4))
    axes = fig.subplots(1, len(groups), squeeze=False)[0]
    ks = sorted({r["k"] for r in runs})
    for ax, form in zip(axes, groups, strict=False):
        for r in (r for r in runs if r["form"] == form and r["positions"]):
            x = [p["position"] for p in r["positions"]]
            colour = f"C{ks.index(r['k'])}"
            ax.plot(x, [p["offline"] for p in r["positions"]], "-o", color=colour, label=f"K={r['k']} offline")
            ax.plot(
                x, [p["served"] for p in r["positions"]], "--x", color=colour, markersize=10, label=f"K={r['k']} served"
            )
        ax.set(
            xlabel="draft position",
            ylabel="acceptance rate",
            ylim=(0, 1.02),
            xticks=range(1, max(ks) + 1),
            title=f"{form}: served vs offline",
        )
        ax.legend(fontsize="small", loc="lower left")
    _save(fig, path)


def suite_tau(rows: list[dict], path: Path) -> None:
    """τ per benchmark suite with its 95 % interval, at the largest K, one bar per reasoning mode and temperature."""
    k = max(r["k"] for r in rows)
    suites = list(dict.fromkeys(r["suite"] for r in rows))
    series = list(dict.fromkeys((r["mode"], r["temperature"]) for r in rows if r["k"] == k))
    width = 0.8 / len(series)
    fig = Figure(figsize=(max(6, 1.5 * len(suites)), 4))
    ax = fig.subplots()
    for j, (mode, temperature) in enumerate(series):
        picked = [
            next(
                (r for r in rows if (r["suite"], r["mode"], r["k"], r["temperature"]) == (s, mode, k, temperature)),
                None,
            )
            for s in suites
        ]
        xs = [i + j * width for i, r in enumerate(picked) if r]
        taus = [r["tau"] for r in picked if r]
        errors = [
            [r["tau"] - r["tau_ci95"][0] for r in picked if r],
            [r["tau_ci95"][1] - r["tau"] for r in picked if r],
        ]
        ax.bar(xs, taus, width, yerr=errors, capsize=3, color=f"C{j}", label=f"reasoning {mode}, T={temperature:g}")
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(suites))], suites)
    ax.set(ylabel="τ (tokens per target pass)", title=f"τ by benchmark suite (K={k}, 95 % interval over prompts)")
    ax.legend()
    _save(fig, path)
