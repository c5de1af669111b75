"""evaluate: how many tokens per target pass the drafter buys, measured by decoding as a server would.

For each K in ``evaluate.num_speculative_tokens`` and each temperature, the held-out prompts are decoded
three ways with the same KV-cached target (``eaglekit.speculative.decode``): plainly, with the trained
drafter (EAGLE-3 chain drafting), and with the n-gram baseline (vLLM's ``ngram``). Reported: τ (tokens
per target pass, bonus included), the acceptance rate at each draft position, tokens/s against plain
decoding, and at temperature 0 the losslessness of every prompt (speculative output must equal plain
greedy output token for token).

Reads the drafter (``evaluate.checkpoint``, default ``train/checkpoints/best``), the prompts
(``evaluate.prompts``, default the held-out split of ``generate/responses.jsonl``) and
writes ``evaluate/report.json``, ``report.md`` and PNG plots (the training curves are ``train/curves.png``).

A finetune (``train.init_from``) is measured beside the untouched drafter it started from — on the
held-out split of the finetuning data and on ``evaluate.prompts`` when given (e.g. production-like
traffic) — and the report says which is better where: a finetune can win on its own data and lose on
the traffic it will serve.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from eaglekit import atomic
from eaglekit.config import RunConfig
from eaglekit.contract import Estimate, Sizes, Stage, StageContext, measured_time
from eaglekit.data.eval_report import METHODS, context_rows, report_markdown
from eaglekit.data.suites import SUITES, load_suite, suite_names
from eaglekit.errors import EaglekitError, UsageError
from eaglekit.preflight import fail, files, gpus, ok, run_directory, skip
from eaglekit.progress import Meter, console
from eaglekit.resolved import ResolvedRun
from eaglekit.rundir import file_identity

if TYPE_CHECKING:
    import torch

    from eaglekit.speculative.decode import DecodeStats

NAME = "evaluate"
UPSTREAM = "train"
TIE = 0.01  # |τ ratio - 1| below this: neither drafter is better


def params(run: ResolvedRun) -> dict:
    cfg = run.cfg
    p = cfg.evaluate.model_dump()
    for key in ("prompts", "checkpoint"):
        if p[key]:
            p[key] = file_identity(p[key])
    p["eval_fraction"] = cfg.data.eval_fraction
    if cfg.train.init_from:
        p["init_from"] = file_identity(cfg.train.init_from)
    return p


def starting_drafter(ctx: StageContext):
    from eaglekit.drafters.checked import load_starting_drafter  # lazy: heavy (torch)

    if not ctx.cfg.train.init_from:
        return skip("starting drafter", "no train.init_from: nothing to compare the drafter with but n-gram")
    try:
        load_starting_drafter(ctx.cfg, *ctx.resolved.target_and_aux)
    except EaglekitError as err:
        return fail("starting drafter", err.message, err.remedy or "check train.init_from")
    return ok("starting drafter", f"{ctx.cfg.train.init_from} is measured beside the finetuned drafter")


def checks(cfg: RunConfig) -> list:
    from eaglekit.preflight import environment  # lazy: heavy (torch)
    from eaglekit.preflight.context import serving_context  # lazy: heavy (torch)
    from eaglekit.preflight.drafter import drafter_checkpoint, prompts_available  # lazy: heavy (torch)

    return [
        run_directory.target_folder,
        files.target_weights,
        environment.software,
        environment.devices,
        gpus.gpus,
        files.evaluate_checkpoint_files,
        drafter_checkpoint,
        starting_drafter,
        prompts_available,
        benchmark_suites,
        serving_context,
    ]


def benchmark_suites(ctx):
    """evaluate.suites (and verify.suites) name known suites, and their local copies read as evaluate reads them
    (the same reader, their columns checked): a copy in another layout is found before training, not after it."""
    suites = ctx.cfg.evaluate.suites + (ctx.cfg.verify.suites or [])
    if not suites:
        return skip("benchmark suites", "none configured (evaluate.suites)")
    read = []
    for suite in suites:
        if suite.name not in SUITES:
            return fail("benchmark suites", f"unknown suite {suite.name!r}", f"use one of: {suite_names()}")
        if suite.path and not os.path.exists(suite.path):
            return fail(
                "benchmark suites",
                f"suite {suite.name}: local copy {suite.path} not found",
                f"download {SUITES[suite.name].hub_id} there, or remove the path to load it from the hub",
            )
        if suite.path:  # a hub suite is not fetched here: pre-flight stays offline and quick
            try:
                items = load_suite(suite.name, suite.num_samples or ctx.cfg.evaluate.num_samples, suite.path)
            except UsageError as err:
                return fail("benchmark suites", f"suite {suite.name}: {err.message}", err.remedy or "")
            read.append(f"{suite.name}: {len(items)} prompts read")
    names = ", ".join(f"{s.name} ({s.path or SUITES[s.name].hub_id})" for s in suites)
    return ok("benchmark suites", names + (f"; {', '.join(read)}" if read else ""))


def estimate(ctx: StageContext, sizes: Sizes | None) -> Estimate:
    est = Estimate(bytes=4 << 20, how=["report and plots"])
    if sizes is not None:
        measured_time(est, sizes, None)
    return est


# ------------------------------------------------------------------------------------------------ run


def result_row(method: str, k: int, temperature: float, stats: DecodeStats, plain: DecodeStats) -> dict:
    return {
        "method": method,
        "k": k,
        "temperature": temperature,
        "tau": round(stats.tau, 4),
        # vLLM's "mean acceptance length": 1 + accepted / drafts, counting only rounds that drafted
        "tau_vllm": round(1 + sum(stats.accepted) / stats.drafted[0], 4) if stats.drafted and stats.drafted[0] else 1.0,
        "acceptance_by_position": [round(a, 4) for a in stats.acceptance_by_position()],
        "rounds": stats.rounds,
        "emitted": stats.emitted,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "tokens": stats.new_tokens,
        "seconds": round(stats.seconds, 3),
        "tokens_per_second": round(stats.tokens_per_second, 2),
        "speedup": round(stats.tokens_per_second / plain.tokens_per_second, 3) if plain.tokens_per_second else None,
    }


def by_context(generations: list) -> dict[str, dict[str, float]]:
    """τ per context-length group (< 1K, 1-4K, 4-16K, > 16K) of the verify passes that drafted."""
    from eaglekit.speculative.decode import tau_by_context  # lazy: heavy (torch)

    return {
        label: {"rounds": g["rounds"], "tau": round(g["tau"], 4)} for label, g in tau_by_context(generations).items()
    }


def run(ctx: StageContext) -> dict:
    import torch  # lazy: heavy (torch)

    from eaglekit.model.target import load_target  # lazy: heavy (torch)
    from eaglekit.speculative.inputs import decode_threads  # lazy: heavy (torch)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = load_target(ctx.cfg.target, device if not ctx.cfg.target.device_map else None)
    with decode_threads(target):
        return evaluate(ctx, target, device)


def evaluate(ctx: StageContext, target, device: torch.device) -> dict:
    from eaglekit.drafters.checked import decoding_inputs, load_starting_drafter, on_target  # lazy: heavy (torch)
    from eaglekit.drafters.registry import proposer_for  # lazy: heavy (torch)
    from eaglekit.speculative.ngram import NgramProposer  # lazy: heavy (torch)

    cfg, ec = ctx.cfg, ctx.cfg.evaluate
    inputs = decoding_inputs(cfg, target, device, ec.max_new_tokens)
    drafter, aux = inputs.drafter, inputs.aux
    start = load_starting_drafter(cfg, inputs.hf, aux)
    start_drafter = on_target(start[0], start[1], target, device) if start else None
    new_proposer = {
        "eagle": lambda: proposer_for(drafter, aux),
        "eagle_start": lambda: proposer_for(start_drafter, aux),
        "ngram": lambda: NgramProposer(ec.ngram_min, ec.ngram_max),
    }
    decoding = Decoding(target, ec, inputs.stop_ids, new_proposer)
    decoding.warm_up(inputs.prompts[0][1])

    main = decoding.measure(inputs.prompts, [m for m in METHODS if m != "eagle_start" or start], "evaluate: decode")
    finetune = finetune_section(ctx, inputs, decoding, main["results"]) if start else None
    suites = measure_suites(ctx, target, inputs, new_proposer["eagle"], decoding.ks, decoding.temperatures)
    report = build_report(ctx, inputs, device, decoding, main, finetune, suites)
    write_report(ctx, report)
    return counts(report)


class Decoding:
    """Plain and speculative decoding of prompts with the target, each method's proposer made fresh per run; a
    prompt's sampling generator is seeded by its index, so every method and K at a temperature sees the same draws
    from the target that plain decoding does."""

    def __init__(self, target, ec, stop_ids, new_proposer: dict):
        self.target, self.ec, self.stop_ids, self.new_proposer = target, ec, stop_ids, new_proposer
        self.ks = sorted(set(ec.num_speculative_tokens))
        self.temperatures = list(dict.fromkeys(ec.temperatures))

    def decode(self, ids: list[int], i: int, temperature: float, method: str | None = None, k: int = 0):
        import torch  # lazy: heavy (torch)

        from eaglekit.speculative.decode import generate  # lazy: heavy (torch)

        generator = torch.Generator().manual_seed(self.ec.seed * 1_000_003 + i)
        return generate(
            self.target,
            ids,
            self.ec.max_new_tokens,
            proposer=self.new_proposer[method]() if method else None,
            k=k,
            temperature=temperature,
            generator=generator,
            stop_ids=self.stop_ids,
        )

    def warm_up(self, ids: list[int]) -> None:
        """The first calls pay one-time costs (allocator, kernels); this keeps them out of the timings."""
        from eaglekit.speculative.decode import generate  # lazy: heavy (torch)

        for proposer in (None, self.new_proposer["eagle"]()):
            generate(self.target, ids, 8, proposer=proposer, k=max(self.ks))

    def measure(self, prompts: list[tuple[str, list[int]]], methods: list[str], label: str) -> dict:
        """Prompt by prompt, plain decoding and then every method and K: the timings compared share a time window.
        Returns the plain baselines and the result rows per temperature, the speculative runs that differed from
        plain greedy output (per prompt) and each prompt's number of greedy tokens."""
        from eaglekit.speculative.decode import DecodeStats  # lazy: heavy (torch)
        from eaglekit.speculative.inputs import first_difference  # lazy: heavy (torch)

        baselines, results = [], []
        checks: dict[str, list] = {pid: [] for pid, _ in prompts}
        plain_tokens: dict[str, int] = {}
        total = len(self.temperatures) * len(prompts) * (1 + len(methods) * len(self.ks))
        with Meter(label, total=total, unit="runs") as meter:
            for temperature in self.temperatures:
                plain = DecodeStats()
                spec = {(m, k): DecodeStats(drafted=[0] * k, accepted=[0] * k) for m in methods for k in self.ks}
                runs: dict[tuple[str, int], list] = {key: [] for key in spec}  # for τ by context length
                for i, (pid, ids) in enumerate(prompts):
                    reference = self.decode(ids, i, temperature)
                    plain = plain + reference.stats
                    if temperature == 0:
                        plain_tokens[pid] = len(reference.tokens)
                    meter.update(1, T=temperature)
                    for method, k in spec:
                        out = self.decode(ids, i, temperature, method, k)
                        spec[method, k] = spec[method, k] + out.stats
                        runs[method, k].append(out)
                        if temperature == 0 and out.tokens != reference.tokens:
                            difference = first_difference(out.tokens, reference.tokens)
                            checks[pid].append({"method": method, "k": k, "first_difference": difference})
                        meter.update(1, method=method, K=k, tau=round(spec[method, k].tau, 3))
                baselines.append(
                    {
                        "temperature": temperature,
                        "tokens": plain.new_tokens,
                        "seconds": round(plain.seconds, 3),
                        "tokens_per_second": round(plain.tokens_per_second, 2),
                    }
                )
                results += [
                    result_row(method, k, temperature, stats, plain) | {"tau_by_context": by_context(runs[method, k])}
                    for (method, k), stats in spec.items()
                ]
        return {"baselines": baselines, "results": results, "checks": checks, "plain_tokens": plain_tokens}


