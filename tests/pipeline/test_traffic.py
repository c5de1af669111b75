"""Served traffic as training data (data.traffic): a gateway log of real chat-completions exchanges — requests sent
over HTTP to servers on 127.0.0.1 rendering with the tiny target's tokenizer (tests/support/fake_vllm.py), each line
the request and response bodies as a gateway logs them — goes through prepare, vocab and a few training steps
without generate asking a server. Bad lines are named (file:line, why), another model's log is refused naming the
`model` field and data.traffic.model, repeated conversations count once, the sample is seeded and stays put when
lines are appended, appended lines are all a rerun takes and tokenizes, and nothing of the log is kept outside the
run directory."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml
from support.fake_vllm import FakeVLLM
from support.helpers import subprocess_env
from test_train import QUICK

from eaglekit import pipeline, status
from eaglekit.config import parse_config
from eaglekit.data.responses import read_responses
from eaglekit.data.traffic import read_traffic
from eaglekit.errors import EaglekitError
from eaglekit.planning import traffic_samples
from eaglekit.preflight import failed
from eaglekit.rundir import RunDir
from eaglekit.tiny import write_prompts

MODEL = "tiny/served-target"
PII = "Jane Q. Example, 42 Private Lane"  # a user's details in one prompt: must stay in the log and the run


def chat(server: FakeVLLM, messages: list[dict], **body) -> dict:
    """One exchange through the server, as a gateway logs it: the request body and the response body."""
    request = {"model": server.model, "messages": messages, "max_tokens": 64, **body}
    sent = urllib.request.Request(
        f"{server.url}/chat/completions", json.dumps(request).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(sent, timeout=30) as reply:
        return {"request": request, "response": json.loads(reply.read())}


def line(exchange: dict) -> str:
    return json.dumps(exchange) + "\n"


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> list[list[dict]]:
    path = write_prompts(tmp_path_factory.mktemp("prompts") / "p.jsonl", n=40, seed=11, shape="messages")
    rows = [json.loads(x)["messages"] for x in path.read_text().splitlines()]
    rows[3] = [{"role": "user", "content": f"My name and address are {PII}. What should I write on the envelope?"}]
    return rows


@pytest.fixture(scope="module")
def served(prompts, tiny_target) -> dict[str, list[dict]]:
    """Real exchanges, logged: the target's (40), another model's (3), one cut at max_tokens, and two from a server
    that adds a system turn to every prompt (rendered otherwise than the target's template)."""
    with (
        FakeVLLM(model=MODEL, tokenizer=str(tiny_target)) as target,
        FakeVLLM(model="other/model", tokenizer=str(tiny_target)) as other,
        FakeVLLM(model=MODEL, tokenizer=str(tiny_target), system_prompt="Always answer in French.") as system,
    ):
        return {
            "target": [chat(target, m) for m in prompts],
            "other": [chat(other, m) for m in prompts[:3]],
            "truncated": [chat(target, prompts[0], max_tokens=2)],
            "system": [chat(system, m) for m in prompts[-2:]],
        }


def config(tmp_path: Path, log: Path, tiny_target: Path, **traffic) -> dict:
    return {
        "run_dir": str(tmp_path / "run"),
        "target": {"model": str(tiny_target)},
        "data": {"traffic": {"path": str(log), "model": MODEL, **traffic}, "eval_fraction": 0.2},
        "vocab": {"draft_vocab_size": 200},
        "extract": {"mode": "offline"},
        "train": {**QUICK, "max_steps": 2, "eval_every": 2, "save_every": 2},
    }


def run_stages(cfg, *stages: str) -> list[dict]:
    with RunDir(cfg.run_dir).lock:
        return [pipeline.run_stage(cfg, stage) for stage in stages]


def responses(cfg) -> list[dict]:
    return list(read_responses(Path(cfg.run_dir) / "generate" / "responses.jsonl"))


@pytest.mark.slow  # trains a drafter through `eaglekit run`
def test_a_gateway_log_trains_through_prepare_without_a_server_and_names_its_bad_lines(served, tmp_path, tiny_target):
    good = served["target"][:20]
    log = tmp_path / "gateway.jsonl"
    log.write_text(
        "".join(line(x) for x in good[:5])
        + '{"request": {"messages": [\n'  # line 6: cut off mid-write
        + line({"request": good[5]["request"], "response": {"choices": []}})  # 7: no reply
        + line(served["other"][0])  # 8: another model's
        + line(served["truncated"][0])  # 9: cut at max_tokens
        + line(served["system"][0])  # 10: the server added a system turn
        + line(good[0])  # 11: the first exchange again
        + "".join(line(x) for x in good[5:])
    )
    home = tmp_path / "home"
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(config(tmp_path, log, tiny_target)))
    env = subprocess_env() | {
        "HOME": str(home),
        "TMPDIR": str(tmp_path / "tmp"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "HF_HOME": str(home / ".cache" / "huggingface"),
        "HF_HUB_OFFLINE": "1",
    }
    (tmp_path / "tmp").mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "eaglekit.cli", "run", str(config_file), "--until", "train"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 0, out[-4000:]
    assert "Traceback" not in out

    cfg = parse_config(yaml.safe_load(config_file.read_text()), base_dir=tmp_path)
    rows = responses(cfg)
    # the 20 exchanges, once each, as the target answered them, and where each came from
    assert sorted(r["messages"][-1]["content"] for r in rows) == sorted(
        x["request"]["messages"][-1]["content"] for x in good
    )
    by_prompt = {json.dumps(x["request"]["messages"]): x["response"]["choices"][0]["message"] for x in good}
    for r in rows:
        message = by_prompt[json.dumps(r["messages"])]
        assert (r["reasoning"], r["content"], r["model"]) == (message["reasoning"], message["content"], MODEL)
        assert r["source"].startswith(f"{log}:")
    # every bad line named by file:line and why, in the output and in the run directory
    rejects = [
        json.loads(x) for x in (Path(cfg.run_dir) / "generate" / "traffic_rejects.jsonl").read_text().splitlines()
    ]
    assert [(r["source"], r["why"].split(":")[0]) for r in rejects] == [
        (f"{log}:6", "malformed"),
        (f"{log}:7", "no reply"),
        (f"{log}:8", "another model"),
        (f"{log}:9", "truncated"),
        (f"{log}:10", "rendered otherwise"),
    ]
    assert "model 'other/model'" in rejects[2]["why"] and "finish_reason length" in rejects[3]["why"]
    assert "usage.prompt_tokens" in rejects[4]["why"]
    assert f"1 another model ({log}:8: model 'other/model'" in out
    assert "1 repeated (the first counts)" in out and "no server asked" in out
    # the stages after generate ran on the run directory alone
    stats = json.loads((Path(cfg.run_dir) / "prepare" / "stats.json").read_text())
    assert stats["responses"] == 20 and stats["samples"] > 0
    rows_now = {r["stage"]: r for r in status.stage_rows(cfg)}
    assert all(rows_now[s]["state"] == "done" for s in ("generate", "prepare", "vocab", "extract", "train"))
    assert any("5 of 26 traffic lines rejected" in f for f in rows_now["generate"]["flags"]), rows_now["generate"]
    # a user's details reach the run directory, and nothing outside it
    assert any(PII in r["messages"][-1]["content"] for r in rows)
    leaked = [
        f
        for f in tmp_path.rglob("*")
        if f.is_file() and f != log and Path(cfg.run_dir) not in f.parents and PII.encode() in f.read_bytes()
    ]
    assert leaked == []


def test_another_models_log_is_refused_naming_the_field_and_the_remedy(served, tmp_path, tiny_target):
    log = tmp_path / "other.jsonl"
    log.write_text("".join(line(x) for x in served["other"]))
    cfg = parse_config(config(tmp_path, log, tiny_target), base_dir=tmp_path)
    bad = failed(pipeline.run_preflight(pipeline.make_context(cfg, "generate")))
    assert [r.name for r in bad] == ["traffic"]
    assert (
        f"the responses' `model` field holds 'other/model' (3 lines) ({log}:1, {log}:2, {log}:3), and the run's target is served as '{MODEL}'"
        in bad[0].detail
    )
    assert "data.traffic.model" in bad[0].remedy
    with pytest.raises(EaglekitError) as refused, RunDir(cfg.run_dir).lock:
        pipeline.run_stage(cfg, "generate", skip_preflight=True)
    assert "`model` field holds 'other/model'" in refused.value.message and f"{log}:1" in refused.value.message
    assert not (Path(cfg.run_dir) / "generate" / "responses.jsonl").exists()


def test_repeated_conversations_count_once_and_the_sample_is_seeded_and_stays_put(served, tmp_path):
    log = tmp_path / "log.jsonl"
    exchanges = served["target"]
    log.write_text("".join(line(x) for x in exchanges[:30] + exchanges[:4]))

    def sample(**kw) -> list[str]:
        return [r["id"] for r in read_traffic(log, model=MODEL, **kw).samples]

    whole = read_traffic(log, model=MODEL)
    assert len(whole.samples) == 30 and whole.duplicates == 4 and not whole.rejects
    assert sample(max_samples=10) == sample(max_samples=10) and len(sample(max_samples=10)) == 10
    assert sample(max_samples=10, seed=1) != sample(max_samples=10)
    assert sample(newest=5) == [r["id"] for r in whole.samples[-5:]]  # log order, oldest first
    assert sample(since=datetime(2000, 1, 1, tzinfo=UTC)) == sample()  # the responses' `created` times
    late = read_traffic(log, model=MODEL, since=datetime.now(UTC) + timedelta(days=1))
    assert late.samples == [] and late.left_out == 30
    with pytest.raises(EaglekitError, match="30 usable ones not selected by data.traffic since/newest"):
        late.require_usable()
    before = set(sample(max_samples=10))
    with open(log, "a") as f:
        f.write("".join(line(x) for x in exchanges[30:]))
    appended = {r["id"] for r in read_traffic(log, model=MODEL).samples[30:]}
    after = set(sample(max_samples=10))
    # the sample of the grown log differs from the old one only by appended conversations that ranked ahead
    assert after - before <= appended and len(after - before) == len(before - after)
    assert len(before & after) >= 5
    # the plain form, {messages: [..., the assistant's reply]}, reads as the same conversation
    first = exchanges[0]
    reply = first["response"]["choices"][0]["message"]
    plain = tmp_path / "plain.jsonl"
    plain.write_text(line({"messages": [*first["request"]["messages"], reply], "model": MODEL}))
    assert [r["id"] for r in read_traffic(plain, model=MODEL).samples] == [whole.samples[0]["id"]]


def test_appended_traffic_is_all_a_rerun_takes_and_tokenizes(served, tmp_path, tiny_target, capsys):
    log = tmp_path / "gateway.jsonl"
    exchanges = served["target"]
    log.write_text("".join(line(x) for x in exchanges[:20]))
    cfg = parse_config(config(tmp_path, log, tiny_target), base_dir=tmp_path)
    assert traffic_samples(cfg.data.traffic).value == 20  # `eaglekit plan` counts the log's lines
    run_stages(cfg, "generate", "prepare")
    kept = (Path(cfg.run_dir) / "generate" / "responses.jsonl").read_bytes()
    capsys.readouterr()

    unfinished = line(exchanges[26])
    with open(log, "a") as f:  # the gateway still writing its last line
        f.write("".join(line(x) for x in exchanges[20:26]) + "not json\n" + unfinished[:100])
    rows = {r["stage"]: r for r in status.stage_rows(cfg)}
    assert rows["generate"]["state"] == "stale" and rows["prepare"]["state"] == "stale"
    assert f"generate.traffic: {log} (20 conversations, " in rows["generate"]["reason"]
    assert f"→ {log} (26 conversations, " in rows["generate"]["reason"]
    generate_row, prepare_row = run_stages(cfg, "generate", "prepare")
    out = " ".join(capsys.readouterr().err.split())
    assert "the conversations of the traffic changed since it ran (6 added): take 6 new of 26; 20 kept" in out
    assert f"1 malformed ({log}:27" in out and "(6 new, 20 kept); no server asked" in out
    assert generate_row["counts"]["new"] == 6 and generate_row["counts"]["done"] == 26
    assert (Path(cfg.run_dir) / "generate" / "responses.jsonl").read_bytes().startswith(kept)
    assert "prepare: 6 new samples tokenized, 20 kept" in out
    assert prepare_row["counts"]["tokenized"] == 6
    assert f"{log}:28: an unfinished last line (still being written?), left for the next run" in out
    with open(log, "a") as f:
        f.write(unfinished[100:])
    generate_row, prepare_row = run_stages(cfg, "generate", "prepare")
    assert generate_row["counts"]["new"] == 1 and prepare_row["counts"]["tokenized"] == 1
    assert all(r["state"] == "done" for r in status.stage_rows(cfg) if r["stage"] in ("generate", "prepare"))
    # the same log again: nothing to do
    assert all(row.get("skipped") for row in run_stages(cfg, "generate", "prepare"))


def test_the_gateways_shapes_read_as_one_conversation_and_what_cannot_be_rendered_is_named(served, tmp_path):
    first = served["target"][0]
    request, response = first["request"], first["response"]
    reply = response["choices"][0]["message"]
    shapes = [
        {"request": request, "response": response},  # side by side
        {"model": MODEL, "messages": request["messages"], "response": response, "startTime": 1765000000.0},  # LiteLLM
        {"request": {"body": request}, "response": {"status": 200, "body": response}},  # Portkey's envelopes
        {"reqPayload": json.dumps(request), "respPayload": json.dumps(response), "statusCode": 200},  # OpenPipe
        {"messages": [*request["messages"], reply], "model": MODEL},  # plain
    ]
    log = tmp_path / "shapes.jsonl"
    log.write_text("".join(line(x) for x in shapes))
    read = read_traffic(log, model=MODEL)
    assert len(read.samples) == 1 and read.duplicates == 4 and not read.rejects

    tools = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    refused = [
        {"request": {**request, "tools": [tools]}, "response": response},
        {"request": {**request, "chat_template_kwargs": {"enable_thinking": False}}, "response": response},
        {"request": {"body": request}, "response": {"status": 500, "body": {"error": "overloaded"}}},
        {"messages": request["messages"]},  # no reply logged
        {"messages": request["messages"], "response": response, "model_parameters": {"tools": [tools]}},  # LiteLLM
    ]
    log.write_text("".join(line(x) for x in refused))
    read = read_traffic(log, model=MODEL)
    assert [(r.source, r.reason) for r in read.rejects] == [
        (f"{log}:1", "not renderable here"),
        (f"{log}:2", "not renderable here"),
        (f"{log}:3", "failed request"),
        (f"{log}:4", "no reply"),
        (f"{log}:5", "not renderable here"),
    ]
    assert "offers tools" in read.rejects[0].why and '{"enable_thinking": false}' in read.rejects[1].why
    with pytest.raises(EaglekitError) as none:
        read.require_usable()
    assert f"no usable conversation of 5 lines: 3 not renderable here ({log}:1, {log}:2, {log}:5" in none.value.message
    assert "without tools" in (none.value.remedy or "")
    # a plain line without a `model` is taken, and said to be unchecked
    log.write_text(line({"messages": [*request["messages"], reply]}))
    assert "1 taken without a `model` field (their origin is unchecked)" in read_traffic(log, model=MODEL).summary()
