"""verify: the exported drafter measured in the serving engine, against eaglekit's offline figures.

A drafter can train and evaluate well and still serve with a fraction of its acceptance, without an error
anywhere: an aux-layer id read with the other engine's convention, a ``norm_before_residual`` the engine
defaults differently, RoPE settings or ``max_position_embeddings`` not the target's, ``d2t`` offsets, an
embedding the engine does not share. verify serves the forms ``export`` wrote, sends the evaluation prompts
(the very token ids eaglekit decodes) at temperature 0 with the configured K, reads the engine's own
counters, and decodes the same prompts offline with the trained checkpoint, counting as the engine counts
(``engine_accounting`` in ``eaglekit.speculative.decode``). It passes when, for every form and K, τ and the
acceptance rate at every draft position agree within the tolerances, and the served greedy outputs equal
plain greedy decoding. A failure names the likely causes in order, beside the settings the engine actually
reads from the exported config.json (``checkpoints.served_settings``).

Two ways to reach an engine (``verify`` runs only when one is set):

* ``verify.engine: vllm`` — eaglekit starts vLLM (``verify.python``'s environment) on a free loopback port
  for each exported form and K, and stops it after: the legacy form as
  ``--speculative-config '{"method": "eagle3", "model": DIR, ...}'``, the speculators form as ``vllm serve
  DIR`` (the target comes from its config).
* ``verify.server: URL`` — a vLLM or SGLang server you started with the command ``export`` printed; K is
  the server's. SGLang must draft a chain (``--speculative-eagle-topk 1``).

The two are implementations of ``ServedEngine`` (``EaglekitVllm``, ``UserServer``), chosen once by
``served_engine``; the diagnosis is the served folder's family's (``DrafterFamily.diagnosis``: one function per cause,
``drafters/eagle3_diagnosis.py``, ``drafters/block_diagnosis.py``); the report is rendered by
``eaglekit.data.verify_report``.

Writes ``verify/report.json``, ``report.md``, ``acceptance.png`` and the engines' logs (``logs/``).
"""

from __future__ import annotations

import gc
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from eaglekit import atomic
from eaglekit.config import RunConfig
from eaglekit.contract import Estimate, Sizes, Stage, StageContext
from eaglekit.data.suites import load_suite
from eaglekit.data.verify_report import (
    ENGINE_SETTINGS,
    failure_message,
    report_markdown,
    verdict_counts,
)
from eaglekit.drafters.paths import checkpoint_path
from eaglekit.errors import EaglekitError, UsageError
from eaglekit.preflight import fail, ok, run_directory, skip, will_be_produced
from eaglekit.progress import Meter, console
from eaglekit.resolved import ResolvedRun
from eaglekit.rundir import file_identity
from eaglekit.serving.engine import VllmServer, find_vllm_python, is_cpu_build, supports_flag
from eaglekit.serving.engine import version as engine_version
from eaglekit.serving.engine_features import verify_check
from eaglekit.serving.engine_settings import (
    EngineSettings,
    drafts_per_pass,
    from_args,
    from_log,
    from_server,
    setting_effects,
)
from eaglekit.serving.speculation import (
    Counters,
    Served,
    SglangClient,
    VllmClient,
    detect,
    request_spread,
    sglang_batch,
    vllm_batch,
)
from eaglekit.training.checkpoint_integrity import damaged_drafter, refuse_damaged_drafter

NAME = "verify"
UPSTREAM = "export"
DETAILED_METRICS_FLAG = "--per-request-spec-decode-metrics"


def forms(cfg: RunConfig) -> list[str]:
    """The exported forms verify serves: verify.formats, else those export wrote (an MLA drafter's: the plain
    form only) — read from export's folder once it holds them, so `status` asks no family (and loads no torch)."""
    if cfg.verify.formats:
        return list(dict.fromkeys(cfg.verify.formats))
    export = cfg.run_path / "export"
    written = sorted(p.name for p in export.iterdir() if (p / "config.json").is_file()) if export.is_dir() else []
    if written:
        return written
    from eaglekit.drafters.checked import written_forms  # lazy: heavy (torch)

    return list(dict.fromkeys(written_forms(cfg)))


def speculative_tokens(cfg: RunConfig) -> list[int]:
    return sorted(set(cfg.verify.num_speculative_tokens or [cfg.export.num_speculative_tokens]))


def num_samples(cfg: RunConfig) -> int:
    return cfg.verify.num_samples or cfg.evaluate.num_samples


def max_new_tokens(cfg: RunConfig) -> int:
    return cfg.verify.max_new_tokens or cfg.evaluate.max_new_tokens


