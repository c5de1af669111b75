"""The built-in tiny targets: small trained Llamas with a Qwen3-style thinking chat template, for the demo and the tests
(``build``: short reasoning tasks, 1K context; ``long_build``: tool logs read from 20K back, 32K context)."""

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
from eaglekit.tiny.long_build import (
    PROMPT_TOKENS,
    build_long_target,
    ensure_long_target,
    far_context_scores,
    write_long_prompts,
)
from eaglekit.tiny.long_corpus import LongTask, sample_long_tasks

__all__ = [
    "CHAT_TEMPLATE",
    "PROMPT_TOKENS",
    "RECIPE_VERSION",
    "LongTask",
    "Task",
    "build_long_target",
    "build_tiny_target",
    "ensure_long_target",
    "ensure_tiny_target",
    "far_context_scores",
    "heldout_scores",
    "parse_completion",
    "sample_long_tasks",
    "sample_tasks",
    "split_of",
    "write_long_prompts",
    "write_prompts",
]
