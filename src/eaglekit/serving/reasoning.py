"""Where a response keeps its reasoning, and how to get it out.

Servers disagree (FORMATS.md §2): vLLM ≥ 0.16 sends ``message.reasoning``, older vLLM and SGLang send
``message.reasoning_content``, servers without a reasoning parser leave ``<think>…</think>`` inline in
``content`` (and templates that open ``<think>`` in the prompt leave only ``</think>``). Reading the
wrong field silently collects empty reasoning, so every reader goes through this module.
"""

from __future__ import annotations

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


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
        reasoning = reasoning[open_at + len(THINK_OPEN):]
    content = text[close + len(THINK_CLOSE):]
    return reasoning.strip(), content.strip(), True