def finetune_section(ctx: StageContext, inputs, decoding: Decoding, results: list[dict]) -> dict:
    """The finetuned drafter against the one it started from, on evaluate's prompts and, when those are
    ``evaluate.prompts`` (e.g. production-like traffic), on the finetuning data's own held-out split too."""
    from eaglekit.speculative.inputs import heldout_prompts, tokenize_prompts  # lazy: heavy (torch)

    cfg, ec = ctx.cfg, ctx.cfg.evaluate
    sets = [(ec.prompts or "held-out split of generate/responses.jsonl", len(inputs.prompts), results)]
    if ec.prompts:
        try:
            heldout, _ = tokenize_prompts(cfg, inputs.tokenizer, inputs.hf, heldout_prompts(cfg), ec.max_new_tokens)
        except UsageError as err:
            console.print(f"[yellow]evaluate: the finetune is compared on evaluate.prompts only: {err.message}[/]")
        else:
            extra = decoding.measure(heldout, ["eagle", "eagle_start"], "evaluate: finetune vs start, held-out split")
            sets.insert(0, ("held-out split of generate/responses.jsonl", len(heldout), extra["results"]))
    return finetune_comparison(str(cfg.train.init_from), sets)


def build_report(ctx: StageContext, inputs, device, decoding: Decoding, main: dict, finetune, suites) -> dict:
    from eaglekit.speculative.decode import CONTEXT_BUCKETS  # lazy: heavy (torch)

    cfg, ec = ctx.cfg, ctx.cfg.evaluate
    checks, results = main["checks"], main["results"]
    greedy_checked = 0 in decoding.temperatures
    report = {
        "checkpoint": str(inputs.info.path),
        "checkpoint_form": inputs.info.form,
        "target": cfg.target.model,
        "device": str(device),
        "dtype": str(inputs.dtype).replace("torch.", ""),
        "prompts_source": ec.prompts or "generate/responses.jsonl (held-out split)",
        "prompts": len(inputs.prompts),
        "prompts_skipped_too_long": inputs.skipped_too_long,
        "max_new_tokens": ec.max_new_tokens,
        "num_speculative_tokens": decoding.ks,
        "temperatures": decoding.temperatures,
        "ngram": {"min": ec.ngram_min, "max": ec.ngram_max},
        "draft_selection": "argmax, verified as a point mass (as vLLM and SGLang)",
        "lossless": all(not c for c in checks.values()) if greedy_checked else None,
        "lossless_checks": [
            {
                "id": pid,
                "new_tokens": main["plain_tokens"].get(pid),
                "lossless": not checks[pid] if greedy_checked else None,
                "differences": checks[pid],
            }
            for pid, _ in inputs.prompts
        ],
        "baseline": main["baselines"],
        "results": results,
        "context_groups": [label for label, _ in CONTEXT_BUCKETS],  # the order of each row's tau_by_context
        "comparison": comparison(results),
        "finetune": finetune,
        "suites": suites,
    }
    report["warnings"] = degenerate(report, ec.num_samples, cfg.data.eval_fraction)
    if suites:
        report["warnings"] += suites["warnings"]
    return report


