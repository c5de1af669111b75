"""Reasoning extraction: field precedence, inline think tags, a lone </think>, nothing; and the explanations."""

from collections import Counter

import pytest

from eaglekit.data.reasoning import explain_missing_reasoning, extract_reasoning, split_inline_think

R, C = "step one, step two", "the answer"


@pytest.mark.parametrize(
    "message, reasoning, content, source",
    [
        # vLLM >= 0.16
        ({"role": "assistant", "content": C, "reasoning": R}, R, C, "reasoning"),
        # vLLM 0.11-0.15 send both; `reasoning` wins
        ({"content": C, "reasoning": R, "reasoning_content": "older copy"}, R, C, "reasoning"),
        # SGLang / older vLLM
        ({"content": C, "reasoning_content": R}, R, C, "reasoning_content"),
        # an empty or null `reasoning` beside a filled `reasoning_content` must not hide it
        ({"content": C, "reasoning": "", "reasoning_content": R}, R, C, "reasoning_content"),
        ({"content": C, "reasoning": None, "reasoning_content": R}, R, C, "reasoning_content"),
        # no reasoning parser: inline tags in content
        ({"content": f"<think>\n{R}\n</think>\n\n{C}"}, R, C, "inline_think"),
        # the template opened <think> in the prompt: only the closing tag comes back
        ({"content": f"{R}\n</think>\n\n{C}"}, R, C, "inline_think"),
        # empty fields fall through to the inline split
        ({"content": f"<think>{R}</think>{C}", "reasoning": None, "reasoning_content": ""}, R, C, "inline_think"),
        # nothing anywhere
        ({"content": C, "reasoning": None}, "", C, "none"),
        ({"content": None}, "", "", "none"),
        # an unclosed <think> (cut at max_tokens) is not reasoning: it stays in content, where it is counted
        ({"content": f"<think>\n{R}"}, "", f"<think>\n{R}", "none"),
    ],
)
def test_extraction_table(message, reasoning, content, source):
    got_reasoning, got_content, got_source, _ = extract_reasoning(message)
    assert (got_reasoning, got_content, got_source) == (reasoning, content, source)


def test_fields_seen_lists_what_the_server_sent():
    _, _, _, seen = extract_reasoning({"role": "assistant", "content": C, "thinking": R, "reasoning": None})
    assert seen == ["content", "thinking"]


def test_split_inline_think_keeps_text_without_close_tag():
    assert split_inline_think("plain answer") == ("", "plain answer", False)
    assert split_inline_think("<think>a</think>b") == ("a", "b", True)


def test_explanations_name_the_cause():
    unknown = explain_missing_reasoning(Counter({"content": 20, "thinking": 20}), 20)
    assert "`thinking`" in unknown and "does not read" in unknown
    parser = explain_missing_reasoning(Counter({"content": 20}), 20)
    assert "--reasoning-parser" in parser and "`content` (20/20)" in parser
    cut = explain_missing_reasoning(Counter({"content": 5}), 20, length_stopped=15)
    assert "max_tokens" in cut and "15 of 20" in cut


def test_the_gate_explanation_counts_consistently_and_fits_the_backend():
    # 3 of 20 without reasoning, the other 17 with it (inline, as the local backend sees them)
    some = explain_missing_reasoning(Counter({"content": 20}), 20, empty=3, backend="local")
    assert "the other 17 did reason" in some and "none of" not in some and "--reasoning-parser" not in some
    local = explain_missing_reasoning(Counter({"content": 20}), 20, backend="local")
    assert "--reasoning-parser" not in local and "enable_thinking" in local and "generate.reasoning: optional" in local
    server = explain_missing_reasoning(Counter({"content": 20}), 20, backend="openai")
    assert "--reasoning-parser" in server
