"""``eaglekit watch``: a served drafter's acceptance, window by window, against what the run measured for it.

It reads a running vLLM's ``/metrics`` (the counters verify reads: ``serving/speculation.py``) at the start and end
of each window (``--window-s`` seconds, or ``--window-requests`` finished requests) and compares the window's
served τ and acceptance by draft position with the run's own figures at the served K: verify's served figures
(the same engine, eaglekit's prompts) and evaluate's offline ones.

The band. A pooled acceptance rate over R requests has the standard error s/√R, where s is how much the rate
varies between requests (``request_spread``: the requests are the independent units, since the drafts of one
request share its prompt and accept together). s comes from verify's prompts where verify recorded it, else from
its bound for drafts that accept all together, √(p(1−p)) per position (wider: no alarm on noise either way). The
window and the reference are both samples: the band is reference ± t·s·√(1/R_ref + 1/R_window), t Student's
quantile for ``Z`` normal deviations on R_ref − 1 degrees of freedom (s measured on few prompts is itself uncertain;
``Z`` where s is the bound), R_window the window's finished requests, or its drafts in requests' worth where none
finished. A window whose
τ falls below it raises the alarm, naming the positions below their own bands; a window above it is said, not
alarmed.

What it can tell apart from the counters: another K served (one per-position series per draft position), fewer
drafts per verify pass than K (a batch-size schedule), another drafter served (``--engine-log``, or vLLM's
``/server_info`` in dev mode, name the drafter folder), and a shift in prompt or reply length (vLLM's
``vllm:request_prompt_tokens`` / ``…generation_tokens`` histograms) against verify's prompts. A reasoning-mode
shift is not visible in vLLM's counters.

SGLang (``srt/metrics/collector.py``) keeps no speculation counters: its ``/metrics`` has the gauges
``sglang:spec_accept_length`` and ``sglang:spec_accept_rate``, the mean over the scheduler's last logged decode
interval (``--decode-log-interval`` passes, 40 by default), and the counters ``sglang:num_requests_total``,
``sglang:prompt_tokens_total`` and ``sglang:generation_tokens_total``. Against SGLang a window's τ is that gauge
as the window ends (its last interval's passes, whichever requests they served) and nothing is said by position.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import httpx

from eaglekit import interrupt
from eaglekit.errors import EaglekitError, UsageError
from eaglekit.serving import engine_settings
from eaglekit.serving.engine import metric_sum, parse_prometheus
from eaglekit.serving.speculation import Counters, SglangClient, Snapshot, VllmClient, root_of

Z = 3.0  # band half-width in standard errors: one window in ~700 falls below it by chance
SGLANG_ACCEPT_LENGTH = "sglang:spec_accept_length"  # gauge: mean acceptance length of the last logged interval
SGLANG_REQUESTS = "sglang:num_requests_total"
SGLANG_PROMPT_TOKENS = "sglang:prompt_tokens_total"
SGLANG_GENERATION_TOKENS = "sglang:generation_tokens_total"
LENGTH_SHIFT = 2.0  # a mean reply this many times the reference's (or this fraction of it) is another kind of reply


@functools.lru_cache(maxsize=64)
def critical(z: float, df: int | None) -> float:
    """The multiple of a standard error with the tail of ``z`` standard normal deviations, where the standard error
    itself was estimated from ``df`` + 1 requests: Student's t quantile (found by bisection on its CDF, integrated by
    Simpson's rule; no SciPy in the base install), ``z`` itself where nothing was estimated."""
    if not df:
        return z
    tail = 0.5 * math.erfc(z / math.sqrt(2))
    scale = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def upper(t: float, steps: int = 2000) -> float:  # P(T > t) = 1/2 − ∫_0^t density
        h = t / steps
        total = sum(
            (1 if i in (0, steps) else 4 if i % 2 else 2) * (1 + (i * h) ** 2 / df) ** (-(df + 1) / 2)
            for i in range(steps + 1)
        )
        return 0.5 - scale * total * h / 3

    low, high = z, 50.0
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if upper(mid) > tail else (low, mid)
    return (low + high) / 2