def write_report(ctx: StageContext, report: dict) -> None:
    from eaglekit.speculative.benchmark import suites_markdown  # lazy: heavy (torch)

    suites = report["suites"]
    for warning in report["warnings"]:
        ctx.warn(warning)
    from eaglekit import plots  # lazy: heavy (plots imports matplotlib)

    out, results = ctx.dir, report["results"]
    atomic.write_json(out / "report.json", report)
    atomic.write_text(out / "report.md", report_markdown(report) + (f"\n{suites_markdown(suites)}" if suites else ""))
    plots.acceptance_by_position(results, out / "acceptance_by_position.png")
    plots.tau_vs_k(results, out / "tau_vs_k.png")
    by_context = context_rows(results)
    if by_context:  # the prompts span more than one context group
        plots.tau_by_context(by_context, report["context_groups"], out / "tau_by_context.png")
    else:  # none of an earlier evaluate's left beside this report
        (out / "tau_by_context.png").unlink(missing_ok=True)
    if suites:
        plots.suite_tau(suites["rows"], out / "suites_tau.png")
    report_to_trackers(ctx, report)
    if report["lossless"] is False:
        bad = [c["id"] for c in report["lossless_checks"] if c["differences"]]
        console.print(
            f"[bold red]evaluate: speculative greedy output differs from plain greedy output on {len(bad)} "
            f"prompts (e.g. {bad[0]}); see report.json lossless_checks[/]"
        )
    console.print(report_markdown(report, tables_only=True))
    if suites:
        console.print(suites_markdown(suites))