def params(run: ResolvedRun) -> dict:
    cfg = run.cfg
    p = cfg.verify.model_dump(exclude={"startup_timeout", "timeout", "python"})
    p.update(
        formats=forms(cfg),
        num_speculative_tokens=speculative_tokens(cfg),
        num_samples=num_samples(cfg),
        max_new_tokens=max_new_tokens(cfg),
    )
    # what is served: an exported config.json edited by hand makes verify stale
    p["exported"] = {form: file_identity(cfg.run_path / "export" / form) for form in forms(cfg)}
    return p


# -------------------------------------------------------------------------------------------- checks


def configured(ctx: StageContext):
    vc = ctx.cfg.verify
    if vc.engine:
        return ok(
            "verify target",
            f"eaglekit starts {vc.engine} for the forms {', '.join(forms(ctx.cfg))}, K {speculative_tokens(ctx.cfg)}",
        )
    if vc.server:
        return ok("verify target", f"the server at {vc.server}")
    return fail(
        "verify target",
        "neither verify.engine nor verify.server is set",
        "set verify.engine: vllm (eaglekit starts it), or verify.server: URL of a server you started with "
        "the command `eaglekit export` printed",
    )


def engine_available(ctx: StageContext):
    vc = ctx.cfg.verify
    try:
        if vc.engine == "vllm":
            python = find_vllm_python(vc.python)
            return ok("engine", f"vLLM at {python} ({engine_version(python)})")
        if vc.server:
            return ok("engine", f"{detect(vc.server)} answers at {vc.server}")
    except EaglekitError as err:
        return fail("engine", err.message, err.remedy or "")
    return ok("engine", "not configured")


def exported_forms(ctx: StageContext):
    if not ctx.cfg.verify.engine:
        return ok("exported forms", "served by your server")
    pending = will_be_produced(ctx, "exported forms", "export")
    if pending:
        return pending
    missing = [f for f in forms(ctx.cfg) if not (ctx.cfg.run_path / "export" / f / "config.json").exists()]
    if missing:
        return fail(
            "exported forms",
            f"{', '.join(missing)} not found under {ctx.cfg.run_path / 'export'}",
            "export them: `eaglekit run CONFIG --until export` (or set verify.formats to the forms it wrote)",
        )
    for form in forms(ctx.cfg):  # what is served must be the bytes export wrote (its digests)
        damaged = damaged_drafter(ctx.cfg.run_path / "export" / form, "exported drafter")
        if damaged:
            return fail("exported forms", damaged.message, damaged.remedy or "")
    return ok("exported forms", ", ".join(forms(ctx.cfg)))


def engine_serves_forms(ctx: StageContext):
    """A form the configured engine cannot serve is named here, before an engine starts for it."""
    from eaglekit.drafters.checked import drafter_family  # lazy: heavy (torch)

    vc = ctx.cfg.verify
    family = drafter_family(ctx.cfg)  # the trained checkpoint's
    if vc.engine != "vllm" or family.engine.vllm_cpu_refusal is None:
        return ok("engine serves the forms", "nothing this engine is known to refuse")
    try:
        python = find_vllm_python(vc.python)
    except EaglekitError:
        return skip("engine serves the forms", "no vLLM found (the engine check says why)")
    if is_cpu_build(python):
        folders = ", ".join(str(ctx.cfg.run_path / "export" / form) for form in forms(ctx.cfg))
        return fail(
            "engine serves the forms",
            f"{family.engine.vllm_cpu_refusal}; the exported drafter is {folders}",
            "verify it on a GPU machine (verify.python: a CUDA build of vLLM >= 0.32, which runs the V2 model "
            "runner), or drop the verify section on this machine; evaluate's figures are eaglekit's offline decoding",
        )
    return ok(
        "engine serves the forms", f"{family.name}: {python} is not the CPU build (its V2 model runner serves it)"
    )


def served_context_fits(ctx: StageContext) -> list:
    """The context the engine serves against the prompts verify sends it and the drafter it serves."""
    from eaglekit.preflight import served_context  # lazy: heavy (torch)

    folders = {form: ctx.cfg.run_path / "export" / form for form in forms(ctx.cfg)}
    return [
        served_context.prompts_fit(ctx, num_samples(ctx.cfg), max_new_tokens(ctx.cfg)),
        *served_context.drafter_fits(ctx, folders),
    ]


def checks(cfg: RunConfig) -> list:
    from eaglekit.preflight.drafter import drafter_checkpoint, prompts_available  # lazy: heavy (torch)
    from eaglekit.preflight.engine_features import served_features_read  # lazy: heavy (torch)

    return [
        configured,
        engine_available,
        exported_forms,
        served_context_fits,
        engine_serves_forms,
        served_features_read,
        run_directory.target_folder,
        drafter_checkpoint,
        prompts_available,
    ]


