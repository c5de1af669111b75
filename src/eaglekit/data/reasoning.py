"""Where a response keeps its reasoning, and how to get it out.

Servers disagree (docs/formats.md §5): vLLM ≥ 0.16 sends ``message.reasoning``, older vLLM and SGLang send
``message.reasoning_content``, servers without a reasoning parser leave ``<think>…</think>`` inline in
``content`` (and templates that open ``<think>`` in the prompt leave only ``</think>``). Reading the
wrong field silently collects empty reasoning, so every reader goes through this module, and when no
reasoning is found ``explain_missing_reasoning`` says which fields the server did send.
"""

from __future__ import annotations

from collections import Counter

from eaglekit.data.chat import local_target_tokenizer, template_has_think_tags

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
# Message fields that may carry reasoning, in order of precedence.
REASONING_FIELDS = ("reasoning", "reasoning_content")


def split_inline_think(text: str) -> tuple[str, str, bool]:
    """Split ``<think>reasoning</think>content``; returns (reasoning, content, found).

    A lone ``</think>`` (the opening tag was part of the prompt) counts too: everything before it is
    reasoning. Text without a closing tag is all content.
    """
    close = text.find(THINK_CLOSE)
    if close < 0:
        return "", text, False
    reasoning = text[:close]
    open_at = reasoning.find(THINK_OPEN)
    if open_at >= 0:
        reasoning = reasoning[open_at + len(THINK_OPEN) :]
    content = text[close + len(THINK_CLOSE) :]
    return reasoning.strip(), content.strip(), True


def has_think_tags(text: str) -> bool:
    return THINK_OPEN in text or THINK_CLOSE in text


def fields_seen(message: dict) -> list[str]:
    """The message's non-empty fields (``role`` aside): what the server actually sent."""
    return sorted(k for k, v in message.items() if k != "role" and v not in (None, "", [], {}))


def extract_reasoning(message: dict) -> tuple[str, str, str, list[str]]:
    """(reasoning, content, reasoning_source, fields_seen) of a chat completion's ``choices[0].message``.

    Precedence: ``reasoning``, then ``reasoning_content``, then think tags inline in ``content``.
    """
    content = message.get("content") or ""
    seen = fields_seen(message)
    for field in REASONING_FIELDS:
        value = message.get(field)
        if isinstance(value, str) and value.strip():
            return value.strip(), content.strip(), field, seen
    reasoning, rest, found = split_inline_think(content)
    if found:
        return reasoning, rest, "inline_think", seen
    return "", content.strip(), "none", seen


def explain_missing_reasoning(
    seen: Counter, n: int, length_stopped: int = 0, empty: int | None = None, backend: str = "openai"
) -> str:
    """Why ``empty`` of ``n`` responses (all of them by default) had no reasoning, from the Counter of the fields
    the ``n`` carried; advice fits the backend (a server's reasoning parser, or the local chat template).

    Names the fields the replies carried, so "reads the wrong field" and "no reasoning parser" read differently.
    """
    empty = n if empty is None else empty
    who = "the server" if backend == "openai" else "the local target"
    sent = ", ".join(f"`{f}` ({c}/{n})" for f, c in seen.most_common()) or "nothing"
    readable = ", ".join(f"`{f}`" for f in REASONING_FIELDS)
    unknown = [
        f
        for f in seen
        if f not in (*REASONING_FIELDS, "content", "tool_calls", "refusal", "annotations", "audio", "function_call")
    ]
    if unknown:
        why = (
            f"{who} sends {', '.join(f'`{f}`' for f in unknown)}, a field eaglekit does not read as reasoning "
            f"(it reads {readable} and inline {THINK_OPEN}…{THINK_CLOSE})"
        )
    elif length_stopped and length_stopped >= empty // 2:
        why = (
            f"{length_stopped} of {n} stopped at max_tokens (finish_reason=length) before closing the reasoning; "
            "raise generate.max_tokens"
        )
    elif empty < n:
        why = (
            f"the other {n - empty} did reason, so {who} sometimes answers without thinking; if that is expected, "
            "raise generate.gate_max_empty_share or set generate.reasoning: optional"
        )
    elif backend == "openai":
        why = (
            f"none of them had {readable} or inline {THINK_CLOSE}; is `--reasoning-parser` set on the server "
            "(vLLM/SGLang), or does the chat template need `chat_template_kwargs: {enable_thinking: true}` in "
            "generate.extra_body?"
        )
    else:
        why = (
            f"none of the replies the target generated here has a {THINK_CLOSE}: does its chat template need "
            "`chat_template_kwargs: {enable_thinking: true}` in generate.extra_body, or does the model not think "
            "(then set generate.reasoning: optional)?"
        )
    return f"{why} (fields of the replies: {sent})"


def target_reasoning_mode(cfg) -> tuple[str, str]:
    """(required | optional | off, why) for a RunConfig: generate.reasoning, else what the target's template says."""
    if cfg.generate.reasoning:
        return cfg.generate.reasoning, "set by generate.reasoning"

    tokenizer = local_target_tokenizer(cfg)
    if tokenizer is None:
        return (
            "optional",
            f"the target tokenizer is not a local folder ({cfg.target.model}), so its template is unknown",
        )
    if template_has_think_tags(tokenizer):
        return "required", "the target's chat template has think tags"
    return "optional", "the target's chat template has no think tags"
