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

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch

from eaglekit import atomic, plots
from eaglekit.config import RunConfig
from eaglekit.errors import EaglekitError, UsageError
from eaglekit.model.dflash_checkpoint import is_dflash_checkpoint
from eaglekit.preflight import checks as common
from eaglekit.preflight import environment, fail, files, gpus, ok, skip, will_be_produced
from eaglekit.progress import Meter, console
from eaglekit.rundir import file_identity
from eaglekit.speculative.block import proposer_for
from eaglekit.speculative.decode import DecodeStats, generate
from eaglekit.speculative.ngram import NgramProposer

NAME = "evaluate"
UPSTREAM = "train"
METHODS = ("eagle", "eagle_start", "ngram")  # eagle_start: the drafter train.init_from started from
METHOD_NAMES = {"eagle": "eagle", "eagle_start": "eagle (init_from, untouched)", "ngram": "ngram"}
SMALL_MODEL_PARAMETERS = 50_000_000
TIE = 0.01  # |τ ratio - 1| below this: neither drafter is better


def params(cfg: RunConfig) -> dict:
    p = cfg.evaluate.model_dump()
    for key in ("prompts", "checkpoint"):
        if p[key]:
            p[key] = file_identity(p[key])
    p["eval_fraction"] = cfg.data.eval_fraction
    if cfg.train.init_from:
        p["init_from"] = file_identity(cfg.train.init_from)
    return p


def checkpoint_path(cfg: RunConfig) -> Path:
    """The drafter this run evaluates and exports."""
    return Path(cfg.evaluate.checkpoint) if cfg.evaluate.checkpoint else cfg.run_path / "train" / "checkpoints" / "best"


def load_checked_drafter(cfg: RunConfig):
    """(drafter, checkpoint info, target HF config, aux layer ids), or an EaglekitError naming what does not fit."""
    from eaglekit.model.checkpoints import check_compatible, load_drafter
    from eaglekit.model.target import aux_layer_ids, target_hf_config

    path = checkpoint_path(cfg)
    if not path.exists():
        remedy = (
            "set evaluate.checkpoint to a drafter folder"
            if cfg.evaluate.checkpoint
            else "train it: `eaglekit run CONFIG --until train` (it writes train/checkpoints/best)"
        )
        raise EaglekitError(f"drafter checkpoint {path} does not exist", remedy)
    hf = target_hf_config(cfg.target)
    aux = aux_layer_ids(cfg.target, hf.num_hidden_layers)
    if is_dflash_checkpoint(path):  # the block-drafter family (model/dflash_checkpoint.py)
        return load_block_drafter(cfg, path, aux) + (hf, aux)
    drafter, info = load_drafter(path)
    problems = check_compatible(drafter.config, hf, aux)
    if problems:
        raise EaglekitError(
            f"drafter {path} does not fit the target {cfg.target.model}: " + "; ".join(problems),
            "evaluate a drafter trained for this target (evaluate.checkpoint), or retrain",
        )
    return drafter, info, hf, aux


def load_block_drafter(cfg: RunConfig, path: Path, aux: list[int]):
    from eaglekit.model.checkpoints import CheckpointInfo
    from eaglekit.model.dflash_checkpoint import FORM, load_for_target

    drafter = load_for_target(path, cfg.target.model, cfg.target.trust_remote_code)
    if drafter.config.aux_layer_ids != list(aux):
        raise EaglekitError(
            f"drafter {path} taps target layers {drafter.config.aux_layer_ids}, this config {aux}",
            f"set target.aux_layers: {drafter.config.aux_layer_ids}, or retrain",
        )
    return drafter, CheckpointInfo(FORM, path, missing_embeddings=False, aux_layer_ids=list(aux))