def estimate(ctx: StageContext, sizes: Sizes | None) -> Estimate:
    """Pre-flight: the report, plot and the engines' logs. A plan leaves verify unsized (as before the contract;
    giving it these 16 MiB there too would change `eaglekit plan`'s verdicts)."""
    return Estimate(bytes=16 << 20) if sizes is None else Estimate()


# ------------------------------------------------------------------------------------------- offline


@dataclass
class Offline:
    """eaglekit's figures on the prompts verify sends: plain greedy outputs, and speculative decoding per K
    counted as an engine counts."""

    prompts: list[tuple[str, list[int]]]
    stop_ids: list[int]
    aux: list[int]
    plain: dict[str, list[int]] = field(default_factory=dict)
    eagle: dict[int, dict] = field(default_factory=dict)  # K -> {id: Generation}
    dtype: str = ""
    # verify.suites: (suite, reasoning mode) -> its prompts, sent as a batch of their own so that the engine's
    # counters can be read per suite; their ids are in plain and eagle too
    suites: dict[tuple[str, str], list[tuple[str, list[int]]]] = field(default_factory=dict)

    def all_prompts(self) -> list[tuple[str, list[int]]]:
        return self.prompts + [p for group in self.suites.values() for p in group]

    def counters(self, k: int, prompts: list[tuple[str, list[int]]] | None = None) -> Counters:
        """Counted as the engine counts, over ``prompts`` (default: the evaluation prompts)."""
        stats = [self.eagle[k][pid].stats for pid, _ in (self.prompts if prompts is None else prompts)]
        return Counters(
            sum(s.drafted[0] if s.drafted else 0 for s in stats),
            [sum(s.accepted[i] for s in stats) for i in range(k)],
            emitted=sum(s.new_tokens for s in stats),
            verify_passes=sum(s.rounds for s in stats),
        )


def engine_stop_ids(cfg: RunConfig, stop_ids: set[int]) -> list[int]:
    """The end-of-turn ids plus the generation config's EOS ids, which engines stop at by default: the set
    sent with every request and used offline, so that both stop at the same tokens."""
    from transformers import GenerationConfig  # lazy: heavy (transformers)

    ids = set(stop_ids)
    try:
        eos = GenerationConfig.from_pretrained(
            cfg.target.model, trust_remote_code=cfg.target.trust_remote_code
        ).eos_token_id
    except (OSError, ValueError):
        eos = None
    ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return sorted(ids)


def offline_figures(cfg: RunConfig, ks: list[int]) -> Offline:
    """Decode the prompts with the trained checkpoint and the HF target (freed again before any engine starts:
    both would want the same accelerator)."""
    import torch  # lazy: heavy (torch)

    from eaglekit.drafters.checked import decoding_inputs  # lazy: heavy (torch)
    from eaglekit.drafters.registry import proposer_for  # lazy: heavy (torch)
    from eaglekit.model.target import load_target  # lazy: heavy (torch)
    from eaglekit.speculative.decode import generate  # lazy: heavy (torch)
    from eaglekit.speculative.inputs import decode_threads  # lazy: heavy (torch)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = load_target(cfg.target, device if not cfg.target.device_map else None)
    limit = max_new_tokens(cfg)
    try:
        with decode_threads(target):
            inputs = decoding_inputs(cfg, target, device, limit, num_samples(cfg), stage=NAME)
            stop = engine_stop_ids(cfg, inputs.stop_ids)
            out = Offline(inputs.prompts, stop, inputs.aux, dtype=str(inputs.dtype).replace("torch.", ""))
            out.suites = suite_prompt_groups(cfg, target, inputs, set(stop), limit)
            everything = out.all_prompts()
            with Meter("verify: offline decode", total=len(everything) * (1 + len(ks)), unit="runs") as meter:
                for pid, ids in everything:
                    out.plain[pid] = generate(target, ids, limit, stop_ids=set(stop)).tokens
                    meter.update(1)
                    for k in ks:
                        out.eagle.setdefault(k, {})[pid] = generate(
                            target,
                            ids,
                            limit,
                            proposer=proposer_for(inputs.drafter, inputs.aux),
                            k=k,
                            stop_ids=set(stop),
                            engine_accounting=True,
                        )
                        meter.update(1, K=k)
    finally:
        del target
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def suite_prompt_groups(cfg: RunConfig, target, inputs, stop: set[int], limit: int) -> dict:
    """``verify.suites`` (default ``evaluate.suites``) in each of evaluate's reasoning modes, turn by turn, as
    evaluate renders them: (suite, mode) -> [(id, prompt ids)]."""
    from eaglekit.speculative.benchmark import reasoning_modes, suite_prompts, template_kwargs  # lazy: heavy (torch)

    suites = cfg.verify.suites if cfg.verify.suites is not None else cfg.evaluate.suites
    served = cfg.generate.extra_body.get("chat_template_kwargs")
    room = int(inputs.hf.max_position_embeddings) - limit
    groups = {}
    for suite in suites:
        items = load_suite(suite.name, suite.num_samples or num_samples(cfg), suite.path)
        for mode in reasoning_modes(cfg.evaluate.reasoning):
            kwargs = template_kwargs(served, cfg.evaluate.chat_template_kwargs, mode)
            prompts, _ = suite_prompts(
                target, inputs.tokenizer, items, kwargs, limit, stop, room, suite.max_prompt_tokens
            )
            if prompts:
                groups[suite.name, mode] = [(f"{p.item_id}#turn{p.turn}@{mode}", p.ids) for p in prompts]
    return groups


