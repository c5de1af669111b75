"""The generate stage against real HTTP servers (tests/support/fake_vllm.py on 127.0.0.1): response shapes, faults,
the reasoning gate, pre-flight, kill -9 and Ctrl-C mid-run, several servers, the API key; and the store."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.fake_vllm import FakeVLLM, answer
from support.helpers import subprocess_env, write_config

from eaglekit import pipeline
from eaglekit.config import parse_config
from eaglekit.data.responses import ResponseStore, read_responses
from eaglekit.errors import EaglekitError
from eaglekit.preflight import failed
from eaglekit.rundir import RunDir
from eaglekit.stages import generate

MODEL = "fake/reasoner"


@pytest.fixture
def servers():
    started = []

    def start(**kw) -> FakeVLLM:
        started.append(FakeVLLM(model=MODEL, **kw).start())
        return started[-1]

    yield start
    for s in started:
        s.stop()


def dead_url() -> str:
    """The base URL of a port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


def write_prompts(path: Path, n: int) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            f.write(
                json.dumps(
                    {
                        "id": f"p{i:03d}",
                        "conversations": [{"from": "human", "value": f"question {i} asks about item {i * 7} and more"}],
                    }
                )
                + "\n"
            )
    return path


def config_dict(tmp_path: Path, urls: list[str], n: int = 12, **generate_overrides) -> dict:
    return {
        "run_dir": str(tmp_path / "run"),
        "target": {"model": "org/absent-target"},
        "data": {"prompts": str(write_prompts(tmp_path / "prompts.jsonl", n))},
        "generate": {
            "backend": "openai",
            "servers": urls,
            "model": MODEL,
            "max_tokens": 64,
            "concurrency": 4,
            "retry_backoff": 0.01,
            "probe_interval": 0.2,
            "reasoning": "required",
            **generate_overrides,
        },
    }


def make_config(tmp_path: Path, urls: list[str], n: int = 12, **generate_overrides):
    return parse_config(config_dict(tmp_path, urls, n, **generate_overrides), base_dir=tmp_path)


def run(cfg, **kw) -> dict:
    with RunDir(cfg.run_dir).lock:
        return pipeline.run_stage(cfg, "generate", **kw)


def records(cfg) -> list[dict]:
    return list(read_responses(Path(cfg.run_dir) / "generate" / "responses.jsonl"))


def errors(cfg) -> list[dict]:
    path = Path(cfg.run_dir) / "generate" / "errors.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def preflight(cfg) -> list:
    return pipeline.run_preflight(pipeline.make_context(cfg, "generate"))


def assert_complete(cfg, n: int) -> None:
    """Every prompt answered exactly once, each record matching its own prompt."""
    rows = records(cfg)
    assert sorted(r["id"] for r in rows) == [f"p{i:03d}" for i in range(n)]
    for r in rows:
        reasoning, content = answer(r["messages"])
        assert (r["reasoning"], r["content"]) == (reasoning, content), r["id"]


# --- response shapes ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, source",
    [
        ("reasoning", "reasoning"),
        ("both", "reasoning"),
        ("reasoning_content", "reasoning_content"),
        ("inline", "inline_think"),
        ("close_only", "inline_think"),
    ],
)
def test_every_server_shape_yields_the_reasoning(tmp_path, servers, shape, source):
    fake = servers(shape=shape)
    cfg = make_config(tmp_path, [fake.url], n=6)
    out = run(cfg)
    assert_complete(cfg, 6)
    rows = records(cfg)
    assert {r["reasoning_source"] for r in rows} == {source}
    assert all(r["server"] == fake.url and r["model"] == MODEL and r["finish_reason"] == "stop" for r in rows)
    assert all(r["completion_token_ids"] and r["completion_tokens"] > 0 and r["prompt_tokens"] > 0 for r in rows)
    assert out["counts"]["reasoning_sources"] == {source: 6} and out["counts"]["empty_reasoning"] == 0
    assert all(fake.requests[i]["body"]["return_token_ids"] is True for i in range(len(fake.requests)))


