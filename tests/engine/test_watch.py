"""`eaglekit watch`: served acceptance window by window against the run's verify and evaluate figures.

The band first, on requests drawn from one process (healthy) and from a weaker one (shifted); then the command against
a stand-in that serves vLLM's /metrics text over real HTTP (JSON lines, exit codes, Ctrl-C); then the real vLLM CPU
build serving the demo's drafter: the demo's prompts raise no alarm over five windows, prompts of random tokens raise
it in the first window of four requests (one engine start, ~60 s on 2 idle cores).
"""

from __future__ import annotations

import json
import queue
import random
import signal
import subprocess
import sys
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from support.helpers import subprocess_env
from support.json_http import JsonHandler

from eaglekit import watch
from eaglekit.serving.speculation import Counters, request_spread

K = 3
DRAFTS_PER_REQUEST = 28


def draw_request(rng: random.Random, ease: tuple[float, float]) -> tuple[int, list[int]]:
    """One request's drafts and accepted tokens per position: the request has an ease q of its own (its prompt), and
    each draft accepts its first i+1 tokens with probability q^(i+1) (a chain: a later position only after an earlier
    one)."""
    q = rng.betavariate(*ease)
    accepted = [0] * K
    for _ in range(DRAFTS_PER_REQUEST):
        for i in range(K):
            if rng.random() >= q:
                break
            accepted[i] += 1
    return DRAFTS_PER_REQUEST, accepted


HEALTHY, WEAKER = (18.0, 2.0), (2.0, 6.0)  # mean ease 0.90 (τ ≈ 3.4) and 0.25 (τ ≈ 1.3)


def write_run(run_dir: Path, requests: list[tuple[int, list[int]]]) -> Path:
    """A run directory holding the parts of verify's and evaluate's reports watch reads (as those stages write them)."""
    drafts = sum(d for d, _ in requests)
    accepted = [sum(a[i] for _, a in requests) for i in range(K)]
    (run_dir / "verify").mkdir(parents=True)
    (run_dir / "evaluate").mkdir()
    verify = {
        "engine": "vllm",
        "prompts": len(requests),
        "mean_prompt_tokens": 140.0,
        "mean_reply_tokens": 96.0,
        "runs": [
            {
                "form": "eagle3",
                "k": K,
                "served": {"drafts": drafts, "accepted": accepted},
                "request_spread": request_spread(requests),
            }
        ],
    }
    evaluate = {
        "prompts": len(requests),
        "results": [
            {"method": "eagle", "k": K, "temperature": 0.0, "drafted": [drafts] * K, "accepted": accepted},
            {"method": "ngram", "k": K, "temperature": 0.0, "drafted": [drafts] * K, "accepted": [1, 0, 0]},
        ],
    }
    (run_dir / "verify" / "report.json").write_text(json.dumps(verify))
    (run_dir / "evaluate" / "report.json").write_text(json.dumps(evaluate))
    return run_dir


def window_of(requests: list[tuple[int, list[int]]], index: int = 1, prompt_tokens: float = 140.0) -> watch.Window:
    counters = Counters(sum(d for d, _ in requests), [sum(a[i] for _, a in requests) for i in range(K)])
    counters.draft_tokens = counters.drafts * K
    n = len(requests)
    return watch.Window(index, 60.0, counters, n, prompt_tokens * n, 96.0 * n)


SERVED = {"model": None, "settings": {}, "sources": [], "temperature": 0.0}


def test_healthy_windows_stay_in_the_band_and_a_weaker_drafter_falls_out_of_it(tmp_path):
    rng = random.Random(0)
    refs = watch.references(write_run(tmp_path / "run", [draw_request(rng, HEALTHY) for _ in range(8)]))
    assert [r.source for r in refs[K]] == ["verify (served, eagle3)", "evaluate (offline, T=0)"]
    healthy = [
        watch.compare(window_of([draw_request(rng, HEALTHY) for _ in range(4)], i), refs, SERVED) for i in range(300)
    ]
    # one alarm in 300 windows here: the 8 reference requests' τ came out high by chance (3.64, the process's is
    # ~3.45), which every window is compared with; the band allows for it, at 3 standard errors' worth of tail
    assert sum(r["status"] == "low" for r in healthy) <= 3 and sum(r["status"] == "ok" for r in healthy) >= 290
    shifted = watch.compare(window_of([draw_request(rng, WEAKER) for _ in range(4)]), refs, SERVED)
    assert shifted["status"] == "low" and shifted["tau"] < shifted["band"][0]
    assert shifted["fell"] and all(p["served"] < p["expected"] for p in shifted["fell"])
    assert "ALARM: served τ below the band; positions fell:" in watch.line(shifted)


