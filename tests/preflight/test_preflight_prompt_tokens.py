"""Generate's pre-flight tokenises the prompts once: the prompt length check and the servers' context length check
(an OpenAI-compatible backend runs both) compare the same counts, made once per pre-flight run of the stage."""

from __future__ import annotations

from collections import Counter

import pytest
from support.fake_vllm import FakeVLLM

from eaglekit import pipeline
from eaglekit.config import parse_config
from eaglekit.data.chat import local_target_tokenizer
from eaglekit.data.prompts import run_prompts
from eaglekit.preflight import dataset
from eaglekit.preflight import servers as serving
from eaglekit.tiny import write_prompts

PROMPTS = 40


def generate_context(tmp_path, target, url: str, max_tokens: int):
    prompts = tmp_path / "prompts.jsonl"
    if not prompts.exists():
        write_prompts(prompts, n=PROMPTS, seed=7)
    cfg = parse_config(
        {
            "run_dir": str(tmp_path / "run"),
            "target": {"model": str(target)},
            "data": {"prompts": str(prompts)},
            "generate": {"backend": "openai", "servers": [url], "model": "tiny", "max_tokens": max_tokens},
        },
        base_dir=tmp_path,
    )
    return pipeline.make_context(cfg, "generate")


def both_checks(ctx):
    return dataset.prompt_length(ctx), serving.context_length(ctx)


@pytest.mark.parametrize("max_model_len, verdict", [(4096, "ok"), (120, "fail")])
def test_the_two_length_checks_tokenise_each_prompt_once_and_say_what_they_said_alone(
    tmp_path, tiny_target, monkeypatch, max_model_len, verdict
):
    with FakeVLLM(model="tiny", max_model_len=max_model_len) as server:
        # each check alone, on a context of its own: what it reported when each counted for itself
        alone = (
            dataset.prompt_length(generate_context(tmp_path, tiny_target, server.url, 100)),
            serving.context_length(generate_context(tmp_path, tiny_target, server.url, 100)),
        )
        ctx = generate_context(tmp_path, tiny_target, server.url, 100)
        tokenizer = local_target_tokenizer(ctx.cfg)  # the loaded one both checks use (cached per folder)
        rendered: Counter[str] = Counter()
        render = tokenizer.apply_chat_template
        tokenised = []
        tokenize = type(tokenizer).__call__

        def counting_render(messages, *args, **kwargs):
            rendered[messages[-1]["content"]] += 1
            return render(messages, *args, **kwargs)

        def counting_tokenize(self, text, *args, **kwargs):
            tokenised.extend([text] if isinstance(text, str) else text)
            return tokenize(self, text, *args, **kwargs)

        monkeypatch.setattr(tokenizer, "apply_chat_template", counting_render)
        monkeypatch.setattr(type(tokenizer), "__call__", counting_tokenize)
        together = both_checks(ctx)

    assert len(rendered) == PROMPTS and set(rendered.values()) == {1}  # each prompt rendered once
    assert len(tokenised) == PROMPTS  # and tokenised once, for both checks
    assert [(r.status, r.detail, r.remedy) for r in together] == [(r.status, r.detail, r.remedy) for r in alone]
    assert together[1].status == verdict
    counts, _, exact = dataset.prompt_token_counts(ctx.cfg, run_prompts(ctx.cfg).records)
    longest = counts[0][0]
    assert exact and len(counts) == PROMPTS
    assert all(f"longest prompt {longest:,} tokens" in r.detail for r in together if r.status == "ok")