def test_extra_body_and_sampling_params_reach_the_server(tmp_path, servers):
    fake = servers()
    cfg = make_config(
        tmp_path,
        [fake.url],
        n=2,
        temperature=0.6,
        top_p=0.9,
        seed=7,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}, "top_k": 20},
    )
    run(cfg, skip_preflight=True)
    body = fake.requests[0]["body"]
    assert body["chat_template_kwargs"] == {"enable_thinking": True} and body["top_k"] == 20
    assert (body["temperature"], body["top_p"], body["seed"], body["max_tokens"]) == (0.6, 0.9, 7, 64)


def test_a_server_refusing_return_token_ids_gets_requests_without_it(tmp_path, servers):
    fake = servers(strict=True)
    cfg = make_config(tmp_path, [fake.url], n=8, concurrency=4, max_retries=0)
    run(cfg, skip_preflight=True)
    assert_complete(cfg, 8)
    assert errors(cfg) == [] and all("completion_token_ids" not in r for r in records(cfg))
    refused = [r for r in fake.requests if "return_token_ids" in r["body"]]
    assert 1 <= len(refused) <= 4  # only the requests sent before the first refusal came back


def test_fingerprint_ignores_servers_and_concurrency_but_not_sampling(tmp_path):
    base = config_dict(tmp_path, ["http://a:8000/v1"])
    fp = pipeline.fingerprint(parse_config(base, base_dir=tmp_path), "generate")
    more = {
        **base,
        "generate": {**base["generate"], "servers": ["http://a:8000/v1", "http://b:8000/v1"], "concurrency": 64},
    }
    assert pipeline.fingerprint(parse_config(more, base_dir=tmp_path), "generate") == fp
    for key, value in (("temperature", 0.7), ("max_tokens", 65), ("model", "org/other"), ("extra_body", {"top_k": 5})):
        changed = {**base, "generate": {**base["generate"], key: value}}
        assert pipeline.fingerprint(parse_config(changed, base_dir=tmp_path), "generate") != fp, key


# --- faults -------------------------------------------------------------------------------------------


def test_faults_are_retried_and_nothing_is_lost(tmp_path, servers):
    faults = {2: "500", 3: "503", 4: "reset", 5: "malformed", 6: "slow", 7: "429", 8: "length"}
    fake = servers(faults=faults, slow_seconds=1.5, retry_after=0)
    cfg = make_config(tmp_path, [fake.url], n=12, timeout=0.5)
    out = run(cfg, skip_preflight=True)
    assert_complete_ids = sorted(r["id"] for r in records(cfg))
    assert assert_complete_ids == [f"p{i:03d}" for i in range(12)]
    assert errors(cfg) == []
    assert len(fake.requests) == 12 + 6  # each fault but `length` cost one retry
    cut = [r for r in records(cfg) if r["finish_reason"] == "length"]
    assert len(cut) == 1 and cut[0]["content"] == ""
    assert out["counts"]["length_share"] == pytest.approx(1 / 12, abs=1e-3) and out["counts"]["failed"] == 0


def test_retry_after_is_honoured(tmp_path, servers):
    fake = servers(faults={1: "429"}, retry_after=1)
    cfg = make_config(tmp_path, [fake.url], n=1, concurrency=1)
    run(cfg, skip_preflight=True)
    assert len(records(cfg)) == 1
    first, second = fake.requests[0], fake.requests[1]
    assert second["t"] - first["t"] >= 1.0  # a lower bound: the server asked for one second


def test_failures_go_to_errors_jsonl_and_retry_failed_retries_them(tmp_path, servers):
    fake = servers(faults={1: "500", 2: "500", 3: "500", 5: "400"})
    cfg = make_config(tmp_path, [fake.url], n=6, concurrency=1, max_retries=2)
    out = run(cfg, skip_preflight=True)
    errs = errors(cfg)
    assert sorted(e["id"] for e in errs) == ["p000", "p002"]  # p001 got request 4, p002 request 5
    by_id = {e["id"]: e for e in errs}
    assert by_id["p000"]["attempts"] == 3 and "HTTP 500" in by_id["p000"]["reason"]
    assert by_id["p002"]["attempts"] == 1 and "HTTP 400" in by_id["p002"]["reason"]  # the request's own fault
    assert out["counts"]["failed"] == 2 and out["counts"]["done"] == 4

    # a plain rerun of the same stage (as after a kill) leaves them failed; --retry-failed tries them again
    ctx = pipeline.make_context(cfg, "generate")
    with RunDir(cfg.run_dir).lock:
        again = generate.run(ctx)
    assert again["new"] == 0 and again["skipped_failed"] == 2
    ctx = pipeline.make_context(cfg, "generate", retry_failed=True)
    with RunDir(cfg.run_dir).lock:
        retried = generate.run(ctx)
    assert retried["new"] == 2 and retried["failed"] == 0 and errors(cfg) == []
    assert_complete(cfg, 6)