def report_to_trackers(ctx: StageContext, report: dict) -> None:
    """The τ tables and the plots into the tracker runs training logged to (train.report_to), if any."""
    from eaglekit.training.trackers import evaluate_tables, report_results  # lazy: heavy (torch)

    train, out = ctx.run.stage_dir("train"), ctx.dir
    plots = ["acceptance_by_position", "tau_vs_k", "tau_by_context", "suites_tau"]
    images = {f"evaluate/{name}": out / f"{name}.png" for name in plots} | {"curves/train": train / "curves.png"}
    report_results(train, evaluate_tables(report), images, ctx.warn)


def training_template_kwargs(ctx) -> dict | None:
    """The chat template arguments the training data was rendered with: prepare's recorded chat_template_kwargs
    (its last finished run in the ledger), else this config's."""
    done = [start for start, end in ctx.run.attempts("prepare") if end and end.get("state") == "done"]
    if done and "params" in done[-1]:
        return done[-1]["params"].get("chat_template_kwargs")
    return ctx.cfg.generate.extra_body.get("chat_template_kwargs")


def measure_suites(ctx, target, inputs, new_proposer, ks: list[int], temperatures: list[float]) -> dict | None:
    """``evaluate.suites``: the drafter's τ on each benchmark suite × reasoning mode × K × temperature."""
    from eaglekit.speculative.benchmark import (  # lazy: heavy (torch)
        mode_of,
        reasoning_modes,
        renders_alike,
        suite_prompts,
        template_kwargs,
    )

    cfg, ec = ctx.cfg, ctx.cfg.evaluate
    if not ec.suites:
        return None
    trained_with = training_template_kwargs(ctx)
    modes = reasoning_modes(ec.reasoning)
    served = cfg.generate.extra_body.get("chat_template_kwargs")
    room = int(inputs.hf.max_position_embeddings) - ec.max_new_tokens
    rows, warnings = [], []
    other = [
        m
        for m in modes
        if not renders_alike(inputs.tokenizer, template_kwargs(served, ec.chat_template_kwargs, m), trained_with)
    ]
    if other:
        warnings.append(
            f"evaluate measures reasoning mode {', '.join(other)}, whose prompts render differently from the "
            f"training data's (prepare's chat_template_kwargs: {trained_with or 'none'}): a drafter is usually far "
            "weaker in a mode it was not trained in; compare τ with cards in the same mode"
        )
    for suite in ec.suites:
        items = load_suite(suite.name, suite.num_samples or ec.num_samples, suite.path)
        for mode in modes:
            kwargs = template_kwargs(served, ec.chat_template_kwargs, mode)
            prompts, skipped = suite_prompts(
                target,
                inputs.tokenizer,
                items,
                kwargs,
                ec.max_new_tokens,
                inputs.stop_ids,
                room,
                suite.max_prompt_tokens,
            )
            if skipped:
                warnings.append(f"suite {suite.name} ({mode}): {skipped} turns skipped, longer than {room} tokens")
            if not prompts:
                continue
            with Meter(f"evaluate: suite {suite.name} ({mode})", total=len(prompts) * len(ks) * len(temperatures)) as m:
                for temperature in temperatures:
                    for k in ks:
                        row = measure_suite_row(target, prompts, new_proposer, k, temperature, ec, inputs, m)
                        rows.append({"suite": suite.name, "mode": mode, **row})
    return {
        "training_mode": mode_of(trained_with),
        "training_template_kwargs": trained_with,
        "modes": modes,
        "modes_unlike_training": other,
        "rows": rows,
        "warnings": warnings,
    }