# -------------------------------------------------------------------------------------------- served


@dataclass
class ServedRun:
    form: str  # exported form, or "served" for a server the user started
    k: int
    engine: str  # "vllm" | "sglang"
    launch: str  # how the engine was started (or the URL)
    served: dict[str, Served]
    counters: Counters
    log: str | None = None
    suite_counters: dict[tuple[str, str], Counters] = field(default_factory=dict)
    attention_backends: list[str] = field(default_factory=list)  # as vLLM's log names them (they differ by CPU)
    settings: EngineSettings = field(default_factory=EngineSettings)  # the speculative settings it served with


def vllm_launch(cfg: RunConfig, form: str, folder: Path, k: int) -> tuple[str, list[str], str]:
    """(model, flags, description) that serve ``folder`` with K drafts: the commands export printed."""
    from eaglekit.drafters.registry import vllm_speculative_config  # lazy: heavy (torch)

    spec = json.dumps(vllm_speculative_config(form, folder, k))
    model = cfg.target.model
    if form == "speculators":
        raw = json.loads((folder / "config.json").read_text())
        verifier = ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        if verifier and verifier_is_target(verifier, cfg.target.model):
            # `vllm serve DIR`: vLLM takes the target from the config; --speculative-config only overrides K
            model, spec = str(folder.resolve()), json.dumps({"num_speculative_tokens": k})
    return model, ["--speculative-config", spec], f"vllm serve {model} --speculative-config '{spec}'"


def verifier_is_target(verifier: str, target: str) -> bool:
    if verifier == target:
        return True
    try:
        return Path(verifier).resolve() == Path(target).resolve() and Path(verifier).exists()
    except OSError:
        return False


class ServedEngine(Protocol):
    """An engine verify measures, chosen once (``served_engine``): the vLLM eaglekit starts for each exported form
    and K, or the server the user started."""

    name: str  # "vllm" | "sglang": whose counters and config conventions the report compares with
    version: str | None  # the engine's version, where eaglekit knows it
    ks: list[int]  # the K's measured, known before the offline decode

    def runs(self, offline: Offline) -> list[ServedRun]:
        """Every prompt of ``offline`` served at temperature 0, once per form and K."""
        ...

    def folders(self) -> dict[str, Path]:
        """Each run's form -> the drafter folder the engine reads (what the diagnosis reads as the engine does)."""
        ...


def served_engine(ctx: StageContext) -> ServedEngine:
    vc = ctx.cfg.verify
    if vc.server:  # a running server wins over verify.engine: it is what the user asked to check
        return UserServer(ctx.cfg, vc.server)
    if vc.engine:
        return EaglekitVllm(ctx)
    raise UsageError(
        "verify: neither verify.engine nor verify.server is set",
        "set verify.engine: vllm, or verify.server: URL of a server you started",
    )