@dataclass
class Reference:
    """What the run measured for the drafter at one K: per-position acceptance over ``requests`` prompts."""

    source: str  # "verify (served, FORM)" | "evaluate (offline, T=...)"
    k: int
    rates: list[float]  # accepted / drafts per draft position
    requests: int
    spread: list[float] | None  # per-position s between requests, where recorded
    tau_spread: float | None
    drafts_per_request: float | None = None
    mean_prompt_tokens: float | None = None
    mean_reply_tokens: float | None = None
    folder: str | None = None  # the exported drafter the reference served

    @property
    def tau(self) -> float:
        return 1 + sum(self.rates)

    def position_spread(self) -> list[float]:
        """s per position: recorded, or the bound for drafts that accept all together, √(p(1−p))."""
        return self.spread or [math.sqrt(p * (1 - p)) for p in self.rates]

    def accepted_spread(self) -> float:
        """s of the accepted tokens per draft: recorded, or the same bound for a chain (a draft accepted at
        position j was accepted at every position before it): Var = Σ p_i(1−p_i) + 2 Σ_{i<j} p_j(1−p_i)."""
        if self.tau_spread is not None:
            return self.tau_spread
        p = self.rates
        var = sum(x * (1 - x) for x in p) + 2 * sum(p[j] * (1 - p[i]) for j in range(len(p)) for i in range(j))
        return math.sqrt(var)


def references(run_dir: Path) -> dict[int, list[Reference]]:
    """K -> the run's figures at K, verify's served ones first, then evaluate's offline ones (T=0, else the
    lowest temperature)."""
    out: dict[int, list[Reference]] = {}
    verify = read_report(run_dir / "verify" / "report.json")
    if verify and verify.get("engine") == "vllm":
        for r in verify.get("runs") or []:
            drafts = r["served"]["drafts"]
            if not drafts:
                continue
            spread = r.get("request_spread") or {}
            out.setdefault(r["k"], []).append(
                Reference(
                    f"verify (served, {r['form']})",
                    r["k"],
                    [a / drafts for a in r["served"]["accepted"]],
                    int(verify["prompts"]),
                    spread.get("spread"),
                    spread.get("tau_spread"),
                    spread.get("drafts_per_request") or drafts / max(int(verify["prompts"]), 1),
                    verify.get("mean_prompt_tokens"),
                    verify.get("mean_reply_tokens"),
                    str(run_dir / "export" / r["form"]) if r["form"] != "served" else None,
                )
            )
    evaluate = read_report(run_dir / "evaluate" / "report.json")
    if evaluate:
        rows = [r for r in evaluate.get("results") or [] if r["method"] == "eagle" and r.get("drafted")]
        for k in sorted({r["k"] for r in rows}):
            row = min((r for r in rows if r["k"] == k), key=lambda r: r["temperature"])
            drafts = row["drafted"][0]
            out.setdefault(k, []).append(
                Reference(
                    f"evaluate (offline, T={row['temperature']:g})",
                    k,
                    [a / drafts for a in row["accepted"]] if drafts else [0.0] * k,
                    int(evaluate["prompts"]),
                    None,
                    None,
                    drafts / max(int(evaluate["prompts"]), 1),
                )
            )
    return out