def test_the_band_narrows_with_the_requests_measured(tmp_path):
    """Without verify's spread between requests (evaluate alone) the band is the bound for drafts that accept all
    together, wider than the measured one; more requests on both sides narrow it."""
    rng = random.Random(1)
    requests = [draw_request(rng, HEALTHY) for _ in range(8)]
    run = write_run(tmp_path / "run", requests)
    (run / "verify" / "report.json").unlink()
    evaluate_only = watch.compare(window_of(requests[:4]), watch.references(run), SERVED)
    run2 = write_run(tmp_path / "run2", requests)
    measured = watch.compare(window_of(requests[:4]), watch.references(run2), SERVED)
    larger = watch.compare(window_of(requests * 4), watch.references(run2), SERVED)

    def width(record: dict) -> float:
        return record["band"][1] - record["band"][0]

    assert width(evaluate_only) > width(measured) > width(larger)


def test_what_watch_tells_apart(tmp_path):
    rng = random.Random(2)
    refs = watch.references(write_run(tmp_path / "run", [draw_request(rng, HEALTHY) for _ in range(8)]))
    weak = [draw_request(rng, WEAKER) for _ in range(4)]
    # a context-length shift: vLLM's prompt-token histogram against verify's prompts
    long = watch.compare(window_of(weak, prompt_tokens=1400.0), refs, SERVED)
    assert long["status"] == "low" and any(
        "context-length shift: prompts averaged 1400 tokens (1-4k) against 140 (<1k)" in c for c in long["causes"]
    )
    # another drafter (the engine's log names its folder) and fewer drafts per pass than K (a batch-size schedule)
    other = SERVED | {"model": "/elsewhere/drafter", "settings": {"num_speculative_tokens_per_batch_size": [[1, 4, 1]]}}
    window = window_of(weak)
    window.counters.draft_tokens = window.counters.drafts * 2
    record = watch.compare(window, refs, other)
    assert any(c.startswith("another drafter served: /elsewhere/drafter") for c in record["causes"])
    assert any("2.00 tokens per verify pass where K=3" in c for c in record["causes"])
    # another K, which the run never measured
    k5 = Counters(100, [80, 60, 40, 20, 10])
    served_k5 = watch.compare(watch.Window(1, 60.0, k5, 4, 560.0, 384.0), refs, SERVED)
    assert served_k5["status"] == "no reference"
    assert "the engine serves K=5; the run measured K=[3]" in watch.line(served_k5)
    idle = watch.compare(watch.Window(1, 60.0, Counters(0, [0, 0, 0]), 0, 0.0, 0.0), refs, SERVED)
    assert idle["status"] == "idle" and watch.line(idle).endswith("idle (no drafts)")


# ------------------------------------------------------------------------------ against a /metrics stand-in


class MetricsStandIn:
    """vLLM's /v1/models and /metrics (its Prometheus text, as the real engine writes it): every scrape of /metrics
    finishes one more request, drawn healthy for the first ``healthy`` scrapes and weaker after."""

    def __init__(self, healthy: int, seed: int = 3):
        self.rng, self.healthy, self.scrapes = random.Random(seed), healthy, 0
        self.requests, self.drafts, self.accepted = 0, 0, [0] * K
        stand_in = self

        class Handler(JsonHandler):
            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self.send_json(200, {"data": [{"id": "tiny", "max_model_len": 1024}]})
                elif self.path == "/metrics":
                    self.send_body(200, stand_in.scrape().encode(), "text/plain; version=0.0.4")
                else:
                    self.send_json(404, {"detail": "Not Found"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def scrape(self) -> str:
        if self.scrapes:  # the first scrape is the watch's start
            d, a = draw_request(self.rng, HEALTHY if self.scrapes <= self.healthy else WEAKER)
            self.requests, self.drafts = self.requests + 1, self.drafts + d
            self.accepted = [x + y for x, y in zip(self.accepted, a, strict=True)]
        self.scrapes += 1
        labels = 'engine="0",model_name="tiny"'
        lines = [
            "# TYPE vllm:spec_decode_num_drafts_total counter",
            f"vllm:spec_decode_num_drafts_total{{{labels}}} {float(self.drafts)}",
            f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} {float(self.drafts * K)}",
            f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} {float(sum(self.accepted))}",
        ]
        lines += [
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{i}"}} {float(a)}'
            for i, a in enumerate(self.accepted)
        ]
        lines += [
            f'vllm:request_success_total{{{labels},finished_reason="length"}} {float(self.requests)}',
            f"vllm:request_prompt_tokens_sum{{{labels}}} {140.0 * self.requests}",
            f"vllm:request_prompt_tokens_count{{{labels}}} {float(self.requests)}",
            f"vllm:request_generation_tokens_sum{{{labels}}} {96.0 * self.requests}",
        ]
        return "\n".join(lines) + "\n"

    def __enter__(self) -> MetricsStandIn:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