def test_a_server_that_keeps_failing_is_taken_out_and_probed_back(tmp_path, servers, capsys):
    fake = servers(faults={1: "503", 2: "503", 3: "503"})
    cfg = make_config(tmp_path, [fake.url], n=4, concurrency=1, probe_interval=0.2)
    run(cfg, skip_preflight=True)
    assert_complete(cfg, 4)
    err = capsys.readouterr().err
    assert "taken out of rotation" in err and "back in rotation" in err


def test_two_servers_one_down_completes_on_the_other(tmp_path, servers, capsys):
    fake, down = servers(), dead_url()
    cfg = make_config(tmp_path, [down, fake.url], n=20, concurrency=2)
    bad = failed(preflight(cfg))
    assert [r.name for r in bad] == [f"server {down}"] and "cannot reach" in bad[0].detail
    run(cfg, skip_preflight=True)
    assert_complete(cfg, 20)
    assert {r["server"] for r in records(cfg)} == {fake.url}
    assert f"{down} taken out of rotation" in capsys.readouterr().err
    end = [e for e in RunDir(cfg.run_dir).events() if e.get("event") == "end"][-1]
    assert end["servers"] and down in end["servers"][0]


def test_no_server_left_stops_the_run_with_the_reason(tmp_path):
    down = dead_url()
    cfg = make_config(tmp_path, [down], n=5, outage_timeout=0.3, probe_interval=30)
    with pytest.raises(EaglekitError, match="no server left") as err:
        run(cfg, skip_preflight=True)
    assert down in str(err.value) and "ConnectError" in str(err.value)


# --- the reasoning gate -------------------------------------------------------------------------------


def test_gate_stops_an_empty_reasoning_run_early_and_writes_nothing(tmp_path, servers):
    fake = servers(shape="empty")
    cfg = make_config(tmp_path, [fake.url], n=60, gate_samples=10, concurrency=2)
    with pytest.raises(EaglekitError) as err:
        run(cfg, skip_preflight=True)
    msg = str(err.value)
    assert "10 of the first 10" in msg and "--reasoning-parser" in msg and "`content` (10/10)" in msg
    assert len(fake.requests) <= 10 + 2  # stopped right after the gate, not after 60
    assert records(cfg) == []
    end = [e for e in RunDir(cfg.run_dir).events() if e.get("event") == "end"][-1]
    assert end["state"] == "failed" and end["gate"]["passed"] is False and end["gate"]["empty_reasoning"] == 10


def test_gate_names_a_field_nobody_reads(tmp_path, servers):
    fake = servers(shape="thinking")
    cfg = make_config(tmp_path, [fake.url], n=12, gate_samples=5)
    with pytest.raises(EaglekitError, match="sends `thinking`"):
        run(cfg, skip_preflight=True)


def test_gate_passes_and_is_recorded_when_reasoning_is_there(tmp_path, servers):
    fake = servers(shape="reasoning_content")
    cfg = make_config(tmp_path, [fake.url], n=8, gate_samples=5)
    run(cfg, skip_preflight=True)
    end = [e for e in RunDir(cfg.run_dir).events() if e.get("event") == "end"][-1]
    assert end["gate"]["passed"] and end["gate"]["samples"] == 5 and end["gate"]["sources"] == {"reasoning_content": 5}
    assert end["rates"]["req_per_s"] > 0 and end["rates"]["mean_output_tokens"] > 0


def test_optional_reasoning_does_not_gate(tmp_path, servers):
    fake = servers(shape="empty")
    cfg = make_config(tmp_path, [fake.url], n=6, reasoning="optional")
    out = run(cfg, skip_preflight=True)
    assert out["counts"]["empty_reasoning"] == 6 and len(records(cfg)) == 6


# --- pre-flight ---------------------------------------------------------------------------------------