def load_starting_drafter(cfg: RunConfig, hf, aux):
    """The drafter ``train.init_from`` names, as it was before finetuning (None when training started fresh)."""
    from eaglekit.model.checkpoints import check_compatible, load_drafter

    path = cfg.train.init_from
    if not path:
        return None
    if not Path(path).exists():
        raise EaglekitError(
            f"train.init_from {path} does not exist (evaluate measures the finetune against it)",
            "restore that drafter folder, or remove train.init_from",
        )
    if is_dflash_checkpoint(path):
        return load_block_drafter(cfg, Path(path), aux)
    drafter, info = load_drafter(path)
    problems = check_compatible(drafter.config, hf, aux)
    if problems:
        raise EaglekitError(
            f"train.init_from {path} does not fit the target: " + "; ".join(problems),
            "point train.init_from at the drafter this run finetuned",
        )
    return drafter, info


def starting_drafter(ctx):
    from eaglekit.model.target import aux_layer_ids, target_hf_config

    if not ctx.cfg.train.init_from:
        return skip("starting drafter", "no train.init_from: nothing to compare the drafter with but n-gram")
    try:
        hf = target_hf_config(ctx.cfg.target)
        load_starting_drafter(ctx.cfg, hf, aux_layer_ids(ctx.cfg.target, hf.num_hidden_layers))
    except EaglekitError as err:
        return fail("starting drafter", err.message, err.remedy or "check train.init_from")
    return ok("starting drafter", f"{ctx.cfg.train.init_from} is measured beside the finetuned drafter")


def drafter_checkpoint(ctx):
    pending = None if ctx.cfg.evaluate.checkpoint else will_be_produced(ctx, "drafter checkpoint", "train")
    if pending:
        return pending
    try:
        drafter, info, _, aux = load_checked_drafter(ctx.cfg)
    except EaglekitError as err:
        return fail("drafter checkpoint", err.message, err.remedy or "check the drafter folder")
    c = drafter.config
    vocab = f"{c.vocab_size} (the target's)" if info.form == "dflash" else f"{c.draft_vocab_size}/{c.vocab_size}"
    return ok(
        "drafter checkpoint",
        f"{info.path} ({info.form} form): hidden {c.hidden_size}, draft vocab {vocab}, aux layers {aux}; fits the target",
    )


def eval_prompts(cfg: RunConfig, n: int | None = None) -> list[tuple[str, list[dict]]]:
    """(id, messages) of up to ``n`` (default ``evaluate.num_samples``) prompts: ``evaluate.prompts`` or the
    run's held-out split."""
    n = n or cfg.evaluate.num_samples
    if cfg.evaluate.prompts:
        from eaglekit.data.prompts import load_prompts

        records = load_prompts(cfg.evaluate.prompts, max_samples=n, on_bad_row=cfg.data.on_bad_row).records
        return [(r.id, r.messages) for r in records]
    return heldout_prompts(cfg, n)


def heldout_prompts(cfg: RunConfig, n: int | None = None) -> list[tuple[str, list[dict]]]:
    """(id, messages) of up to ``n`` (default ``evaluate.num_samples``) prompts of the held-out split of
    generate/responses.jsonl."""
    from eaglekit.data.responses import RESPONSES, read_responses
    from eaglekit.data.split import is_held_out

    n = n or cfg.evaluate.num_samples
    path = cfg.run_path / "generate" / RESPONSES
    out = []
    if path.exists():
        for row in read_responses(path):
            if is_held_out(row["id"], cfg.data.eval_fraction):
                out.append((row["id"], row["messages"]))
                if len(out) == n:
                    break
    if not out:
        raise UsageError(
            f"{path} has no held-out sample (data.eval_fraction = {cfg.data.eval_fraction})",
            "raise data.eval_fraction (and rerun from generate), or set evaluate.prompts to a prompts file",
        )
    return out


def prompts_available(ctx):
    pending = None if ctx.cfg.evaluate.prompts else will_be_produced(ctx, "evaluation prompts", "generate")
    if pending:
        return pending
    try:
        prompts = eval_prompts(ctx.cfg)
    except EaglekitError as err:
        return fail("evaluation prompts", err.message, err.remedy or "check evaluate.prompts")
    source = ctx.cfg.evaluate.prompts or "the held-out split of generate/responses.jsonl"
    wanted = ctx.cfg.evaluate.num_samples
    short = f" (of {wanted} asked: that is all there are)" if len(prompts) < wanted else ""
    return ok("evaluation prompts", f"{len(prompts)} prompts from {source}{short}")