class EaglekitVllm:
    """verify.engine: vLLM from verify.python's environment, started on a free loopback port for each exported
    form and K, and stopped after."""

    name = "vllm"

    def __init__(self, ctx: StageContext):
        self.ctx, self.cfg = ctx, ctx.cfg
        self.python = find_vllm_python(ctx.cfg.verify.python)
        self.version: str | None = engine_version(self.python)
        self.ks = speculative_tokens(ctx.cfg)

    def folders(self) -> dict[str, Path]:
        return {form: self.cfg.run_path / "export" / form for form in forms(self.cfg)}

    def runs(self, offline: Offline) -> list[ServedRun]:
        supported = supports_flag(self.python, DETAILED_METRICS_FLAG)
        detailed = [DETAILED_METRICS_FLAG, "detailed"] if supported else []
        return [
            self.serve(form, folder, k, offline, detailed) for form, folder in self.folders().items() for k in self.ks
        ]

    def serve(self, form: str, folder: Path, k: int, offline: Offline, detailed: list[str]) -> ServedRun:
        """One engine start: ``folder`` served with K drafts, every prompt sent, the engine stopped after."""
        cfg, vc = self.cfg, self.cfg.verify
        model, args, launch = vllm_launch(cfg, form, folder, k)
        log = self.ctx.dir / "logs" / f"vllm-{form}-k{k}.log"
        log.unlink(missing_ok=True)
        console.print(f"verify: starting vLLM — {launch}; log {log}")
        server = VllmServer(
            self.python, model, args + detailed + list(vc.engine_args), log, startup_timeout=vc.startup_timeout
        )
        total = len(offline.all_prompts())
        with server, Meter(f"verify: {form} K={k} served", total=total, unit="requests") as meter:
            client = VllmClient(server.url, vc.timeout)
            run = ServedRun(form, k, "vllm", launch, {}, Counters(), str(log))
            run.attention_backends = server.attention_backends()
            run.settings = EngineSettings.read(
                ("command", from_args(server.command())), ("log", from_log(server.log_text()))
            )
            send_batches(
                run, offline, lambda ps: vllm_batch(client, ps, max_new_tokens(cfg), offline.stop_ids, meter.update)
            )
        return run


class UserServer:
    """verify.server: a vLLM or SGLang server the user started with the command export printed; K is the
    server's, asked before anything else."""

    version: str | None = None

    def __init__(self, cfg: RunConfig, url: str):
        vc = cfg.verify
        self.cfg, self.url = cfg, url
        self.name = detect(url)
        self.client = SglangClient(url, vc.timeout) if self.name == "sglang" else VllmClient(url, vc.timeout)
        k = self.client.num_speculative_tokens()
        if not k:
            raise EaglekitError(
                f"the vLLM server at {url} registers no speculative-decoding counters: it does not speculate",
                "start it with the command `eaglekit export` printed",
            )
        if vc.num_speculative_tokens and k not in vc.num_speculative_tokens:
            raise UsageError(
                f"the server at {url} drafts K={k}, verify.num_speculative_tokens asks for {vc.num_speculative_tokens}",
                "restart the server with that K, or drop the key (a running server's K is the one verified)",
            )
        self.ks = [k]

    def folders(self) -> dict[str, Path]:
        """SGLang names its draft folder; otherwise the export this config wrote, as the served one."""
        client, export = self.client, self.cfg.run_path / "export"
        if isinstance(client, SglangClient) and client.draft_model_path:
            return {"served": Path(client.draft_model_path)}
        return {"served": export / ("eagle3" if self.name == "sglang" else forms(self.cfg)[0])}

    def runs(self, offline: Offline) -> list[ServedRun]:
        client, k, limit = self.client, self.ks[0], max_new_tokens(self.cfg)
        run = ServedRun("served", k, self.name, self.url, {}, Counters())
        if isinstance(client, VllmClient):  # what a running vLLM says of its config (/server_info: dev mode only)
            run.settings = EngineSettings.read(("/server_info", from_server(client.root, self.cfg.verify.timeout)))
        with Meter("verify: served", total=len(offline.all_prompts()), unit="requests") as meter:
            if isinstance(client, SglangClient):
                send_batches(
                    run, offline, lambda ps: sglang_batch(client, ps, limit, offline.stop_ids, k, meter.update)
                )
            else:
                send_batches(run, offline, lambda ps: vllm_batch(client, ps, limit, offline.stop_ids, meter.update))
        return [run]


def send_batches(run: ServedRun, offline: Offline, batch) -> None:
    """The evaluation prompts, then each suite's, as batches of their own: the engine's counters per batch."""
    run.served, run.counters = batch(offline.prompts)
    for group, prompts in offline.suites.items():
        served, run.suite_counters[group] = batch(prompts)
        run.served.update(served)


# ---------------------------------------------------------------------------------------- comparison


