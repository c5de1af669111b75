"""Named benchmark suites: the prompt sets drafters are compared on (model cards, the EAGLE papers).

A drafter's τ depends on what it drafts for, so a number only means something beside a published one when
the prompts are the same: the same dataset, the same rows, the same wording around them. Each suite here
names its usual hub dataset (config, split, columns) and the user-turn format the EAGLE evaluations use:
the benchmark's text as the user message, zero-shot, with the chat template applied by the caller (so the
reasoning switch of the template is the caller's, too). MT-Bench keeps both of its turns: the second is
measured after the target's own first answer (see ``SuiteItem.turns``).

Rows come from ``datasets``: ``load_dataset(hub_id, config, split=...)`` on first use (its progress bars
show the download; the files stay in the datasets cache, ``HF_DATASETS_CACHE``, so later runs read them
offline), or from a local copy given as ``path``: a JSONL/JSON/Parquet file or a ``save_to_disk`` folder
with the hub's columns, for a machine without network access.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglekit.errors import UsageError


@dataclass(frozen=True)
class SuiteItem:
    id: str
    turns: list[str]  # user turns in order; turn n is sent after the target's own answers to turns < n


@dataclass(frozen=True)
class SuiteSpec:
    hub_id: str
    config: str | None
    split: str
    columns: tuple[str, ...]  # the row fields the format reads (checked, so a wrong local copy is named)
    id_column: str | None  # None: the row index
    turns: Callable[[dict], list[str]]
    description: str


MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def _longbench_turn(row: dict) -> list[str]:
    # LongBench v2's zero-shot template (its repository's prompts/0shot.txt), the context first
    choices = "\n".join(f"({c}) {row[f'choice_{c}']}" for c in "ABCD")
    return [
        "Please read the following text and answer the question below.\n\n<text>\n"
        f"{row['context']}\n</text>\n\nWhat is the correct answer to this question: {row['question']}\n"
        f'Choices:\n{choices}\n\nFormat your response as follows: "The correct answer is (insert answer here)".'
    ]


def _alpaca_turn(row: dict) -> list[str]:
    # Alpaca's instruction with its optional input below it, as the Alpaca template lays them out
    extra = (row.get("input") or "").strip()
    return [row["instruction"] + (f"\n\n{extra}" if extra else "")]


SUITES: dict[str, SuiteSpec] = {
    "mt_bench": SuiteSpec(
        "HuggingFaceH4/mt_bench_prompts",
        None,
        "train",
        ("prompt",),
        "prompt_id",
        lambda row: list(row["prompt"]),
        "MT-Bench: 80 two-turn questions over 8 categories (FastChat's question.jsonl)",
    ),
    "gsm8k": SuiteSpec(
        "openai/gsm8k",
        "main",
        "test",
        ("question",),
        None,
        lambda row: [row["question"]],
        "GSM8K test: 1319 grade-school word problems, the question as the user turn",
    ),
    "humaneval": SuiteSpec(
        "openai/openai_humaneval",
        None,
        "test",
        ("prompt",),
        "task_id",
        lambda row: [row["prompt"]],
        "HumanEval: 164 Python signatures with docstrings, the code as the user turn",
    ),
    "math500": SuiteSpec(
        "HuggingFaceH4/MATH-500",
        None,
        "test",
        ("problem",),
        "unique_id",
        lambda row: [row["problem"] + MATH_SUFFIX],
        "MATH-500: 500 competition problems with the \\boxed{} instruction the reasoning-model evaluations use",
    ),
    "alpaca": SuiteSpec(
        "tatsu-lab/alpaca",
        None,
        "train",
        ("instruction",),
        None,
        _alpaca_turn,
        "Alpaca: open-domain instructions (the chat set of the EAGLE papers)",
    ),
    "longbench_v2": SuiteSpec(
        "THUDM/LongBench-v2",
        None,
        "train",
        ("context", "question", "choice_A", "choice_B", "choice_C", "choice_D"),
        "_id",
        _longbench_turn,
        "LongBench v2: 503 questions over 8k-2M-word documents, to fill the long-context groups "
        "(set max_prompt_tokens: the middle of a longer prompt is cut, as LongBench does)",
    ),
}


def suite_names() -> str:
    return ", ".join(SUITES)


def load_suite(name: str, num_samples: int | None = None, path: str | None = None) -> list[SuiteItem]:
    """The first ``num_samples`` items of suite ``name`` (all when None), from ``path`` or the hub."""
    spec = SUITES.get(name)
    if spec is None:
        raise UsageError(f"unknown benchmark suite {name!r}", f"use one of: {suite_names()}")
    rows = _rows_from_path(Path(path), spec) if path else _rows_from_hub(name, spec)
    missing = [c for c in spec.columns if c not in rows.column_names]
    if missing:
        where = path or spec.hub_id
        raise UsageError(
            f"{where}: suite {name!r} needs the column(s) {', '.join(missing)} "
            f"(found: {', '.join(rows.column_names) or 'none'})",
            f"point the suite's path at a copy of {spec.hub_id} in the hub's layout",
        )
    items = []
    for index in range(len(rows) if num_samples is None else min(num_samples, len(rows))):
        row = rows[index]
        turns = spec.turns(row)
        if not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise UsageError(
                f"{path or spec.hub_id}: row {index} of suite {name!r} has an empty prompt",
                "fix or remove that row of the local copy",
            )
        sample_id = str(row[spec.id_column]) if spec.id_column and row.get(spec.id_column) is not None else str(index)
        items.append(SuiteItem(id=f"{name}:{sample_id}", turns=turns))
    if not items:
        raise UsageError(f"{path or spec.hub_id}: suite {name!r} has no rows", "use a copy with at least one row")
    return items


def _rows_from_hub(name: str, spec: SuiteSpec) -> Any:
    import datasets

    print(f"suite {name}: {spec.hub_id} ({spec.split}) from the datasets cache or the hub", file=sys.stderr)
    try:
        return datasets.load_dataset(spec.hub_id, spec.config, split=spec.split)
    except Exception as err:  # network, auth and layout errors all leave the user with the same choices
        raise UsageError(
            f"could not load suite {name!r} from {spec.hub_id}: {err}",
            "check the network (or HF_ENDPOINT / HF_TOKEN), or download it elsewhere and set the suite's path "
            "to the JSONL/Parquet/saved folder",
        ) from None


def _rows_from_path(path: Path, spec: SuiteSpec) -> Any:
    import datasets

    if not path.exists():
        raise UsageError(f"suite file not found: {path}", f"set the suite's path to a local copy of {spec.hub_id}")
    try:
        if path.is_dir():
            loaded = datasets.load_from_disk(str(path))
            return loaded[spec.split] if isinstance(loaded, datasets.DatasetDict) else loaded
        kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(path.suffix.lower())
        if kind is None:
            raise UsageError(
                f"{path}: unknown suite file type '{path.suffix or '(none)'}'",
                "use .jsonl, .json, .parquet or a datasets save_to_disk folder",
            )
        return datasets.load_dataset(kind, data_files=str(path), split="train")
    except UsageError:
        raise
    except KeyError:
        raise UsageError(f"{path}: no split {spec.split!r} in the saved folder", "save that split") from None
    except Exception as err:  # datasets raises many kinds for an unreadable file; all mean the same here
        raise UsageError(f"{path}: not readable as a dataset ({err})", "re-export it as JSONL or Parquet") from None
