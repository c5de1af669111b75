"""Prompts are identified by their rows, not by their file: a renamed file is no change, and rows added, removed or
edited under the same generation settings ask the target only the prompts without a reply — every finished reply
is kept, byte for byte — with and without --force. Against a real HTTP server (tests/support/fake_vllm.py) that counts the
requests it answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from support.fake_vllm import FakeVLLM
from test_generate_openai import MODEL, config_dict, records
from test_identity import copy, finished  # noqa: F401  (module fixtures: a whole offline run, copied per test)

from eaglekit import pipeline, status
from eaglekit.config import load_config, parse_config
from eaglekit.errors import EaglekitError
from eaglekit.rundir import RunDir


def prompt_line(i: int, text: str | None = None) -> str:
    row = {"id": f"p{i:03d}", "conversations": [{"from": "human", "value": text or f"question {i} asks about {i * 7}"}]}
    return json.dumps(row) + "\n"


@pytest.fixture
def server():
    with FakeVLLM(model=MODEL) as fake:
        yield fake


@pytest.fixture
def project(tmp_path, server):
    """A config writer over a prompts file of 12 rows; returns (write(**data) -> cfg, prompts path)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(prompt_line(i) for i in range(12)))
    data = config_dict(tmp_path, [server.url])
    data["data"] = {"prompts": str(prompts)}

    def write(**changes):
        for section, values in changes.items():
            data[section] = {**data.get(section, {}), **values}
        return parse_config(data, base_dir=tmp_path)

    return write, prompts


def generate(cfg, capsys=None, **kw) -> tuple[dict, str]:
    """Run generate (without pre-flight: its smoke request would count among the server's requests)."""
    with RunDir(cfg.run_dir).lock:
        row = pipeline.run_stage(cfg, "generate", skip_preflight=True, **kw)
    out = capsys.readouterr().err if capsys else ""
    return row, " ".join(out.split())


def responses_bytes(cfg) -> bytes:
    return (Path(cfg.run_dir) / "generate" / "responses.jsonl").read_bytes()


def preflight_detail(cfg, server, name: str = "output folder"):
    """The status and detail of one pre-flight check of generate; the smoke request it sends is not counted."""
    sent = len(server.requests)
    result = next(r for r in pipeline.run_preflight(pipeline.make_context(cfg, "generate")) if r.name == name)
    del server.requests[sent:]
    return result.status, " ".join(result.detail.split())


def test_a_renamed_prompts_file_is_the_same_prompts(project, server, tmp_path, capsys):
    write, prompts = project
    cfg = write()
    generate(cfg)
    before = pipeline.fingerprint(cfg, "generate")
    renamed = prompts.rename(tmp_path / "train-set-v1.jsonl")
    cfg = write(data={"prompts": str(renamed)})
    assert pipeline.fingerprint(cfg, "generate") == before
    row, out = generate(cfg, capsys)
    assert row.get("skipped") and len(server.requests) == 12
    # the path is recorded in the ledger (which file was read, and where the same rows are now), not hashed
    start = [s for s, _ in RunDir(cfg.run_dir).attempts("generate")][-1]
    assert start["params"]["prompts"]["path"] == str(prompts) and start["params"]["prompts"]["prompts"] == 12
    moved = f"prompts moved, the same content: now {renamed}, was {prompts}"
    assert f"generate: {moved}" in out
    assert f"generate: {moved}" in status.notes(status.stage_rows(cfg), "CONFIG")
    generate(cfg)
    assert sum(e.get("event") == "inputs moved" for e in RunDir(cfg.run_dir).events()) == 1  # recorded once
    # the same rows in another order, with a bad row skipped, are still the same prompts
    lines = renamed.read_text().splitlines(keepends=True)
    renamed.write_text("".join(reversed(lines)) + "not json\n")
    cfg = write(data={"prompts": str(renamed), "on_bad_row": "skip"})
    assert pipeline.fingerprint(cfg, "generate") == before
    # a prompt's text changed is another prompt set
    renamed.write_text("".join(lines[:-1]) + prompt_line(11, "another question"))
    assert pipeline.fingerprint(cfg, "generate") != before