def compare(run: ServedRun, offline: Offline, cfg: RunConfig) -> dict:
    """One form and K: τ, acceptance per position, greedy outputs, and (vLLM, per-request metrics) the
    accepted count of every verify pass, each against eaglekit's offline figures."""
    vc = cfg.verify
    mine, theirs = offline.counters(run.k), run.counters
    sglang = run.engine == "sglang"
    tau_served, tau_offline = (sglang_tau(theirs), sglang_tau(mine)) if sglang else (theirs.tau, mine.tau)
    speculating = bool(theirs.verify_passes) if sglang else theirs.drafts > 0
    positions = position_rates(theirs, mine) if theirs.drafts > 0 or not sglang else []
    differing = greedy_differences(run, offline)
    per_round = [
        (pid, run.served[pid].accepted_per_round, offline.eagle[run.k][pid].accepted_per_round)
        for pid, _ in offline.prompts
        if run.served[pid].accepted_per_round is not None
    ]
    relative = abs(tau_served - tau_offline) / tau_offline if tau_offline else 0.0
    by_context = served_tau_by_context(run, offline)
    worst = max((abs(p["difference"]) for p in positions), default=0.0)
    checks = {
        "speculating": speculating,
        "tau": speculating and relative <= vc.tau_tolerance,
        "positions": speculating and worst <= vc.position_tolerance,
        "greedy": len(differing) <= vc.greedy_tolerance * len(offline.prompts),
    }
    suites = [compare_suite(run, offline, group, vc.tau_tolerance) for group in offline.suites]
    per_pass = drafts_per_pass(theirs.draft_tokens, theirs.drafts)
    if suites:
        checks["suites"] = all(s["passed"] for s in suites)
    return {
        "form": run.form,
        "k": run.k,
        "engine": run.engine,
        "launch": run.launch,
        "log": run.log,
        "attention_backends": run.attention_backends,
        "engine_settings": run.settings.as_dict(),
        "drafts_per_pass": round(per_pass, 4) if per_pass is not None else None,
        "setting_effects": [vars(e) for e in setting_effects(run.settings.values, run.k, per_pass, 0.0)],
        "suites": suites,
        "tau": {
            "served": round(tau_served, 4),
            "offline": round(tau_offline, 4),
            "relative_difference": round(relative, 4),
            "definition": "completion tokens / verify passes (SGLang)" if sglang else "1 + accepted / drafts (vLLM)",
        },
        "tau_by_context": by_context,
        "served": counter_figures(theirs),
        "offline": counter_figures(mine),
        "positions": positions,
        "largest_position_difference": round(worst, 4),
        # how τ varies between these prompts (eaglekit's decode, counted as the engine counts): `eaglekit watch`'s
        # band on served τ is as wide as this many prompts measured it
        "request_spread": request_spread([per_request(offline.eagle[run.k][pid].stats) for pid, _ in offline.prompts]),
        "greedy": {
            "identical": len(offline.prompts) - len(differing),
            "prompts": len(offline.prompts),
            "differing": differing,
        },
        "rounds": {"compared": len(per_round), "identical": sum(s == o for _, s, o in per_round)}
        if per_round
        else None,
        "checks": checks,
        "passed": all(checks.values()),
    }


def served_tau_by_context(run: ServedRun, offline: Offline) -> dict | None:
    """τ per context group, served beside offline, where the engine reports each request's passes (vLLM's
    per-request metrics) and the evaluation prompts' passes fall in more than one group: a drafter that holds
    offline at long context but falls served is read apart from one that falls in both."""
    from eaglekit.speculative.decode import (  # lazy: heavy (torch)
        CONTEXT_BUCKETS,
        served_context_per_round,
        tau_by_context_of,
    )

    rounds = {pid: run.served[pid].accepted_per_round for pid, _ in offline.prompts}
    if run.engine != "vllm" or any(r is None for r in rounds.values()):
        return None
    served = tau_by_context_of(
        [(rounds[pid] or [], served_context_per_round(len(ids), rounds[pid] or [])) for pid, ids in offline.prompts]
    )
    mine = tau_by_context_of(
        [(gen.accepted_per_round, gen.context_per_round) for gen in (offline.eagle[run.k][pid] for pid in rounds)]
    )
    if len(set(served) | set(mine)) < 2:
        return None

    def figures(group: dict | None) -> dict | None:
        return {"rounds": group["rounds"], "tau": round(group["tau"], 4)} if group else None

    return {
        label: {"served": figures(served.get(label)), "offline": figures(mine.get(label))}
        for label, _ in CONTEXT_BUCKETS
        if label in served or label in mine
    }


def mean_length(sequences: list[list[int]]) -> float | None:
    return round(sum(map(len, sequences)) / len(sequences), 1) if sequences else None


def per_request(stats) -> tuple[int, list[int]]:
    """One prompt's drafts (verify passes that drafted) and accepted tokens per position, counted as the engine counts."""
    return (stats.drafted[0] if stats.drafted else 0), list(stats.accepted)


def sglang_tau(counters: Counters) -> float:
    """SGLang's own τ: completion tokens per verify pass, the prefill's token included."""
    return (counters.emitted or 0) / counters.verify_passes if counters.verify_passes else 1.0