def checks(cfg: RunConfig) -> list:
    return [
        common.target_folder,
        files.target_weights,
        environment.software,
        environment.devices,
        gpus.gpus,
        files.evaluate_checkpoint_files,
        drafter_checkpoint,
        starting_drafter,
        prompts_available,
    ]


def estimate_bytes(ctx) -> int:
    return 4 << 20


# ------------------------------------------------------------------------------------------------ run


def prompt_ids(tokenizer, messages: list[dict], template_kwargs: dict | None) -> list[int]:
    """The generation prompt's token ids, rendered and tokenized exactly as prepare did for the training data."""
    from eaglekit.data.chat import render_sample

    sample = render_sample(tokenizer, messages, None, "", template_kwargs)
    return sample.input_ids[: sample.prompt_tokens]


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


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@contextlib.contextmanager
def decode_threads(model):
    """One intra-op thread for batch-1 decoding of a small model on the CPU.

    Its matrices are too small to split: extra threads only add synchronisation, which on a machine
    shared with other work made the tiny target's evaluation 16 times slower (373 s against 24 s).
    """
    small = sum(p.numel() for p in model.parameters()) < SMALL_MODEL_PARAMETERS
    threads = torch.get_num_threads()
    if small and next(model.parameters()).device.type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run(ctx) -> dict:
    from eaglekit.model.target import load_target

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = load_target(ctx.cfg.target, device if not ctx.cfg.target.device_map else None)
    with decode_threads(target):
        return evaluate(ctx, target, device)


@dataclass
class DecodingInputs:
    """What a decode loop against the target needs: the checked drafter (on the target's device and dtype),
    its aux layers, the stop ids, and the prompts' token ids."""

    drafter: object
    info: object
    aux: list[int]
    stop_ids: set[int]
    prompts: list[tuple[str, list[int]]]  # (id, prompt token ids)
    skipped_too_long: int
    dtype: torch.dtype
    hf: object = None  # the target's HF config
    tokenizer: object = None  # the target's tokenizer, as prepare used it


def on_target(drafter, info, target, device: torch.device):
    """The drafter on the target's device, in its dtype (as in vLLM and SGLang), with the target's embedding where
    the checkpoint left it out."""
    from eaglekit.model.target import decoder_parts

    dtype = next(target.parameters()).dtype
    drafter = drafter.to(device, dtype)
    if info.missing_embeddings:
        drafter.embed_tokens.weight.data.copy_(decoder_parts(target)[0].embed_tokens.weight.to(device, dtype))
    return drafter


def tokenize_prompts(
    cfg: RunConfig, tokenizer, hf, source: list[tuple[str, list[dict]]], max_new_tokens: int, stage: str = NAME
) -> tuple[list[tuple[str, list[int]]], int]:
    """(id, prompt token ids) of the prompts that leave room for ``max_new_tokens``, and how many did not."""
    template_kwargs = cfg.generate.extra_body.get("chat_template_kwargs") or None  # as the target was served
    room = int(hf.max_position_embeddings) - max_new_tokens
    prompts, too_long = [], []
    for pid, messages in source:
        ids = prompt_ids(tokenizer, messages, template_kwargs)
        (prompts if len(ids) <= room else too_long).append((pid, ids))
    if too_long:
        console.print(
            f"[yellow]{stage}: {len(too_long)} prompts skipped: longer than max_position_embeddings "
            f"{hf.max_position_embeddings} - max_new_tokens {max_new_tokens}[/]"
        )
    if not prompts:
        raise UsageError(
            f"no evaluation prompt fits in {room} tokens", f"lower {stage}.max_new_tokens or use shorter prompts"
        )
    return prompts, len(too_long)


