"""The served chat template against the local one, on real HTTP servers (tests/support/fake_vllm.py on 127.0.0.1) that
render prompts with the tiny target's tokenizer: one that adds a system turn fails generate's pre-flight naming the
first tokens where the two renderings differ (from /tokenize or the response's prompt_token_ids, else by count),
and is counted in generate's stats when it answers anyway; a server rendering as the target does passes."""

from __future__ import annotations

import pytest
from support.fake_vllm import FakeVLLM
from test_aware import REPO, hub_target  # noqa: F401 - the fixture: the tiny target in a hub cache, offline
from test_generate_openai import MODEL, config_dict, preflight, run

from eaglekit.config import parse_config
from eaglekit.preflight import failed
from eaglekit.rundir import RunDir
from eaglekit.stages import generate

SYSTEM = "You are a helpful assistant."


@pytest.fixture
def server(tiny_target):
    started: list[FakeVLLM] = []

    def start(**kw) -> FakeVLLM:
        started.append(FakeVLLM(model=MODEL, tokenizer=str(tiny_target), **kw).start())
        return started[-1]

    yield start
    for s in started:
        s.stop()


def config(tmp_path, tiny_target, url: str, n: int = 4, **generate_overrides):
    data = config_dict(tmp_path, [url], n, **generate_overrides)
    data["target"] = {"model": str(tiny_target)}
    return parse_config(data, base_dir=tmp_path)


def smoke_result(results):
    return next(r for r in results if r.name.startswith("smoke request"))


def test_a_server_rendering_as_the_target_passes(tmp_path, tiny_target, server):
    fake = server(tokenize=True)
    results = preflight(config(tmp_path, tiny_target, fake.url, return_token_ids=False))
    assert not failed(results)
    assert "tokens as rendered here, the server's token ids the same" in smoke_result(results).detail


def test_an_added_system_turn_fails_preflight_with_the_first_differing_tokens_from_tokenize(
    tmp_path, tiny_target, server
):
    fake = server(system_prompt=SYSTEM, tokenize=True)
    bad = failed(preflight(config(tmp_path, tiny_target, fake.url, return_token_ids=False)))
    assert [r.name for r in bad] == [f"smoke request {fake.url}"]
    detail = bad[0].detail
    assert "prompt 'p000'" in detail and "they first differ at token" in detail
    server_part, local_part = detail.split("server [", 1)[1].split(", local [", 1)
    assert "system" in "".join(server_part.split("]")[0]) and "user" in local_part.split("]")[0]
    assert "chat template" in bad[0].remedy and "--chat-template" in bad[0].remedy


def test_without_tokenize_the_counts_are_named(tmp_path, tiny_target, server):
    fake = server(system_prompt=SYSTEM)  # answers 404 on /tokenize, as a server without it does
    bad = failed(preflight(config(tmp_path, tiny_target, fake.url, return_token_ids=False)))
    assert [r.name for r in bad] == [f"smoke request {fake.url}"]
    assert "the server counts" in bad[0].detail and "usage.prompt_tokens" in bad[0].detail
    assert "an added system turn" in bad[0].detail


def test_prompt_token_ids_in_the_response_show_the_difference(tmp_path, tiny_target, server):
    fake = server(system_prompt=SYSTEM)  # no /tokenize: the ids come with the completion (return_token_ids)
    bad = failed(preflight(config(tmp_path, tiny_target, fake.url, return_token_ids=True)))
    assert len(bad) == 1 and "they first differ at token" in bad[0].detail


def test_a_mismatch_that_shows_later_is_counted_in_generates_stats(tmp_path, tiny_target, server):
    fake = server(system_prompt=SYSTEM)
    cfg = config(tmp_path, tiny_target, fake.url, n=6)
    out = run(cfg, skip_preflight=True)
    assert out["counts"]["template_mismatch"] == 6
    assert any("rendered otherwise than the target's chat template" in w for w in out["warnings"])
    end = [e for e in RunDir(cfg.run_dir).events() if e.get("event") == "end"][-1]
    assert end["counts"]["template_mismatch"] == 6
    assert any("chat template" in f for f in generate.data_flags(end["counts"]))


def test_a_matching_server_counts_no_mismatch(tmp_path, tiny_target, server):
    fake = server()
    out = run(config(tmp_path, tiny_target, fake.url, n=6), skip_preflight=True)
    assert out["counts"]["template_mismatch"] == 0 and not out["warnings"]


def test_a_hub_id_target_in_the_cache_is_compared_too(tmp_path, hub_target, server):  # noqa: F811
    fake = server(system_prompt=SYSTEM, tokenize=True)
    data = config_dict(tmp_path, [fake.url], 4, return_token_ids=False)
    data["target"] = {"model": REPO}  # read from its cached snapshot, offline
    bad = failed(preflight(parse_config(data, base_dir=tmp_path)))
    assert [r.name for r in bad] == [f"smoke request {fake.url}"]
    assert "they first differ at token" in bad[0].detail