def position_rates(theirs: Counters, mine: Counters) -> list[dict]:
    return [
        {"position": i + 1, "served": round(s, 4), "offline": round(o, 4), "difference": round(s - o, 4)}
        for i, (s, o) in enumerate(zip(theirs.rates(), mine.rates(), strict=False))
    ]


def greedy_differences(run: ServedRun, offline: Offline) -> list[dict]:
    """The evaluation prompts whose served output is not plain greedy decoding's, with the first token that differs."""
    from eaglekit.speculative.inputs import first_difference  # lazy: heavy (torch)

    return [
        {
            "id": pid,
            "first_difference": first_difference(run.served[pid].tokens, offline.plain[pid]),
            "served_tokens": len(run.served[pid].tokens),
            "plain_tokens": len(offline.plain[pid]),
        }
        for pid, _ in offline.prompts
        if run.served[pid].tokens != offline.plain[pid]
    ]


def counter_figures(counters: Counters) -> dict:
    return {
        "drafts": counters.drafts,
        "draft_tokens": counters.draft_tokens,
        "accepted": counters.accepted,
        "verify_passes": counters.verify_passes,
        "emitted": counters.emitted,
    }


def compare_suite(run: ServedRun, offline: Offline, group: tuple[str, str], tolerance: float) -> dict:
    """One suite in one reasoning mode: the engine's τ on its batch against eaglekit's on the same prompts."""
    prompts = offline.suites[group]
    mine, theirs = offline.counters(run.k, prompts), run.suite_counters[group]
    # served_drafts, the verify passes that carried drafts: the proof the engine speculated at all, even where
    # nothing was accepted
    if run.engine == "sglang":
        served = theirs.emitted / theirs.verify_passes if theirs.emitted and theirs.verify_passes else 1.0
        offline_tau = mine.emitted / mine.verify_passes if mine.emitted and mine.verify_passes else 1.0
        served_drafts = theirs.verify_passes or 0
    else:
        served, offline_tau, served_drafts = theirs.tau, mine.tau, theirs.drafts
    relative = abs(served - offline_tau) / offline_tau if offline_tau else 0.0
    return {
        "suite": group[0],
        "mode": group[1],
        "prompts": len(prompts),
        "served_drafts": served_drafts,
        "served_tau": round(served, 4),
        "offline_tau": round(offline_tau, 4),
        "relative_difference": round(relative, 4),
        "served_positions": [round(r, 4) for r in theirs.rates()],
        "offline_positions": [round(r, 4) for r in mine.rates()],
        "passed": relative <= tolerance,
    }


def diagnose(cfg: RunConfig, folder: Path, engine: str, aux: list[int], runs: list[dict] | None = None) -> list[dict]:
    """The causes of the served folder's family (``DrafterFamily.diagnosis``), most frequent first, each checked
    against what ``engine`` reads from ``folder``; ``runs`` are the compared runs that served it."""
    from eaglekit.drafters.checked import drafter_family  # lazy: heavy (torch)
    from eaglekit.drafters.diagnosis import ServedDrafter  # lazy: heavy (torch)
    from eaglekit.drafters.registry import family_of_folder  # lazy: heavy (torch)

    family = family_of_folder(folder) or drafter_family(cfg)
    return family.diagnosis.diagnose(
        ServedDrafter(cfg, folder, engine, list(aux), checkpoint_path(cfg), list(runs or []))
    )


def settings_cause(runs: list[dict]) -> dict:
    """The engine's speculative settings as a cause of any family: suspect where a run fell short of offline and a
    setting it served with moves τ at T=0 (synthetic rejection, fewer drafts per pass than K, an fp8 draft cache)."""
    from eaglekit.drafters.diagnosis import cause_row  # lazy: heavy (torch)

    effects = [(r, e) for r in runs for e in r["setting_effects"]]
    fell = [r for r in runs if not (r["checks"]["tau"] and r["checks"]["positions"])]
    explaining = [(r, e) for r, e in effects if e["explains_gap"] and r in fell]
    if explaining:
        detail = "; ".join(f"K={r['k']}: {e['setting']} — {e['detail']}" for r, e in explaining)
        return cause_row(ENGINE_SETTINGS, True, detail)
    read = sorted({s for r in runs for s in r["engine_settings"]["sources"]})
    seen = (
        f"read from the {' and '.join(read)}"
        if read
        else "vLLM does not expose them on this server (/server_info answers with VLLM_SERVER_DEV_MODE=1 only)"
    )
    passes = [
        f"K={r['k']}: {r['drafts_per_pass']:.2f} drafts per pass" for r in runs if r["drafts_per_pass"] is not None
    ]
    noted = "; ".join(f"{e['setting']} — {e['detail']}" for _, e in effects)
    return cause_row(
        ENGINE_SETTINGS,
        False,
        (
            noted
            or "standard rejection, greedy drafts, no K schedule, the target's attention and cache: as eaglekit measured"
        )
        + f" ({seen}"
        + (f"; {', '.join(passes)}" if passes else "")
        + ")",
    )