def read_report(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise EaglekitError(
            f"{path} cannot be read ({err})", f"rerun the stage that writes it (`eaglekit {path.parent.name} CONFIG`)"
        ) from None
    return data if isinstance(data, dict) else None


@dataclass
class Window:
    """One window's counts (the difference of two snapshots) and how they compare."""

    index: int
    seconds: float
    counters: Counters
    requests: float
    prompt_tokens: float
    generation_tokens: float
    tau_gauge: float | None = None  # SGLang: its mean acceptance length over its last logged interval

    @classmethod
    def between(cls, index: int, seconds: float, before: Snapshot, after: Snapshot) -> Window:
        return cls(
            index,
            seconds,
            after.counters - before.counters,
            after.requests - before.requests,
            after.prompt_tokens - before.prompt_tokens,
            after.generation_tokens - before.generation_tokens,
            getattr(after, "tau_gauge", None),
        )


def compare(window: Window, refs: dict[int, list[Reference]], served: dict, z: float = Z) -> dict:
    """The window against the run's figures at the served K: one JSON-ready record (what ``--json`` prints)."""
    if window.tau_gauge is not None:
        return compare_gauge(window, refs, served, z)
    c = window.counters
    k = len(c.accepted)
    record: dict = {
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "window": window.index,
        "seconds": round(window.seconds, 1),
        "requests": int(window.requests),
        "drafts": c.drafts,
        "k": k,
    }
    if not c.drafts:
        return record | {"status": "idle", "causes": []}
    rates = c.rates()
    per_pass = engine_settings.drafts_per_pass(c.draft_tokens, c.drafts)
    record |= {
        "tau": round(c.tau, 4),
        "acceptance": [round(r, 4) for r in rates],
        "drafts_per_pass": round(per_pass, 3) if per_pass is not None else None,
    }
    causes = served_causes(served, refs, k, per_pass)
    at_k = refs.get(k) or []
    if not at_k:
        measured = sorted(refs)
        causes.insert(0, f"the engine serves K={k}; the run measured K={measured or 'none'}: nothing to compare")
        return record | {"status": "no reference", "references": [], "causes": causes}
    model = served.get("model")
    at_k = sorted(at_k, key=lambda r: not (model and r.folder and same_folder(model, r.folder)))
    ref = at_k[0]  # the engine's own figures on the drafter it serves, where verify measured it
    # the window's independent units: its finished requests (fewer than drafted in it when requests span windows: a
    # wider band), or where none finished its drafts in requests' worth (not both: a weaker drafter drafts more often)
    units = window.requests or max(c.drafts / ref.drafts_per_request if ref.drafts_per_request else 0.0, 1.0)
    scale = math.sqrt(1 / ref.requests + 1 / units)
    # a spread measured on few requests is itself uncertain: Student's t on its requests - 1 degrees of freedom
    width = critical(z, ref.requests - 1 if ref.spread else None) * scale
    half = width * ref.accepted_spread()
    low, high = ref.tau - half, ref.tau + half
    fell = []
    for i, (rate, mine, s) in enumerate(zip(rates, ref.rates, ref.position_spread(), strict=False)):
        if rate < mine - width * s:
            fell.append({"position": i + 1, "served": round(rate, 4), "expected": round(mine, 4)})
    status = "low" if c.tau < low else "high" if c.tau > high else "ok"
    if status == "low":
        causes += length_shift(window, ref)
    record |= {
        "status": status,
        "band": [round(low, 4), round(high, 4)],
        "references": [
            {"source": r.source, "tau": round(r.tau, 4), "requests": r.requests} for r in first_of_each_kind(at_k)
        ],
        "expected_acceptance": [round(r, 4) for r in ref.rates],
        "fell": fell if status == "low" else [],
        "mean_prompt_tokens": round(window.prompt_tokens / window.requests, 1) if window.requests else None,
        "causes": causes,
    }
    return record


def compare_gauge(window: Window, refs: dict[int, list[Reference]], served: dict, z: float = Z) -> dict:
    """An SGLang window: its τ gauge against the same band, at the K the server drafts (no positions, no drafts)."""
    k = int(served["k"])
    record: dict = {
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "window": window.index,
        "seconds": round(window.seconds, 1),
        "requests": int(window.requests),
        "drafts": None,
        "k": k,
    }
    if not window.requests or not window.tau_gauge:
        return record | {"status": "idle", "causes": []}
    record |= {"tau": round(window.tau_gauge, 4), "acceptance": [], "drafts_per_pass": None}
    causes = served_causes(served, refs, k, None)
    at_k = refs.get(k) or []
    if not at_k:
        causes.insert(0, f"the engine serves K={k}; the run measured K={sorted(refs) or 'none'}: nothing to compare")
        return record | {"status": "no reference", "references": [], "causes": causes}
    ref = at_k[0]
    width = critical(z, ref.requests - 1 if ref.spread else None) * math.sqrt(1 / ref.requests + 1 / window.requests)
    low, high = ref.tau - width * ref.accepted_spread(), ref.tau + width * ref.accepted_spread()
    status = "low" if window.tau_gauge < low else "high" if window.tau_gauge > high else "ok"
    if status == "low":
        causes += length_shift(window, ref)
    return record | {
        "status": status,
        "band": [round(low, 4), round(high, 4)],
        "references": [
            {"source": r.source, "tau": round(r.tau, 4), "requests": r.requests} for r in first_of_each_kind(at_k)
        ],
        "expected_acceptance": [round(r, 4) for r in ref.rates],
        "fell": [],
        "mean_prompt_tokens": round(window.prompt_tokens / window.requests, 1),
        "causes": causes,
    }


def first_of_each_kind(refs: list[Reference]) -> list[Reference]:
    """verify's first reference and evaluate's: the others at the same K (verify's second form) say the same."""
    kinds: dict[str, Reference] = {}
    for r in refs:
        kinds.setdefault(r.source.split()[0], r)
    return list(kinds.values())


def served_causes(served: dict, refs: dict[int, list[Reference]], k: int, per_pass: float | None) -> list[str]:
    """What differs in how the engine serves from what the run measured: another K, fewer drafts per pass than K,
    another drafter folder, a recorded setting that moves τ."""
    causes = []
    verified = sorted({r.k for rs in refs.values() for r in rs if r.source.startswith("verify")})
    if verified and k not in verified:
        causes.append(f"another K served: K={k} where verify measured K={', '.join(map(str, verified))}")
    model = served.get("model")
    folders = {r.folder for rs in refs.values() for r in rs if r.folder}
    if model and folders and not any(same_folder(model, f) for f in folders):
        causes.append(f"another drafter served: {model} (the run exported {', '.join(sorted(folders))})")
    for effect in engine_settings.setting_effects(served.get("settings") or {}, k, per_pass, served["temperature"]):
        if effect.explains_gap:
            causes.append(f"{effect.setting}: {effect.detail}")
    return causes


def same_folder(a: str, b: str) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return a == b


def length_shift(window: Window, ref: Reference) -> list[str]:
    """A shift in what the requests look like against verify's prompts (vLLM's request token histograms): mean
    prompts in another of the context groups evaluate and verify report τ by, or replies of another length."""
    from eaglekit.speculative.decode import context_bucket  # lazy: heavy (torch); the context groups' one definition

    out: list[str] = []
    if not window.requests:
        return out
    prompt, reply = window.prompt_tokens / window.requests, window.generation_tokens / window.requests
    if ref.mean_prompt_tokens and context_bucket(int(prompt)) != context_bucket(int(ref.mean_prompt_tokens)):
        out.append(
            f"a context-length shift: prompts averaged {prompt:.0f} tokens ({context_bucket(int(prompt))}) against "
            f"{ref.mean_prompt_tokens:.0f} ({context_bucket(int(ref.mean_prompt_tokens))}) in verify's prompts"
        )
    if ref.mean_reply_tokens and reply and not 1 / LENGTH_SHIFT <= reply / ref.mean_reply_tokens <= LENGTH_SHIFT:
        out.append(
            f"another kind of reply: replies averaged {reply:.0f} tokens against {ref.mean_reply_tokens:.0f} on "
            "verify's prompts"
        )
    return out


def line(record: dict) -> str:
    """One window as a terminal line."""
    if record["status"] == "idle":
        drafts = f", {record['drafts']} drafts" if record["drafts"] is not None else ""
        return f"{record['time'][11:19]} window {record['window']}: {record['requests']} requests{drafts} — idle (no drafts)"
    acc = " ".join(f"{r:.2f}" for r in record["acceptance"]) or "not reported (SGLang: τ of its last interval)"
    drafts = f", {record['drafts']} drafts" if record["drafts"] is not None else ""
    head = f"{record['time'][11:19]} window {record['window']}: {record['requests']} requests{drafts}"
    text = f"{head}, K={record['k']}: τ {record['tau']:.2f}, acceptance by position {acc}"
    if record["status"] == "no reference":
        return f"{text} — {'; '.join(record['causes'])}"
    low, high = record["band"]
    refs = ", ".join(f"{r['source']} {r['tau']:.2f}" for r in record["references"])
    expected = " ".join(f"{r:.2f}" for r in record["expected_acceptance"])
    text += f" | expected τ {low:.2f}–{high:.2f} ({refs}; acceptance {expected})"
    noted = f"; note: {'; '.join(record['causes'])}" if record["causes"] else ""  # served otherwise than measured
    if record["status"] == "ok":
        return f"{text} — ok{noted}"
    if record["status"] == "high":
        return f"{text} — above the band{noted}"
    fell = ", ".join(f"{p['position']} ({p['served']:.2f} vs {p['expected']:.2f})" for p in record["fell"])
    out = f"{text} — ALARM: served τ below the band" + (f"; positions fell: {fell}" if fell else "")
    return out + (f"; likely: {'; '.join(record['causes'])}" if record["causes"] else "")


def windows(
    client: VllmClient | SglangMetrics,
    start: Snapshot,
    window_s: float | None,
    window_requests: int | None,
    poll_s: float = 1.0,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[Window]:
    """Windows one after another from ``start``, each from the end of the last: ``window_requests`` finished
    requests (polled every ``poll_s``), else ``window_s`` seconds."""
    before, started = start, time.monotonic()
    index = 0
    while True:
        if window_requests:
            while True:
                sleep(poll_s)
                after = client.snapshot()
                if after.requests - before.requests >= window_requests:
                    break
        else:
            sleep(window_s or 60.0)
            after = client.snapshot()
        index += 1
        now = time.monotonic()
        yield Window.between(index, now - started, before, after)
        before, started = after, now


@dataclass
class GaugeSnapshot(Snapshot):
    tau_gauge: float | None = None


class SglangMetrics:
    """SGLang's side of a watch: K and the drafter from ``/get_server_info`` (a chain, topk 1), the τ gauge and the
    request and token counters from ``/metrics`` (started with ``--enable-metrics``)."""

    def __init__(self, url: str, timeout: float = 10.0):
        self.root, self.timeout = root_of(url), timeout
        self.server = SglangClient(url, timeout)
        self.k = self.server.num_speculative_tokens()
        self.model = str(self.server.info.get("model_path") or "the target")

    def snapshot(self) -> GaugeSnapshot:
        response = httpx.get(f"{self.root}/metrics", timeout=self.timeout)
        metrics = parse_prometheus(response.text) if response.status_code == 200 else {}
        gauges = [v for key, v in metrics.items() if key.split("{")[0] == SGLANG_ACCEPT_LENGTH]
        if not gauges:
            raise EaglekitError(
                f"{self.root}/metrics has no {SGLANG_ACCEPT_LENGTH} (answered {response.status_code})",
                "start SGLang with --enable-metrics",
            )
        return GaugeSnapshot(
            Counters(0, []),
            metric_sum(metrics, SGLANG_REQUESTS),
            metric_sum(metrics, SGLANG_PROMPT_TOKENS),
            metric_sum(metrics, SGLANG_GENERATION_TOKENS),
            sum(gauges) / len(gauges),  # one series per scheduler (tp/dp rank): their mean
        )


def served_setup(client: VllmClient | SglangMetrics, engine_log: Path | None, temperature: float) -> dict:
    """How the engine serves, as far as it says: its speculative config from ``engine_log`` (the ``non-default
    args`` line) or ``/server_info`` (dev mode); SGLang's drafter and K from ``/get_server_info``."""
    if isinstance(client, SglangMetrics):
        model = client.server.draft_model_path
        return {
            "model": model,
            "settings": {},
            "sources": ["/get_server_info"],
            "temperature": temperature,
            "k": client.k,
        }
    sources = []
    if engine_log is not None:
        try:
            sources.append(("log", engine_settings.from_log(engine_log.read_text(errors="replace"))))
        except OSError as err:
            raise UsageError(
                f"--engine-log {engine_log} cannot be read ({err})", "name the engine's log file"
            ) from None
    sources.append(("/server_info", engine_settings.from_server(client.root, client.timeout)))
    settings = engine_settings.EngineSettings.read(*sources)
    return {
        "model": settings.values.get("model"),
        "settings": settings.values,
        "sources": settings.sources,
        "temperature": temperature,
    }


def run(
    run_dir: Path,
    url: str,
    window_s: float | None = 60.0,
    window_requests: int | None = None,
    count: int | None = None,
    engine_log: Path | None = None,
    temperature: float = 0.0,
    as_json: bool = False,
    z: float = Z,
    emit: Callable[[str], None] = print,
    say: Callable[[str], None] = print,
) -> int:
    """Watch until ``count`` windows (or Ctrl-C): one line (or JSON object) a window through ``emit``. Returns 0,
    1 when a window fell below its band, 130 after Ctrl-C (143 after SIGTERM)."""
    refs = references(run_dir)
    if not refs:
        raise UsageError(
            f"{run_dir} holds neither verify/report.json nor evaluate/report.json",
            "point watch at the run directory whose drafter the engine serves, after its evaluate (or verify) stage",
        )
    client = connect(url)
    served = served_setup(client, engine_log, temperature)
    start = client.snapshot()  # before the first line: what is counted from here on is watched
    if not as_json:
        seen = f" (its settings read from {' and '.join(served['sources'])})" if served["sources"] else ""
        unit = f"{window_requests} requests" if window_requests else f"{window_s:g} s"
        say(f"watch: {client.root} serving {client.model}{seen}; a window every {unit}; Ctrl-C stops")
    alarmed, done = False, 0
    try:
        for window in windows(client, start, window_s, window_requests):
            record = compare(window, refs, served, z)
            alarmed |= record["status"] == "low"
            emit(json.dumps(record) if as_json else line(record))
            done += 1
            if count and done >= count:
                break
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM (interrupt.Terminated): the way a monitor is stopped
        if not as_json:
            say(f"watch: stopped after {done} windows" + (" (a window fell below its band)" if alarmed else ""))
        return interrupt.exit_code(err)
    return 1 if alarmed else 0


def connect(url: str, timeout: float = 10.0) -> VllmClient | SglangMetrics:
    """The engine at ``url``: SGLang where it answers ``/get_model_info``, else vLLM."""
    try:
        if httpx.get(f"{root_of(url)}/get_model_info", timeout=timeout).status_code == 200:
            return SglangMetrics(url, timeout)
        return VllmClient(url, timeout)
    except EaglekitError:
        raise
    except Exception as err:  # httpx errors and HTTP status errors alike: the server is the problem
        raise EaglekitError(
            f"no vLLM or SGLang answers at {url} ({type(err).__name__}: {err})",
            "start the engine (the command `eaglekit export` printed) or fix --server",
        ) from None