def test_appended_prompts_ask_only_the_new_ones_and_keep_every_reply(project, server, capsys):
    write, prompts = project
    cfg = write()
    generate(cfg)
    assert len(server.requests) == 12
    kept = responses_bytes(cfg)
    with open(prompts, "a") as f:
        f.write("".join(prompt_line(i) for i in range(12, 18)))
    status, detail = preflight_detail(cfg, server)
    assert status == "ok" and "the prompts changed since it ran (6 added): generate 6 new of 18; 12 kept" in detail

    row, out = generate(cfg, capsys)
    assert len(server.requests) == 12 + 6
    assert sorted(r["body"]["messages"][-1]["content"] for r in server.requests[12:]) == sorted(
        f"question {i} asks about {i * 7}" for i in range(12, 18)
    )
    assert "generate: the prompts changed since it ran (6 added): generate 6 new of 18; 12 kept" in out
    assert row["counts"]["new"] == 6 and row["counts"]["done"] == 18
    assert responses_bytes(cfg).startswith(kept)  # the 12 finished replies, byte for byte
    assert sorted(r["id"] for r in records(cfg)) == [f"p{i:03d}" for i in range(18)]
    assert RunDir(cfg.run_dir).is_done("generate", pipeline.fingerprint(cfg, "generate"))


def test_max_samples_raised_after_a_pilot_asks_only_the_rest(project, server, capsys):
    write, _ = project
    cfg = write(data={"max_samples": 5})
    generate(cfg)
    pilot = responses_bytes(cfg)
    assert len(server.requests) == 5
    cfg = write(data={"max_samples": 1000})  # past the file's 12 rows
    _, out = generate(cfg, capsys)
    assert len(server.requests) == 12
    assert "(7 added): generate 7 new of 12; 5 kept" in out
    assert responses_bytes(cfg).startswith(pilot)
    assert len(records(cfg)) == 12
    # raised again past what the file holds: the same 12 prompts, nothing to do
    cfg = write(data={"max_samples": 25_000})
    row, _ = generate(cfg)
    assert row.get("skipped") and len(server.requests) == 12


def test_removed_prompts_are_set_aside_and_taken_back_when_asked_again(project, server, capsys):
    write, prompts = project
    cfg = write()
    generate(cfg)
    lines = prompts.read_text().splitlines(keepends=True)
    prompts.write_text("".join(lines[:4] + lines[6:]))  # p004 and p005 removed
    row, out = generate(cfg, capsys)
    assert len(server.requests) == 12
    assert "(2 removed): generate 0 new of 10; 10 kept; the replies to 2 prompts no longer asked go to " in out
    run = Path(cfg.run_dir) / "generate"
    assert sorted(r["id"] for r in records(cfg)) == [f"p{i:03d}" for i in range(12) if i not in (4, 5)]
    assert sorted(json.loads(x)["id"] for x in (run / "set_aside.jsonl").read_text().splitlines()) == ["p004", "p005"]
    assert row["counts"]["done"] == 10

    prompts.write_text("".join(lines))  # asked again: their replies come back without a request
    _, out = generate(cfg, capsys)
    assert len(server.requests) == 12
    assert "2 replies taken back from there for prompts asked again" in out
    assert sorted(r["id"] for r in records(cfg)) == [f"p{i:03d}" for i in range(12)]


def test_an_edited_prompt_is_asked_again_and_its_old_reply_set_aside(project, server, capsys):
    write, prompts = project
    cfg = write()
    generate(cfg)
    lines = prompts.read_text().splitlines(keepends=True)
    lines[3] = prompt_line(3, "a question rewritten")
    prompts.write_text("".join(lines))
    _, out = generate(cfg, capsys)
    assert "(1 edited): generate 1 new of 12; 11 kept" in out
    assert len(server.requests) == 13
    p003 = next(r for r in records(cfg) if r["id"] == "p003")
    assert p003["messages"][-1]["content"] == "a question rewritten"


def test_force_with_added_prompts_still_keeps_the_replies(project, server):
    write, prompts = project
    cfg = write()
    generate(cfg)
    kept = responses_bytes(cfg)
    with open(prompts, "a") as f:
        f.write(prompt_line(12))
    generate(cfg, force=True)
    assert len(server.requests) == 13 and responses_bytes(cfg).startswith(kept)


