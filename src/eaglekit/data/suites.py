"""Named benchmark suites: the prompt sets drafters are compared on (model cards, the EAGLE papers).

A drafter's τ depends on what it drafts for, so a number only means something beside a published one when
the prompts are the same: the same dataset, the same rows, the same wording around them. Each suite here
names its usual hub dataset (config, split, columns) and the user-turn format the EAGLE evaluations use:
the benchmark's text as the user message, zero-shot, with the chat template applied by the caller (so the
reasoning switch of the template is the caller's, too). MT-Bench keeps both of its turns: the second is
measured after the target's own first answer (see ``SuiteItem.turns``).

Rows come from ``datasets``: ``load_dataset(hub_id, config, split=...)`` on first use (its progress bars
show the download; the files stay in the datasets cache, ``HF_DATASETS_CACHE``, so later runs read them
offline), or from a local copy given as ``path``, for a machine without network access: a JSONL/JSON/Parquet
file, a ``save_to_disk`` folder, or a clone of the hub repository (its parquet/jsonl files, split by their names
as the hub splits them: ``data/test-00000-of-00001.parquet``, a config's subfolder). A suite also reads the
layout its benchmark's own repository publishes, e.g. FastChat's MT-Bench ``question.jsonl`` (``turns``,
``question_id``). Pre-flight reads a local copy the same way, so a copy evaluate cannot read stops the run
before training, not after it.
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
    # (column in another published layout, the hub's column it holds): renamed when the hub's is absent
    aliases: tuple[tuple[str, str], ...] = ()


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
        aliases=(("turns", "prompt"), ("question_id", "prompt_id")),  # FastChat's llm_judge/data/mt_bench layout
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
    rows, where = _rows_from_path(Path(path), spec) if path else (_rows_from_hub(name, spec), spec.hub_id)
    for other, column in spec.aliases:
        if column not in rows.column_names and other in rows.column_names:
            rows = rows.rename_column(other, column)
    missing = [c for c in spec.columns if c not in rows.column_names]
    if missing:
        layouts = "".join(f" or {other} (for {column})" for other, column in spec.aliases if column in missing)
        raise UsageError(
            f"{where}: suite {name!r} needs the column(s) {', '.join(missing)}{layouts} "
            f"(found: {', '.join(rows.column_names) or 'none'})",
            f"point the suite's path at a copy of {spec.hub_id} in the hub's layout",
        )
    items = []
    for index in range(len(rows) if num_samples is None else min(num_samples, len(rows))):
        row = rows[index]
        turns = spec.turns(row)
        if not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise UsageError(
                f"{where}: row {index} of suite {name!r} has an empty prompt",
                "fix or remove that row of the local copy",
            )
        sample_id = str(row[spec.id_column]) if spec.id_column and row.get(spec.id_column) is not None else str(index)
        items.append(SuiteItem(id=f"{name}:{sample_id}", turns=turns))
    if not items:
        raise UsageError(f"{where}: suite {name!r} has no rows", "use a copy with at least one row")
    return items


def _rows_from_hub(name: str, spec: SuiteSpec) -> Any:
    import datasets  # lazy: heavy (datasets)

    print(f"suite {name}: {spec.hub_id} ({spec.split}) from the datasets cache or the hub", file=sys.stderr)
    try:
        return datasets.load_dataset(spec.hub_id, spec.config, split=spec.split)
    except Exception as err:  # network, auth and layout errors all leave the user with the same choices
        raise UsageError(
            f"could not load suite {name!r} from {spec.hub_id}: {err}",
            "check the network (or HF_ENDPOINT / HF_TOKEN), or download it elsewhere and set the suite's path "
            "to the JSONL/Parquet/saved folder",
        ) from None


FILE_KINDS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# files of a saved (save_to_disk) folder, and the hub's metadata beside the data in a cloned repository
SAVED_FOLDER = ("dataset_dict.json", "dataset_info.json", "state.json")
NOT_DATA = {"dataset_infos.json", "dataset_info.json", "dataset_dict.json", "state.json"}
LFS_POINTER = b"version https://git-lfs"


def _rows_from_path(path: Path, spec: SuiteSpec) -> tuple[Any, str]:
    """The rows of a local copy and the file(s) they came from, for messages."""
    import datasets  # lazy: heavy (datasets)

    if not path.exists():
        raise UsageError(f"suite file not found: {path}", f"set the suite's path to a local copy of {spec.hub_id}")
    if path.is_dir() and not any((path / f).is_file() for f in SAVED_FOLDER):
        return _rows_from_clone(path, spec)
    try:
        if path.is_dir():
            loaded = datasets.load_from_disk(str(path))
            return (loaded[spec.split] if isinstance(loaded, datasets.DatasetDict) else loaded), str(path)
        kind = FILE_KINDS.get(path.suffix.lower())
        if kind is None:
            raise UsageError(
                f"{path}: unknown suite file type '{path.suffix or '(none)'}'",
                "use .jsonl, .json, .parquet, a datasets save_to_disk folder or a clone of the hub repository",
            )
        return _load_files(kind, [path]), str(path)
    except UsageError:
        raise
    except KeyError:
        raise UsageError(f"{path}: no split {spec.split!r} in the saved folder", "save that split") from None
    except Exception as err:  # datasets raises many kinds for an unreadable file; all mean the same here
        raise UsageError(f"{path}: not readable as a dataset ({err})", "re-export it as JSONL or Parquet") from None


def _rows_from_clone(path: Path, spec: SuiteSpec) -> tuple[Any, str]:
    """A cloned hub dataset repository: the suite's config subfolder when there is one, its split's files found by
    name as the hub finds them (``datasets``' own patterns), read from the local files only."""
    import datasets  # lazy: heavy (datasets)
    from datasets.data_files import DataFilesDict, get_data_patterns  # lazy: heavy (datasets)

    base = path / spec.config if spec.config and (path / spec.config).is_dir() else path
    if (base / "question.jsonl").is_file():  # FastChat's llm_judge/data/<bench>/: the answers lie in subfolders
        return _rows_from_path(base / "question.jsonl", spec)
    try:
        patterns = get_data_patterns(str(base))
        by_split = {
            str(split): [Path(f) for f in files]
            for split, files in DataFilesDict.from_patterns(patterns, base_path=str(base)).items()
        }
    except Exception:  # EmptyDatasetError and kin: no file the hub would read as data
        by_split = {}
    by_split = {
        split: [
            f
            for f in files
            if f.suffix.lower() in FILE_KINDS
            and f.name not in NOT_DATA
            and not any(part.startswith(".") for part in f.relative_to(base).parts)
        ]
        for split, files in by_split.items()
    }
    by_split = {split: files for split, files in by_split.items() if files}
    if not by_split:
        raise UsageError(
            f"{base}: holds no .parquet, .jsonl or .json data files (nor a datasets save_to_disk folder)",
            f"point the suite's path at a clone of {spec.hub_id}, or at one of its data files",
        )
    split = spec.split if spec.split in by_split else next(iter(by_split)) if len(by_split) == 1 else None
    if split is None:
        raise UsageError(
            f"{base}: no {spec.split!r} split among the data files (splits found: {', '.join(by_split)})",
            f"point the suite's path at the file of {spec.hub_id}'s {spec.split!r} split",
        )
    files = sorted(by_split[split])
    where = str(files[0]) if len(files) == 1 else f"{base} ({len(files)} {split} files: {files[0].name}, ...)"
    for f in files:
        with open(f, "rb") as fh:
            if fh.read(len(LFS_POINTER)) == LFS_POINTER:
                raise UsageError(
                    f"{f}: a Git LFS pointer, not the data (the clone did not fetch the LFS files)",
                    f"run `git lfs pull` in {path}",
                )
    try:
        parts = [
            _load_files(kind, [f for f in files if FILE_KINDS[f.suffix.lower()] == kind])
            for kind in sorted({FILE_KINDS[f.suffix.lower()] for f in files})
        ]
        return (parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)), where
    except Exception as err:  # an unreadable file, or parquet and jsonl files with other columns
        raise UsageError(f"{where}: not readable as a dataset ({err})", "re-export it as JSONL or Parquet") from None


def _load_files(kind: str, files: list[Path]) -> Any:
    import datasets  # lazy: heavy (datasets)

    return datasets.load_dataset(kind, data_files=[str(f) for f in files], split="train")