class SglangMetricsStandIn(MetricsStandIn):
    """SGLang's /get_model_info, /get_server_info and /metrics as its collector writes them (srt/metrics/collector.py):
    no speculation counters, the gauge sglang:spec_accept_length of the last logged interval (here: the request
    each scrape finishes), and the request and token counters."""

    def __init__(self, healthy: int, seed: int = 3):
        super().__init__(healthy, seed)
        stand_in = self

        class Handler(JsonHandler):
            def do_GET(self) -> None:
                if self.path == "/get_model_info":
                    self.send_json(200, {"model_path": "tiny", "is_generation": True})
                elif self.path == "/get_server_info":
                    info = {"speculative_algorithm": "EAGLE3", "speculative_num_steps": K, "speculative_eagle_topk": 1}
                    self.send_json(200, info | {"speculative_draft_model_path": "/drafter", "model_path": "tiny"})
                elif self.path == "/metrics":
                    self.send_body(200, stand_in.scrape().encode(), "text/plain; version=0.0.4")
                else:
                    self.send_json(404, {"detail": "Not Found"})

        self.server.server_close()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.last = (0, [0] * K)

    def scrape(self) -> str:
        if self.scrapes:
            self.last = draw_request(self.rng, HEALTHY if self.scrapes <= self.healthy else WEAKER)
            self.requests += 1
        self.scrapes += 1
        drafts, accepted = self.last
        labels = 'model_name="tiny",engine_type="unified",tp_rank="0",dp_rank="0"'
        length = 1 + sum(accepted) / drafts if drafts else 0.0
        return (
            "\n".join(
                [
                    "# TYPE sglang:spec_accept_length gauge",
                    f"sglang:spec_accept_length{{{labels}}} {length}",
                    f"sglang:spec_accept_rate{{{labels}}} {sum(accepted) / (drafts * K) if drafts else 0.0}",
                    f'sglang:num_requests_total{{model_name="tiny"}} {float(self.requests)}',
                    f'sglang:prompt_tokens_total{{model_name="tiny"}} {140.0 * self.requests}',
                    f'sglang:generation_tokens_total{{model_name="tiny"}} {96.0 * self.requests}',
                ]
            )
            + "\n"
        )


def test_watch_reads_sglangs_gauge(reference_run, cli):
    """Against SGLang a window's τ is its acceptance-length gauge (no positions): healthy windows stay in the band, a
    weaker drafter's fall out of it."""
    with SglangMetricsStandIn(healthy=3) as engine:
        result = cli("watch", reference_run, "--server", engine.url, "--window-s", "0.05", "--windows", "5", "--json")
    assert result.code == 1, result.err
    records = [json.loads(line) for line in result.out.splitlines()]
    assert [r["status"] for r in records[:3]] == ["ok"] * 3 and records[4]["status"] == "low"
    assert all(r["k"] == K and r["acceptance"] == [] and r["drafts"] is None for r in records)
    assert "not reported (SGLang" in watch.line(records[4]) and "ALARM" in watch.line(records[4])


@pytest.fixture
def reference_run(tmp_path) -> Path:
    rng = random.Random(4)
    return write_run(tmp_path / "run", [draw_request(rng, HEALTHY) for _ in range(8)])


def test_watch_prints_json_lines_and_exits_1_once_a_window_falls(reference_run, cli):
    with MetricsStandIn(healthy=3) as engine:
        result = cli("watch", reference_run, "--server", engine.url, "--window-s", "0.05", "--windows", "5", "--json")
    assert result.code == 1, result.err
    records = [json.loads(line) for line in result.out.splitlines()]
    assert [r["window"] for r in records] == [1, 2, 3, 4, 5]
    assert [r["status"] for r in records[:3]] == ["ok"] * 3 and records[3]["status"] == "low"
    assert all(r["requests"] == 1 and r["k"] == K and r["drafts_per_pass"] == K for r in records)


