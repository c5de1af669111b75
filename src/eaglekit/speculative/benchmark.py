"""τ on named benchmark suites, reported as model cards report it: per suite × reasoning mode × K × temperature.

A published τ is only comparable at the same prompts, K, temperature and reasoning mode, so every row
carries all four. The prompts come from ``eaglekit.data.suites``, rendered with the run's chat template and
the mode's thinking switch (``enable_thinking``, merged into the template kwargs the target was served with).
A multi-turn item (MT-Bench) is measured turn by turn as a server sees it: turn n is sent after the target's
own greedy answers to the turns before it (plain decoding, so the history is what the target would have
said, whatever the drafter). τ comes with a 95 % bootstrap interval over prompts (the prompt, not the verify
pass, is the unit that varies), the acceptance rate at each draft position, and τ by the context length at
which each draft starts (``decode.CONTEXT_BUCKETS``), since EAGLE-3 acceptance falls as the context grows.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from eaglekit.data.eval_report import context_cells
from eaglekit.data.suites import SuiteItem
from eaglekit.speculative.decode import CONTEXT_BUCKETS, DecodeStats, Generation, Proposer, generate, tau_by_context
from eaglekit.speculative.inputs import prompt_ids

MODES = {"on": True, "off": False}  # the served reasoning mode -> the template's enable_thinking
BOOTSTRAP_SAMPLES = 1000


def reasoning_modes(setting: str | None) -> list[str]:
    """The modes to measure: ``default`` (the template's own default) when unset, both for ``both``."""
    if setting is None:
        return ["default"]
    return ["on", "off"] if setting == "both" else [setting]


def template_kwargs(served: dict | None, extra: dict, mode: str) -> dict | None:
    """The chat template arguments of ``mode``: those the target was served with, ``extra``, then the switch."""
    kwargs = {**(served or {}), **extra}
    if mode in MODES:
        kwargs["enable_thinking"] = MODES[mode]
    return kwargs or None


def renders_alike(tokenizer, a: dict | None, b: dict | None) -> bool:
    """Whether two sets of template arguments render the same generation prompt (a template without a thinking
    switch ignores it; one whose default is thinking renders ``default`` as ``on``)."""
    probe = [{"role": "user", "content": "Hello"}]
    return prompt_ids(tokenizer, probe, a) == prompt_ids(tokenizer, probe, b)


def mode_of(kwargs: dict | None) -> str:
    """The reasoning mode a set of template arguments selects (``default``: the template decides)."""
    value = (kwargs or {}).get("enable_thinking")
    return "default" if value is None else ("on" if value else "off")


@dataclass
class SuitePrompt:
    item_id: str
    turn: int  # 1-based
    ids: list[int]


def suite_prompts(
    target,
    tokenizer,
    items: list[SuiteItem],
    kwargs: dict | None,
    max_new_tokens: int,
    stop_ids: set[int],
    room: int,
    max_prompt_tokens: int | None = None,
) -> tuple[list[SuitePrompt], int]:
    """Every turn of ``items`` as prompt ids (turn n after the target's greedy answers), and how many turns did
    not fit in ``room`` tokens (a turn that does not fit ends its item). With ``max_prompt_tokens`` a longer turn
    keeps its head and tail and loses its middle, as LongBench truncates."""
    prompts, skipped = [], 0
    limit = min(room, max_prompt_tokens or room)
    for item in items:
        messages: list[dict] = []
        for turn, text in enumerate(item.turns, start=1):
            messages.append({"role": "user", "content": text})
            ids = prompt_ids(tokenizer, messages, kwargs)
            if max_prompt_tokens and len(ids) > limit:
                messages[-1]["content"] = cut_middle(tokenizer, text, len(ids) - limit)
                ids = prompt_ids(tokenizer, messages, kwargs)
            if len(ids) > room:
                skipped += len(item.turns) - turn + 1
                break
            prompts.append(SuitePrompt(item.id, turn, ids))
            if turn < len(item.turns):
                answer = generate(target, ids, max_new_tokens, stop_ids=stop_ids)
                messages.append(
                    {"role": "assistant", "content": tokenizer.decode(answer.tokens, skip_special_tokens=True)}
                )
    return prompts, skipped


def cut_middle(tokenizer, text: str, excess: int) -> str:
    """``text`` without ``excess`` (plus a small margin for re-tokenization at the seam) tokens from its middle."""
    tokens = tokenizer.encode(text, add_special_tokens=False)
    keep = max(0, len(tokens) - excess - 8)
    return tokenizer.decode(tokens[: keep // 2]) + tokenizer.decode(tokens[len(tokens) - (keep - keep // 2) :])


def bootstrap_interval(per_prompt: list[tuple[int, int]], seed: int = 0) -> tuple[float, float]:
    """95 % percentile interval of τ = Σ emitted / Σ rounds, resampling prompts with replacement."""
    if len(per_prompt) < 2:
        tau = per_prompt[0][0] / per_prompt[0][1] if per_prompt and per_prompt[0][1] else 0.0
        return tau, tau
    rng = random.Random(seed)
    taus = []
    for _ in range(BOOTSTRAP_SAMPLES):
        draw = [per_prompt[rng.randrange(len(per_prompt))] for _ in per_prompt]
        rounds = sum(r for _, r in draw)
        taus.append(sum(e for e, _ in draw) / rounds if rounds else 0.0)
    taus.sort()
    return taus[int(0.025 * (len(taus) - 1))], taus[int(0.975 * (len(taus) - 1))]


def measure_suite(
    target,
    prompts: list[SuitePrompt],
    new_proposer: Callable[[], Proposer],
    k: int,
    temperature: float,
    max_new_tokens: int,
    stop_ids: set[int],
    seed: int,
    on_prompt: Callable[[], None] = lambda: None,
) -> dict:
    """Decode every prompt speculatively; τ, its interval, acceptance by position, by context length and by turn."""
    total = DecodeStats(drafted=[0] * k, accepted=[0] * k)
    gens: list[Generation] = []
    per_turn: dict[int, DecodeStats] = {}
    for i, prompt in enumerate(prompts):
        generator = torch.Generator().manual_seed(seed * 1_000_003 + i)
        gen = generate(
            target,
            prompt.ids,
            max_new_tokens,
            proposer=new_proposer(),
            k=k,
            temperature=temperature,
            generator=generator,
            stop_ids=stop_ids,
        )
        gens.append(gen)
        total = total + gen.stats
        per_turn[prompt.turn] = per_turn.get(prompt.turn, DecodeStats()) + gen.stats
        on_prompt()
    low, high = bootstrap_interval([(g.stats.emitted, g.stats.rounds) for g in gens], seed)
    return {
        "k": k,
        "temperature": temperature,
        "prompts": len(prompts),
        "tau": round(total.tau, 4),
        "tau_ci95": [round(low, 4), round(high, 4)],
        "acceptance_by_position": [round(a, 4) for a in total.acceptance_by_position()],
        "tau_by_context": {
            label: {"rounds": g["rounds"], "tau": round(g["tau"], 4)} for label, g in tau_by_context(gens).items()
        },
        "tau_by_turn": {str(turn): round(s.tau, 4) for turn, s in sorted(per_turn.items())}
        if len(per_turn) > 1
        else {},
        "rounds": total.rounds,
        "draft_rounds": total.drafted[0] if k else 0,  # the verify passes that drafted (τ by context counts these)
        "emitted": total.emitted,
        "longest_prompt": max(len(p.ids) for p in prompts),
    }


def suites_markdown(section: dict) -> str:
    """The model-card table of evaluate's (or verify's) ``suites`` section."""
    rows = section["rows"]
    labels = [label for label, _ in CONTEXT_BUCKETS]
    lines = [
        f"Benchmark suites (τ with its 95 % bootstrap interval over prompts; reasoning mode as served; "
        f"the training data was generated in mode `{section['training_mode']}`):",
        "",
        "| suite | mode | K | T | prompts | τ | 95 % interval | acceptance by position | "
        + " | ".join(f"τ ctx {label}" for label in labels)
        + " |",
        "|" + "---|" * (8 + len(labels)),
    ]
    for r in rows:
        context = context_cells(r["tau_by_context"], labels)
        turns = ", ".join(f"turn {t}: {tau:.2f}" for t, tau in r["tau_by_turn"].items())
        lines.append(
            f"| {r['suite']}{f' ({turns})' if turns else ''} | {r['mode']} | {r['k']} | {r['temperature']:g} | "
            f"{r['prompts']} | {r['tau']:.3f} | {r['tau_ci95'][0]:.2f}–{r['tau_ci95'][1]:.2f} | "
            + " ".join(f"{a:.2f}" for a in r["acceptance_by_position"])
            + " | "
            + " | ".join(context)
            + " |"
        )
    lines += ["", "τ ctx: τ of the verify passes whose draft starts at that context length (their count)."]
    for warning in section.get("warnings", []):
        lines += ["", f"**{warning}**"]
    return "\n".join(lines) + "\n"
