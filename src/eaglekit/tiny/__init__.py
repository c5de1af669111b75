"""The built-in tiny target: a small trained Llama with a Qwen3-style thinking chat template, for the demo and the tests."""

from eaglekit.tiny.build import (
    CHAT_TEMPLATE,
    RECIPE_VERSION,
    build_tiny_target,
    ensure_tiny_target,
    heldout_scores,
    parse_completion,
    write_prompts,
)
from eaglekit.tiny.corpus import Task, sample_tasks, split_of

__all__ = [
    "CHAT_TEMPLATE",
    "RECIPE_VERSION",
    "Task",
    "build_tiny_target",
    "ensure_tiny_target",
    "heldout_scores",
    "parse_completion",
    "sample_tasks",
    "split_of",
    "write_prompts",
]