def test_other_generation_settings_still_need_force_and_replace_the_replies(project, server):
    write, prompts = project
    cfg = write()
    generate(cfg)
    with open(prompts, "a") as f:
        f.write(prompt_line(12))
    cfg = write(generate={"temperature": 0.3})
    with pytest.raises(EaglekitError) as err:
        generate(cfg)
    assert "generate.temperature: 0.6 → 0.3" in str(err.value) or "temperature" in str(err.value)
    assert len(server.requests) == 12
    generate(cfg, force=True)
    assert len(server.requests) == 12 + 13 and len(records(cfg)) == 13


def test_a_chat_template_file_is_its_content_not_its_name(tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    data = config_dict(tmp_path, ["http://127.0.0.1:9/v1"])

    def fingerprints(path: Path) -> list[str]:
        cfg = parse_config({**data, "target": {**data["target"], "chat_template": str(path)}}, base_dir=tmp_path)
        return [pipeline.fingerprint(cfg, stage) for stage in ("generate", "prepare")]

    before = fingerprints(template)
    moved = template.rename(tmp_path / "chat-v2.jinja")
    assert fingerprints(moved) == before
    moved.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}")
    after = fingerprints(moved)
    assert after[0] != before[0] and after[1] != before[1]


# --- a whole offline run (tests/pipeline/test_identity.py's: the tiny target, every stage done) -----------------------


def test_the_prompts_file_renamed_keeps_every_stage_done(copy):  # noqa: F811
    cfg = copy()
    root = copy.root
    stages = pipeline.stages_for(cfg)
    (root / "prompts.jsonl").rename(root / "train-set-v1.jsonl")
    data = yaml.safe_load((root / "config.yaml").read_text())
    data["data"]["prompts"] = "train-set-v1.jsonl"
    (root / "config.yaml").write_text(yaml.safe_dump(data))
    cfg = load_config(root / "config.yaml")
    assert [r["state"] for r in status.stage_rows(cfg)] == ["done"] * len(stages)
    with RunDir(cfg.run_dir).lock:
        rows = [pipeline.run_stage(cfg, stage, skip_preflight=True) for stage in stages]
    assert all(r.get("skipped") for r in rows)
    notes = " ".join(status.notes(status.stage_rows(cfg), "CONFIG"))  # the copy moved the target too
    assert f"generate: prompts moved, the same content: now {root / 'train-set-v1.jsonl'}, was " in notes
    assert f"prepare: tokenizer moved, the same content: now {root / 'target' / 'tokenizer.json'}, was " in notes

    # a real change of content: generate is stale and says which prompts; the stages after it follow
    with open(root / "train-set-v1.jsonl", "a") as f:
        f.write(prompt_line(99))
    rows = status.stage_rows(load_config(root / "config.yaml"))
    assert [r["state"] for r in rows] == ["stale"] * len(stages)
    reason = rows[0]["reason"]
    assert reason.startswith("generate.prompts: ") and "(16 prompts, " in reason and "(17 prompts, " in reason, reason
    steps = " ".join(status.next_steps(load_config(root / "config.yaml"), rows, "CONFIG"))
    assert "it goes on from its outputs: the prompts changed since it ran (1 added): generate 1 new of 17; 16 kept" in (
        steps
    )


def test_prompts_that_failed_before_are_left_out_and_said(project, server, capsys):
    write, prompts = project
    cfg = write()
    generate(cfg)
    with open(prompts, "a") as f:
        f.write(prompt_line(12) + prompt_line(13))
    errors = Path(cfg.run_dir) / "generate" / "errors.jsonl"
    errors.write_text(
        json.dumps({"id": "p013", "reason": "HTTP 500", "attempts": 5, "ts": "2026-12-07T00:00:00"}) + "\n"
    )
    _, out = generate(cfg, capsys)
    assert "(2 added): generate 1 new of 14; 12 kept; 1 that failed before are left out (--retry-failed retries" in out
    assert len(server.requests) == 13
    generate(cfg, retry_failed=True)
    assert len(server.requests) == 14 and len(records(cfg)) == 14