def measure_suite_row(target, prompts, new_proposer, k, temperature, ec, inputs, meter) -> dict:
    from eaglekit.speculative.benchmark import measure_suite  # lazy: heavy (torch)

    return measure_suite(
        target,
        prompts,
        new_proposer,
        k,
        temperature,
        ec.max_new_tokens,
        inputs.stop_ids,
        ec.seed,
        on_prompt=lambda: meter.update(1, K=k, T=temperature),
    )


def degenerate(report: dict, asked: int, eval_fraction: float) -> list[str]:
    """What makes these figures unfit to trust or to ship: too few prompts, a drafter no better than n-gram, a
    finetune that lost to the drafter it started from."""
    out = []
    if report["prompts"] < asked:
        out.append(
            f"decoded {report['prompts']} prompts, fewer than evaluate.num_samples ({asked}): the figures are "
            f"noisy; raise data.eval_fraction ({eval_fraction}) or set evaluate.prompts to a prompts file"
        )
    losing = [r for r in report["comparison"] if r["eagle_tau"] <= r["ngram_tau"]]
    if losing:
        where = ", ".join(
            f"K={r['k']} T={r['temperature']:g}: τ {r['eagle_tau']:.3f} vs {r['ngram_tau']:.3f}" for r in losing
        )
        out.append(
            f"the drafter does not beat the training-free n-gram baseline ({where}): it would slow serving "
            "down; train on more data or longer, and check that the target's features and vocab are right"
        )
    finetune = report.get("finetune")
    if finetune and any(s["better"] == "starting drafter" for s in finetune["sets"]):
        out.append(finetune["verdict"])
    return out