def test_watch_once_in_a_terminal_and_its_errors(reference_run, cli, tmp_path):
    with MetricsStandIn(healthy=5) as engine:
        result = cli("watch", reference_run, "--server", engine.url, "--window-s", "0.05", "--once")
    assert result.code == 0, result.err
    assert "watch: " in result.err and "serving tiny; a window every 0.05 s" in result.err
    (text,) = result.out.splitlines()
    assert "window 1: 1 requests" in text and text.endswith("— ok") and "verify (served, eagle3)" in text
    empty = cli("watch", tmp_path / "nothing", "--server", "http://127.0.0.1:9", "--once")
    assert empty.code == 2 and "holds neither verify/report.json nor evaluate/report.json" in empty.err
    down = cli("watch", reference_run, "--server", "http://127.0.0.1:9", "--once")
    assert (
        down.code == 1 and "no vLLM or SGLang answers at http://127.0.0.1:9" in down.err and "Traceback" not in down.err
    )


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_or_sigterm_stops_watch_cleanly(reference_run, sig, code):
    command = ["watch", str(reference_run), "--server", "URL", "--window-s", "0.1"]
    with MetricsStandIn(healthy=1000) as engine:
        proc = subprocess.Popen(
            [sys.executable, "-m", "eaglekit.cli", *(engine.url if a == "URL" else a for a in command)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=subprocess_env(),
            # a shell without job control starts background jobs with SIGINT ignored; a terminal's Ctrl-C is not
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        assert proc.stdout is not None
        first = proc.stdout.readline()  # a window printed: the loop is running
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    assert "window 1:" in first
    assert proc.returncode == code and "watch: stopped after" in err and "Traceback" not in err


# ------------------------------------------------------------------------------------------- the real engine


def send_chat(url: str, messages: list[dict], max_tokens: int) -> None:
    body = {"model": None, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
    models = httpx.get(f"{url}/models", timeout=30).json()["data"]
    body["model"] = models[0]["id"]
    response = httpx.post(f"{url}/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text[:500]


def send_tokens(url: str, ids: list[int], max_tokens: int) -> None:
    model = httpx.get(f"{url}/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0}
    response = httpx.post(f"{url}/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text[:500]


def lines_of(stream) -> queue.Queue:
    """The lines a child process writes to ``stream``, as they come (read by a thread: a test waits with a timeout)."""
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for text in stream:
            lines.put(text.rstrip("\n"))

    threading.Thread(target=read, daemon=True).start()
    return lines


@pytest.mark.slow
def test_watch_on_the_real_engine_serving_the_demo_drafter(vllm_python, demo_run, tmp_path):
    """The demo's exported drafter served by vLLM's CPU build as export's command serves it; `eaglekit watch` in a
    process of its own, a window every 4 finished requests, the test sending each window's requests once the
    previous window is printed: 5 windows of the demo's kind of prompts (new ones, through the chat template), then
    2 of random token ids."""
    from eaglekit.serving.engine import VllmServer
    from eaglekit.serving.engine_settings import from_server
    from eaglekit.tiny import write_prompts

    run_dir, _, _ = demo_run
    report = json.loads((run_dir / "verify" / "report.json").read_text())
    max_tokens = report["max_new_tokens"]
    spec = {"method": "eagle3", "model": str((run_dir / "export" / "eagle3").resolve()), "num_speculative_tokens": 3}
    log = tmp_path / "vllm.log"
    prompts_file = write_prompts(tmp_path / "p.jsonl", 20, seed=123, shape="messages")
    prompts = [json.loads(line)["messages"] for line in prompts_file.read_text().splitlines()]
    rng = random.Random(5)
    args = ["--speculative-config", json.dumps(spec), "--max-model-len", "1024"]
    # dev mode: vLLM answers /server_info with its whole config, the way a user's server tells its settings
    with VllmServer(vllm_python, report["target"], args, log, env={"VLLM_SERVER_DEV_MODE": "1"}) as server:
        served = from_server(server.root)
        assert served is not None and served["num_speculative_tokens"] == 3
        assert (served["rejection_sample_method"], served["draft_sample_method"]) == ("standard", "greedy")
        command = ["watch", str(run_dir), "--server", server.url, "--window-requests", "4", "--windows", "7"]
        proc = subprocess.Popen(
            [sys.executable, "-m", "eaglekit.cli", *command, "--engine-log", str(log)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=subprocess_env(),
        )
        out, err = lines_of(proc.stdout), lines_of(proc.stderr)
        lines = []
        try:
            started = err.get(timeout=120)
            while not started.startswith("watch: "):  # what else the process says first
                started = err.get(timeout=120)
            for window in range(7):
                for i in range(4):
                    if window < 5:
                        send_chat(server.url, prompts[window * 4 + i], max_tokens)
                    else:
                        send_tokens(server.url, [rng.randrange(3, 400) for _ in range(40)], max_tokens)
                lines.append(out.get(timeout=120))
                print(lines[-1])
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert "its settings read from log and /server_info" in started
    assert all(line.endswith("— ok") for line in lines[:5]), "\n".join(lines)
    assert all("ALARM: served τ below the band" in line for line in lines[5:]), "\n".join(lines)
    assert proc.returncode == 1