def test_preflight_passes_and_records_the_server_version(tmp_path, servers):
    fake = servers()
    results = preflight(make_config(tmp_path, [fake.url]))
    assert not failed(results)
    server = next(r for r in results if r.name == f"server {fake.url}")
    assert "vLLM 0.17.0" in server.detail and "max_model_len 4096" in server.detail
    assert next(r for r in results if r.name.startswith("smoke")).status == "ok"


def test_preflight_fails_on_a_wrong_model_id_listing_the_served_ones(tmp_path, servers):
    fake = servers()
    cfg = make_config(tmp_path, [fake.url], model="org/other")
    bad = failed(preflight(cfg))
    assert [r.name for r in bad] == [f"server {fake.url}"]
    assert "does not serve 'org/other'" in bad[0].detail and MODEL in bad[0].detail
    with pytest.raises(EaglekitError, match="pre-flight failed"):
        run(cfg)
    assert fake.requests == []  # not a single generation request


def test_preflight_fails_when_max_model_len_is_too_small(tmp_path, servers):
    fake = servers(max_model_len=60)
    cfg = make_config(tmp_path, [fake.url], max_tokens=50)
    bad = {r.name: r for r in failed(preflight(cfg))}
    assert "context length" in bad
    assert "max_model_len 60" in bad["context length"].detail and "p0" in bad["context length"].detail


@pytest.mark.parametrize("shape, says", [("empty", "--reasoning-parser"), ("thinking", "sends `thinking`")])
def test_smoke_request_catches_reasoning_nobody_reads(tmp_path, servers, shape, says):
    fake = servers(shape=shape)
    bad = failed(preflight(make_config(tmp_path, [fake.url])))
    assert [r.name for r in bad] == [f"smoke request {fake.url}"]
    assert says in bad[0].detail and "fields sent:" in bad[0].detail


def test_smoke_request_catches_a_reply_cut_before_its_answer(tmp_path, servers):
    fake = servers(fault_all="length", shape="inline")
    bad = failed(preflight(make_config(tmp_path, [fake.url])))
    assert len(bad) == 1 and "think tags left in the answer" in bad[0].detail


def test_smoke_request_renders_the_record_with_the_target_template(tmp_path, servers, tiny_target):
    fake = servers(tokenizer=str(tiny_target))  # renders prompts with the target's template, as vLLM does
    data = config_dict(tmp_path, [fake.url])
    data["target"]["model"] = str(tiny_target)
    del data["generate"]["reasoning"]  # default: required, because the tiny template has think tags
    results = preflight(parse_config(data, base_dir=tmp_path))
    assert not failed(results)
    assert "required" in next(r for r in results if r.name == "reasoning").detail