def test_the_prompts_identity_is_kept_in_the_run_directory(project, monkeypatch):
    """`eaglekit status` of a 25K-prompt run reads the prompts once, not at every call."""
    from eaglekit.data import prompts as prompt_data

    write, prompts = project
    cfg = write()
    Path(cfg.run_dir).mkdir()
    first = prompt_data.prompts_identity(cfg)
    assert first["prompts"] == 12 and (Path(cfg.run_dir) / prompt_data.IDENTITY_CACHE).is_file()

    def unread(*args, **kwargs):
        raise AssertionError("the prompts were read again")

    prompt_data._identity_cached.cache_clear()
    prompt_data._load_prompts_cached.cache_clear()
    monkeypatch.setattr(prompt_data, "load_prompts", unread)
    assert prompt_data.prompts_identity(cfg) == first
    monkeypatch.undo()
    with open(prompts, "a") as f:
        f.write(prompt_line(12))
    assert prompt_data.prompts_identity(cfg)["prompts"] == 13


# --- the stages after generate follow (a whole offline run, copied per test) ---------------------------------


def go_on(copy, stages: tuple[str, ...], capsys, **server) -> tuple[dict, str, FakeVLLM]:  # noqa: F811
    """Run ``stages`` of the copied run against a fresh fake server (the run's own is gone): rows and what they said."""
    root = copy.root
    with FakeVLLM(model=MODEL, tokenizer=str(root / "target"), **server) as fake:
        data = yaml.safe_load((root / "config.yaml").read_text())
        data["generate"]["servers"] = [fake.url]
        (root / "config.yaml").write_text(yaml.safe_dump(data))
        cfg = load_config(root / "config.yaml")
        capsys.readouterr()
        with RunDir(cfg.run_dir).lock:
            rows = {stage: pipeline.run_stage(cfg, stage, skip_preflight=True) for stage in stages}
    return rows, " ".join(capsys.readouterr().err.split()), fake


def stored_samples(cfg) -> dict[str, tuple[list[int], list[int]]]:
    from eaglekit.data.tokens import TokenStore

    store = TokenStore(Path(cfg.run_dir) / "prepare" / "tokens.safetensors")
    return {sid: (ids.tolist(), mask.tolist()) for sid, ids, mask in (store[i] for i in range(len(store)))}


def test_prompts_appended_tokenize_only_the_new_samples_without_force(copy, capsys, monkeypatch):  # noqa: F811
    from eaglekit.stages import prepare

    cfg = copy()
    before = stored_samples(cfg)
    with open(copy.root / "prompts.jsonl", "a") as f:
        f.write(prompt_line(90) + prompt_line(91))
    tokenized: list[str] = []
    real = prepare.tokenize_row
    monkeypatch.setattr(
        prepare, "tokenize_row", lambda cfg, tok, row, path: tokenized.append(row["id"]) or real(cfg, tok, row, path)
    )
    rows, out, fake = go_on(copy, ("generate", "prepare", "vocab"), capsys)
    assert len(fake.requests) == 2 and sorted(tokenized) == ["p090", "p091"]
    assert "prepare: the generated responses changed since it ran: 2 new to tokenize of 18; 16 kept" in out
    assert "prepare: 2 new samples tokenized, 16 kept" in out
    assert rows["prepare"]["counts"]["samples"] == 18 and not rows["vocab"].get("skipped")
    assert "vocab: the prepared tokens changed since it ran: the vocabulary is counted again from them" in out
    after = stored_samples(cfg)
    assert {sid: after[sid] for sid in before} == before  # every finished sample as it was


def test_prompts_appended_extract_only_the_new_samples_into_a_new_shard(copy, capsys):  # noqa: F811
    cfg = copy()
    extract = Path(cfg.run_dir) / "extract"
    old = {p.name: (p.stat().st_ino, p.read_bytes()) for p in extract.glob("shard-*.safetensors")}
    with open(copy.root / "prompts.jsonl", "a") as f:
        f.write(prompt_line(90) + prompt_line(91))
    rows, out, _ = go_on(copy, ("generate", "prepare", "vocab", "extract"), capsys)
    assert "extract: the prepared tokens changed since it ran: 2 new samples to extract of 18; 16 reused" in out
    assert "extract: 2 new samples, 16 reused" in out
    assert rows["extract"]["counts"]["samples"] == 18 and rows["extract"]["counts"]["shards"] == len(old) + 1
    for name, (inode, data) in old.items():  # the finished shards stay, untouched
        assert (extract / name).stat().st_ino == inode and (extract / name).read_bytes() == data
    index = json.loads((extract / "index.json").read_text())
    assert sorted(i for s in index["shards"] for i in s["ids"]) == sorted(stored_samples(cfg))
    assert set(index["shards"][-1]["ids"]) == {"p090", "p091"}

    # the drafter is the expensive output: retrained only with --force, and the refusal names both ways
    cfg = load_config(copy.root / "config.yaml")
    check = next(r for r in pipeline.run_preflight(pipeline.make_context(cfg, "train")) if r.name == "trained drafter")
    assert check.status == "fail" and "was trained with these settings on the prepared data before it" in check.detail
    assert "retrain on the 18 prepared samples: `eaglekit run CONFIG --from train --force`" in check.remedy, (
        check.remedy
    )
    assert f"finetune it on the grown data: set train.init_from: {Path(cfg.run_dir) / 'export'}/" in check.remedy
    forced = pipeline.run_preflight(pipeline.make_context(cfg, "train", force=True))
    assert next(r for r in forced if r.name == "trained drafter").status == "ok"