# ---------------------------------------------------------------------------------------------- run


def run(ctx: StageContext) -> dict:
    from eaglekit.preflight import served_context  # lazy: heavy (torch)

    engine = served_engine(ctx)  # before the offline decode: a server that cannot be verified says so at once
    for folder in engine.folders().values():  # what is served must be the bytes export wrote (its digests)
        refuse_damaged_drafter(folder, "exported drafter")
    fits = served_context.prompts_fit(ctx, num_samples(ctx.cfg), max_new_tokens(ctx.cfg))
    if fits.status == "fail":  # also with --skip-preflight: said before the offline decode and any engine start
        raise EaglekitError(f"verify: {fits.detail}", fits.remedy)
    for warning in verify_check(ctx.cfg, engine.folders()):  # refuses a feature the engine would drop
        ctx.warn(warning)
    offline = offline_figures(ctx.cfg, engine.ks)
    report = build_report(ctx.cfg, engine, offline, engine.runs(offline))
    out = ctx.dir
    atomic.write_json(out / "report.json", report)
    atomic.write_text(out / "report.md", report_markdown(report))
    from eaglekit import plots  # lazy: heavy (plots imports matplotlib)

    plots.served_vs_offline(report["runs"], out / "acceptance.png")
    from eaglekit.training.trackers import report_results, verify_tables  # lazy: heavy (torch)

    images = {"verify/acceptance": out / "acceptance.png"}  # into the tracker runs training logged to, if any
    report_results(ctx.run.stage_dir("train"), verify_tables(report), images, ctx.warn)
    console.print(report_markdown(report, summary_only=True))
    counts = verdict_counts(report)
    if report["verdict"] != "PASS":
        ctx.ledger_extra["counts"] = counts  # status shows the verdict of a failed verify too
        raise EaglekitError(
            failure_message(report),
            f"read {out / 'report.md'}; fix the exported config (or "
            "re-export), then rerun `eaglekit verify CONFIG` (a new "
            "measurement replaces this report)",
        )
    return counts


def build_report(cfg: RunConfig, engine: ServedEngine, offline: Offline, runs: list[ServedRun]) -> dict:
    """verify/report.json: each run against the offline figures, and each served folder's diagnosis."""
    vc = cfg.verify
    results = [compare(r, offline, cfg) for r in runs]
    diagnosis = {
        name: diagnose(cfg, folder, engine.name, offline.aux, [r for r in results if r["form"] == name])
        + [settings_cause([r for r in results if r["form"] == name])]
        for name, folder in engine.folders().items()
        if (folder / "config.json").exists()
    }
    # A served config that differs from the trained drafter fails even when these prompts happen not to show it
    # (on the tiny target adjacent layers are alike: aux ids shifted by one may cost nothing measurable).
    differs = any(row["status"] == "suspect" for rows in diagnosis.values() for row in rows)
    passed = all(r["passed"] for r in results) and not differs
    return {
        "verdict": "PASS" if passed else "FAIL",
        "engine": engine.name,
        "engine_version": engine.version,
        "server": vc.server,
        "target": cfg.target.model,
        "offline_dtype": offline.dtype,
        "prompts": len(offline.prompts),
        "max_new_tokens": max_new_tokens(cfg),
        # what the prompts and replies measured here look like, for `eaglekit watch` to tell a shift in served traffic
        "mean_prompt_tokens": mean_length([ids for _, ids in offline.prompts]),
        "mean_reply_tokens": mean_length([offline.plain[pid] for pid, _ in offline.prompts]),
        "prompt_ids": "the token ids eaglekit renders (as prepare did) are sent as the prompt",
        "stop_token_ids": offline.stop_ids,
        "temperature": 0.0,
        "tolerance": {
            "tau_relative": vc.tau_tolerance,
            "position": vc.position_tolerance,
            "greedy_share": vc.greedy_tolerance,
        },
        "runs": results,
        "diagnosis": diagnosis,
    }


STAGE = Stage(
    name=NAME,
    upstream=UPSTREAM,
    reads="export/ and the evaluation prompts; serves them in vLLM (verify.engine) or asks verify.server",
    writes="verify/report.json, verify/report.md, verify/acceptance.png, verify/logs/",
    params=params,
    checks=checks,
    run=run,
    runs_for=lambda cfg: bool(cfg.verify.engine or cfg.verify.server),
    estimate=estimate,
)