def test_smoke_request_fails_when_the_template_would_drop_the_reasoning(tmp_path, servers, tiny_target):
    # Like Qwen3's template for earlier turns: only what follows </think> of an assistant turn is rendered.
    dropping = (
        "{%- for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}"
        "{{ m.content.split('</think>')[-1].lstrip('\n') }}{% else %}{{ m.content }}{% endif %}<|im_end|>\n"
        "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fake = servers(tokenizer=str(tiny_target))
    data = config_dict(tmp_path, [fake.url])
    data["target"] = {"model": str(tiny_target), "chat_template": dropping}
    bad = failed(preflight(parse_config(data, base_dir=tmp_path)))
    assert [r.name for r in bad] == [f"smoke request {fake.url}"]
    assert "does not render" in bad[0].detail and "drops the final assistant turn's reasoning" in bad[0].detail


# --- the API key --------------------------------------------------------------------------------------


def test_api_key_is_sent_as_bearer_and_never_written(tmp_path, servers, monkeypatch):
    secret = "sk-test-5e3cr3t-value"
    monkeypatch.setenv("EAGLEKIT_TEST_KEY", secret)
    fake = servers(api_key=secret, faults={3: "500"})
    cfg = make_config(tmp_path, [fake.url], n=6, api_key_env="EAGLEKIT_TEST_KEY", max_retries=0)
    run(cfg)
    assert all(r["headers"]["Authorization"] == f"Bearer {secret}" for r in fake.requests)
    assert len(errors(cfg)) == 1  # an error record exists, and it must not hold the key either
    for path in Path(cfg.run_dir).rglob("*"):
        if path.is_file():
            assert secret not in path.read_text(errors="replace"), path


def test_missing_api_key_fails_the_preflight(tmp_path, servers, monkeypatch):
    monkeypatch.delenv("EAGLEKIT_TEST_KEY", raising=False)
    fake = servers()
    bad = failed(preflight(make_config(tmp_path, [fake.url], api_key_env="EAGLEKIT_TEST_KEY")))
    assert [r.name for r in bad] == ["API key"] and "EAGLEKIT_TEST_KEY" in bad[0].detail


# --- interruptions: Ctrl-C, then kill -9, then resume ----------------------------------------------------


def start_cli(config: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "eaglekit.cli", "generate", str(config)],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # the CLI as a user's shell starts it: SIGINT at its default, whatever this test process inherited (an
        # ignored SIGINT passes to children, and Python then leaves it ignored: the run would finish, exit 0)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def wait_for_lines(path: Path, n: int, proc: subprocess.Popen, limit: float = 60) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if path.exists() and path.read_bytes().count(b"\n") >= n:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    raise AssertionError(f"{path} never reached {n} lines")


def test_ctrl_c_and_kill_9_mid_run_then_resume_gives_every_id_once(tmp_path, servers):
    n = 120
    fake = servers(delay=0.05)  # ~3 s a run: the signals land mid-run
    config = write_config(
        tmp_path / "config.yaml", config_dict(tmp_path, [fake.url], n=n, gate_samples=10, concurrency=2)
    )
    responses = tmp_path / "run" / "generate" / "responses.jsonl"

    proc = start_cli(config)  # 1: Ctrl-C
    wait_for_lines(responses, 20, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "rerun the same command to resume" in err
    ends = [e for e in RunDir(tmp_path / "run").events() if e.get("event") == "end"]
    assert ends[-1]["state"] == "incomplete" and ends[-1]["error"] == "interrupted (SIGINT)"
    after_sigint = records_at(responses)
    assert 20 <= len(after_sigint) < n

    proc = start_cli(config)  # 2: kill -9, and a torn line as a kill mid-write leaves one
    wait_for_lines(responses, len(after_sigint) + 20, proc)
    proc.kill()
    proc.wait()
    with open(responses, "a") as f:
        f.write('{"id": "p119", "messages": [{"role": "us')

    proc = start_cli(config)  # 3: runs to the end
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "torn last line" in err
    raw = responses.read_bytes()
    assert raw.endswith(b"\n") and all(json.loads(line) for line in raw.splitlines())
    cfg = parse_config(config_dict(tmp_path, [fake.url], n=n), base_dir=tmp_path)
    assert_complete(cfg, n)
    starts = [e for e in RunDir(cfg.run_dir).events() if e.get("event") == "start"]
    assert [e["resume"] for e in starts] == [False, True, True]


def records_at(path: Path) -> list[dict]:
    return list(read_responses(path))


# --- the store ----------------------------------------------------------------------------------------


def test_store_repairs_a_torn_tail_and_never_writes_an_id_twice(tmp_path):
    folder = tmp_path / "generate"
    with ResponseStore(folder) as store:
        assert store.add({"id": "a", "x": 1}) and store.add({"id": "b", "x": 2})
        assert not store.add({"id": "a", "x": 3})
    with open(folder / "responses.jsonl", "ab") as f:
        f.write(b'{"id": "c", "x"')
    with ResponseStore(folder) as store:
        assert store.done_ids == {"a", "b"}
        store.add({"id": "c", "x": 4})
    assert [r["id"] for r in read_responses(folder / "responses.jsonl")] == ["a", "b", "c"]


def test_store_refuses_a_damaged_middle_line_naming_it(tmp_path):
    folder = tmp_path / "generate"
    folder.mkdir()
    (folder / "responses.jsonl").write_text('{"id": "a"}\nnot json\n{"id": "b"}\n')
    with pytest.raises(EaglekitError, match=r"responses.jsonl:2"):
        ResponseStore(folder).open()


def test_store_errors_of_ids_done_later_do_not_count(tmp_path):
    folder = tmp_path / "generate"
    with ResponseStore(folder) as store:
        store.add_error("a", "HTTP 500", 3)
        store.add_error("b", "HTTP 500", 3)
        store.add({"id": "a"})
    with ResponseStore(folder) as store:
        assert set(store.errors) == {"b"}
        assert store.forget_errors() == 1
    assert (folder / "errors.jsonl").read_text() == ""