def test_prompts_removed_keep_their_samples_out_of_the_tokens(copy, capsys):  # noqa: F811
    cfg = copy()
    before = stored_samples(cfg)
    prompts = copy.root / "prompts.jsonl"
    lines = prompts.read_text().splitlines(keepends=True)
    gone = json.loads(lines[2])["id"]
    prompts.write_text("".join(lines[:2] + lines[3:]))
    rows, out, fake = go_on(copy, ("generate", "prepare"), capsys)
    assert not fake.requests
    assert "prepare: 0 new samples tokenized, 15 kept" in out
    after = stored_samples(cfg)
    assert gone in before and gone not in after
    assert after == {sid: v for sid, v in before.items() if sid != gone}


def test_a_new_sample_that_changes_no_token_leaves_the_stages_after_prepare_done(copy, capsys):  # noqa: F811
    """The stages after prepare are fingerprinted over the content of what they read, not over prepare's fingerprint:
    a prompt added whose reply is dropped (cut at max_tokens) makes the same tokens, and nothing after prepare reruns."""
    cfg = copy()
    stages = pipeline.stages_for(cfg)
    tokens = Path(cfg.run_dir) / "prepare" / "tokens.safetensors"
    kept = tokens.read_bytes()
    with open(copy.root / "prompts.jsonl", "a") as f:
        f.write(prompt_line(90))
    rows, out, fake = go_on(copy, tuple(stages), capsys, fault_all="length")
    assert len(fake.requests) == 1 and tokens.read_bytes() == kept
    assert "prepare: 1 new samples tokenized, 16 kept" in out
    assert rows["prepare"]["counts"]["dropped"] == 1
    assert [s for s in stages if rows[s].get("skipped")] == stages[2:]
    assert [r["state"] for r in status.stage_rows(load_config(copy.root / "config.yaml"))] == ["done"] * len(stages)


def test_a_removed_sample_leaves_the_feature_index_and_only_its_shard_is_extracted_again(copy, capsys):  # noqa: F811
    cfg = copy()
    data = yaml.safe_load((copy.root / "config.yaml").read_text())
    data["extract"]["shard_tokens"] = 300  # a few shards
    (copy.root / "config.yaml").write_text(yaml.safe_dump(data))
    cfg = load_config(copy.root / "config.yaml")
    with RunDir(cfg.run_dir).lock:
        pipeline.run_stage(cfg, "extract", force=True, skip_preflight=True)
    extract = Path(cfg.run_dir) / "extract"
    shards = json.loads((extract / "index.json").read_text())["shards"]
    assert len(shards) >= 3
    gone = shards[1]["ids"][0]
    prompts = copy.root / "prompts.jsonl"
    prompts.write_text("".join(x for x in prompts.read_text().splitlines(keepends=True) if json.loads(x)["id"] != gone))
    rows, out, _ = go_on(copy, ("generate", "prepare", "vocab", "extract"), capsys)
    moved = len(shards[1]["ids"]) - 1
    assert f"extract: {moved} new samples, {15 - moved} reused" in out
    index = json.loads((extract / "index.json").read_text())
    ids = [i for s in index["shards"] for i in s["ids"]]
    assert sorted(ids) == sorted(stored_samples(cfg)) and gone not in ids and len(ids) == 15
    kept = [s for s in shards if s["file"] != shards[1]["file"]]
    assert [s for s in index["shards"] if s["file"] in {k["file"] for k in kept}] == kept  # the others, as they were
    assert not (extract / shards[1]["file"]).exists()
