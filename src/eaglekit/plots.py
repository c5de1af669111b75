"""The PNG plots of eaglekit: training curves, acceptance by draft position, τ against K.

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


def training_curves(rows: list[dict], path: Path) -> None:
    """Train and held-out TTT loss, and accuracy per TTT step, against the optimizer step (rows of train/metrics.jsonl)."""
    train = [r for r in rows if r.get("kind") == "train"]
    held = [r for r in rows if r.get("kind") == "eval"]
    fig = Figure(figsize=(11, 4))
    ax_loss, ax_acc = fig.subplots(1, 2)
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    if held:
        ax_loss.plot([r["step"] for r in held], [r["loss"] for r in held], "o-", label="held-out")
    ax_loss.set(xlabel="step", ylabel="TTT loss", title="loss")
    ax_loss.legend()
    source = held or train
    for k in range(len(source[0]["acc_k"]) if source else 0):
        ax_acc.plot([r["step"] for r in source], [r["acc_k"][k] for r in source], label=f"acc_{k}")
    ax_acc.set(xlabel="step", ylabel="accuracy", ylim=(0, 1),
               title=f"{'held-out' if held else 'train'} accuracy per TTT step")
    if source:
        ax_acc.legend(fontsize="small", ncol=2)
    _save(fig, path)


def acceptance_by_position(results: list[dict], path: Path) -> None:
    """Share of drafts accepted at each chain position, at the largest K, per method and temperature."""
    k = max(r["k"] for r in results)
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for i, (method, temperature) in enumerate(_lines(results)):
        r = next((r for r in results if (r["method"], r["k"], r["temperature"]) == (method, k, temperature)), None)
        if r:
            rates = r["acceptance_by_position"]
            ax.plot(range(1, len(rates) + 1), rates, STYLE.get(method, "-"), color=f"C{i}", label=f"{method} T={temperature:g}")
    ax.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1.02), xticks=range(1, k + 1),
           title=f"acceptance by position (K={k})")
    ax.legend()
    _save(fig, path)


def tau_vs_k(results: list[dict], path: Path) -> None:
    """Mean acceptance length τ against the number of drafts K, per method and temperature, under the K+1 bound."""
    ks = sorted({r["k"] for r in results})
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    ax.plot(ks, [k + 1 for k in ks], ":", color="grey", label="bound K+1")
    for i, (method, temperature) in enumerate(_lines(results)):
        rows = sorted((r for r in results if (r["method"], r["temperature"]) == (method, temperature)), key=lambda r: r["k"])
        ax.plot([r["k"] for r in rows], [r["tau"] for r in rows], STYLE.get(method, "-"), color=f"C{i}",
                label=f"{method} T={temperature:g}")
    ax.set(xlabel="K (drafts per round)", ylabel="τ (tokens per target pass)", xticks=ks, title="acceptance length")
    ax.legend()
    _save(fig, path)