def finetune_comparison(init_from: str, sets: list[tuple[str, int, list[dict]]]) -> dict:
    """Per prompt set: the finetuned drafter's τ beside its starting drafter's at each (K, T), and which is better
    (the mean τ ratio over K and T, a tie within ±TIE)."""
    out = []
    for name, n, results in sets:
        by = {(r["method"], r["k"], r["temperature"]): r["tau"] for r in results}
        rows = [
            {
                "k": k,
                "temperature": t,
                "finetuned_tau": tau,
                "start_tau": by[("eagle_start", k, t)],
                "ratio": round(tau / by[("eagle_start", k, t)], 4),
            }
            for (method, k, t), tau in by.items()
            if method == "eagle" and ("eagle_start", k, t) in by
        ]
        mean = sum(r["ratio"] for r in rows) / len(rows)
        better = "tie" if abs(mean - 1) < TIE else ("finetuned" if mean > 1 else "starting drafter")
        out.append({"prompts": name, "count": n, "rows": rows, "mean_ratio": round(mean, 4), "better": better})
    parts = [
        f"{s['better']} better on {s['prompts']} (τ ratio finetuned/start {s['mean_ratio']:.3f})"
        if s["better"] != "tie"
        else f"a tie on {s['prompts']} (τ ratio {s['mean_ratio']:.3f})"
        for s in out
    ]
    verdict = "; ".join(parts)
    if any(s["better"] == "starting drafter" for s in out):
        verdict += (
            ". The finetune lost to the drafter it started from: it over-specialised to its data. Mix in data "
            "like the prompts it lost on, train fewer steps or at a lower lr, or set train.ttt.anchor_weight "
            "(an L2-SP pull toward the starting weights)"
        )
    return {"init_from": init_from, "sets": out, "verdict": verdict}


def comparison(results: list[dict]) -> list[dict]:
    """The drafter's τ beside the n-gram baseline's for each (K, temperature): the figure a threshold checks."""
    by = {(r["method"], r["k"], r["temperature"]): r["tau"] for r in results}
    rows = []
    for (method, k, temperature), tau in by.items():
        if method == "eagle" and ("ngram", k, temperature) in by:
            ngram = by[("ngram", k, temperature)]
            rows.append(
                {
                    "k": k,
                    "temperature": temperature,
                    "eagle_tau": tau,
                    "ngram_tau": ngram,
                    "ratio": round(tau / ngram, 4) if ngram else None,
                }
            )
    return rows


def counts(report: dict) -> dict:
    temperature = min(report["temperatures"])
    out = {"prompts": report["prompts"], "lossless": report["lossless"], "temperature": temperature}
    for r in report["results"]:
        if r["temperature"] == temperature:
            out[f"{r['method']}_tau_k{r['k']}"] = r["tau"]
    for r in (report.get("suites") or {}).get("rows", []):
        if r["temperature"] == temperature:
            out[f"{r['suite']}_{r['mode']}_tau_k{r['k']}"] = r["tau"]
    if report.get("finetune"):
        out["finetune_vs_start"] = {s["prompts"]: s["mean_ratio"] for s in report["finetune"]["sets"]}
    return out


STAGE = Stage(
    name=NAME,
    upstream=UPSTREAM,
    reads="train/checkpoints/best (or evaluate.checkpoint), the target, the held-out prompts",
    writes="evaluate/report.json, evaluate/report.md, evaluate/*.png",
    params=params,
    checks=checks,
    run=run,
    estimate=estimate,
)