def decoding_inputs(
    cfg: RunConfig, target, device: torch.device, max_new_tokens: int, num_samples: int | None = None, stage: str = NAME
) -> DecodingInputs:
    """The drafter and the evaluation prompts, tokenized exactly as prepare did and as an engine is sent them.

    Shared by evaluate and verify, so that both decode the same prompts with the same drafter.
    """
    from eaglekit.data.chat import end_of_turn_token_ids, load_tokenizer

    drafter, info, hf, aux = load_checked_drafter(cfg)
    drafter = on_target(drafter, info, target, device)
    tokenizer = load_tokenizer(cfg.target.model, cfg.target.chat_template, cfg.target.trust_remote_code)
    prompts, skipped = tokenize_prompts(cfg, tokenizer, hf, eval_prompts(cfg, num_samples), max_new_tokens, stage)
    return DecodingInputs(
        drafter,
        info,
        aux,
        end_of_turn_token_ids(tokenizer),
        prompts,
        skipped,
        next(target.parameters()).dtype,
        hf,
        tokenizer,
    )


def evaluate(ctx, target, device: torch.device) -> dict:
    cfg, ec = ctx.cfg, ctx.cfg.evaluate
    inputs = decoding_inputs(cfg, target, device, ec.max_new_tokens)
    drafter, info, aux, stop_ids, prompts, dtype = (
        inputs.drafter,
        inputs.info,
        inputs.aux,
        inputs.stop_ids,
        inputs.prompts,
        inputs.dtype,
    )
    start = load_starting_drafter(cfg, inputs.hf, aux)
    start_drafter = on_target(*start, target, device) if start else None

    ks = sorted(set(ec.num_speculative_tokens))
    temperatures = list(dict.fromkeys(ec.temperatures))
    methods = [m for m in METHODS if m != "eagle_start" or start]
    new_proposer = {
        "eagle": lambda: proposer_for(drafter, aux),
        "eagle_start": lambda: proposer_for(start_drafter, aux),
        "ngram": lambda: NgramProposer(ec.ngram_min, ec.ngram_max),
    }

    def decode(ids: list[int], i: int, temperature: float, method: str | None = None, k: int = 0):
        generator = torch.Generator().manual_seed(ec.seed * 1_000_003 + i)
        return generate(
            target,
            ids,
            ec.max_new_tokens,
            proposer=new_proposer[method]() if method else None,
            k=k,
            temperature=temperature,
            generator=generator,
            stop_ids=stop_ids,
        )

    # the first calls pay one-time costs (allocator, kernels); keep them out of the timings
    for proposer in (None, new_proposer["eagle"]()):
        generate(target, prompts[0][1], 8, proposer=proposer, k=max(ks))

    def measure(prompts: list[tuple[str, list[int]]], methods: list[str], label: str) -> dict:
        """Prompt by prompt, plain decoding and then every method and K: the timings compared share a time window."""
        baselines, results = [], []
        checks = {pid: [] for pid, _ in prompts}  # per prompt: the speculative runs that differed from plain greedy
        plain_tokens: dict[str, int] = {}
        total = len(temperatures) * len(prompts) * (1 + len(methods) * len(ks))
        with Meter(label, total=total, unit="runs") as meter:
            for temperature in temperatures:
                plain = DecodeStats()
                spec = {(m, k): DecodeStats(drafted=[0] * k, accepted=[0] * k) for m in methods for k in ks}
                for i, (pid, ids) in enumerate(prompts):
                    reference = decode(ids, i, temperature)
                    plain = plain + reference.stats
                    if temperature == 0:
                        plain_tokens[pid] = len(reference.tokens)
                    meter.update(1, T=temperature)
                    for method, k in spec:
                        out = decode(ids, i, temperature, method, k)
                        spec[method, k] = spec[method, k] + out.stats
                        if temperature == 0 and out.tokens != reference.tokens:
                            checks[pid].append(
                                {
                                    "method": method,
                                    "k": k,
                                    "first_difference": first_difference(out.tokens, reference.tokens),
                                }
                            )
                        meter.update(1, method=method, K=k, tau=round(spec[method, k].tau, 3))
                baselines.append(
                    {
                        "temperature": temperature,
                        "tokens": plain.new_tokens,
                        "seconds": round(plain.seconds, 3),
                        "tokens_per_second": round(plain.tokens_per_second, 2),
                    }
                )
                results += [result_row(method, k, temperature, stats, plain) for (method, k), stats in spec.items()]
        return {"baselines": baselines, "results": results, "checks": checks, "plain_tokens": plain_tokens}

    main = measure(prompts, methods, "evaluate: decode")
    results, checks = main["results"], main["checks"]
    finetune = None
    if start:
        sets = [(ec.prompts or "held-out split of generate/responses.jsonl", len(prompts), results)]
        if ec.prompts:  # production-like prompts were given: the finetuning data's own held-out split too
            try:
                heldout, _ = tokenize_prompts(cfg, inputs.tokenizer, inputs.hf, heldout_prompts(cfg), ec.max_new_tokens)
            except UsageError as err:
                console.print(f"[yellow]evaluate: the finetune is compared on evaluate.prompts only: {err.message}[/]")
            else:
                extra = measure(heldout, ["eagle", "eagle_start"], "evaluate: finetune vs start, held-out split")
                sets.insert(0, ("held-out split of generate/responses.jsonl", len(heldout), extra["results"]))
        finetune = finetune_comparison(str(cfg.train.init_from), sets)

    greedy_checked = 0 in temperatures
    lossless = all(not c for c in checks.values()) if greedy_checked else None
    report = {
        "checkpoint": str(info.path),
        "checkpoint_form": info.form,
        "target": cfg.target.model,
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "prompts_source": ec.prompts or "generate/responses.jsonl (held-out split)",
        "prompts": len(prompts),
        "prompts_skipped_too_long": inputs.skipped_too_long,
        "max_new_tokens": ec.max_new_tokens,
        "num_speculative_tokens": ks,
        "temperatures": temperatures,
        "ngram": {"min": ec.ngram_min, "max": ec.ngram_max},
        "draft_selection": "argmax, verified as a point mass (as vLLM and SGLang)",
        "lossless": lossless,
        "lossless_checks": [
            {
                "id": pid,
                "new_tokens": main["plain_tokens"].get(pid),
                "lossless": not checks[pid] if greedy_checked else None,
                "differences": checks[pid],
            }
            for pid, _ in prompts
        ],
        "baseline": main["baselines"],
        "results": results,
        "comparison": comparison(results),
        "finetune": finetune,
    }
    report["warnings"] = degenerate(report, ec.num_samples, cfg.data.eval_fraction)
    for warning in report["warnings"]:
        ctx.warn(warning)
    out = ctx.dir
    atomic.write_json(out / "report.json", report)
    atomic.write_text(out / "report.md", report_markdown(report))
    plots.acceptance_by_position(results, out / "acceptance_by_position.png")
    plots.tau_vs_k(results, out / "tau_vs_k.png")
    if lossless is False:
        bad = [pid for pid, c in checks.items() if c]
        console.print(
            f"[bold red]evaluate: speculative greedy output differs from plain greedy output on {len(bad)} "
            f"prompts (e.g. {bad[0]}); see report.json lossless_checks[/]"
        )
    console.print(report_markdown(report, tables_only=True))
    return counts(report)


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
            "like the prompts it lost on, train fewer steps or at a lower lr, or set train.anchor_weight "
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


def eagle_beats_ngram(report: dict, temperature: float = 0.0, margin: float = 1.0) -> bool:
    """True when at ``temperature`` the drafter's τ is at least ``margin`` × the n-gram's for every K."""
    rows = [r for r in report["comparison"] if r["temperature"] == temperature]
    return bool(rows) and all(r["eagle_tau"] >= margin * r["ngram_tau"] for r in rows)


def counts(report: dict) -> dict:
    temperature = min(report["temperatures"])
    out = {"prompts": report["prompts"], "lossless": report["lossless"], "temperature": temperature}
    for r in report["results"]:
        if r["temperature"] == temperature:
            out[f"{r['method']}_tau_k{r['k']}"] = r["tau"]
    if report.get("finetune"):
        out["finetune_vs_start"] = {s["prompts"]: s["mean_ratio"] for s in report["finetune"]["sets"]}
    return out


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
    return "\n".join(lines) + "\n"
