"""Benchmark suites read from local copies in the hub's layouts, and τ grouped by where each draft starts."""

from __future__ import annotations

import json

import datasets
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eaglekit.config import EvaluateConfig, VerifyConfig, parse_config
from eaglekit.data.suites import MATH_SUFFIX, SUITES, load_suite
from eaglekit.errors import UsageError
from eaglekit.speculative.decode import CONTEXT_BUCKETS, Generation, context_bucket, generate, tau_by_context

# rows shaped as the hub datasets have them (column names and types), a few each
MT_BENCH = [
    {"prompt": ["Write a haiku about tea.", "Now make it rhyme."], "prompt_id": 81, "category": "writing"},
    {"prompt": ["What is 7 * 6?", "And divided by 3?"], "prompt_id": 82, "category": "math"},
    {"prompt": ["Name a prime.", "Name a bigger one."], "prompt_id": 83, "category": "math"},
]
GSM8K = [
    {"question": "Tom has 3 apples and buys 2 more. How many?", "answer": "3 + 2 = 5\n#### 5"},
    {"question": "A box holds 4 pens. How many in 3 boxes?", "answer": "4 * 3 = 12\n#### 12"},
]
HUMANEVAL = [
    {"task_id": "HumanEval/0", "prompt": 'def add(a, b):\n    """Sum."""\n', "entry_point": "add"},
    {"task_id": "HumanEval/1", "prompt": 'def neg(a):\n    """Negate."""\n', "entry_point": "neg"},
]
MATH500 = [{"problem": "Compute $1+1$.", "answer": "2", "unique_id": "test/algebra/1.json"}]
ALPACA = [
    {"instruction": "Give three tips.", "input": "", "output": "..."},
    {"instruction": "Translate to French.", "input": "Good morning", "output": "..."},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_each_suite_reads_its_hub_layout_from_jsonl_parquet_and_saved_folders(tmp_path):
    datasets.Dataset.from_list(GSM8K).to_parquet(str(tmp_path / "gsm8k.parquet"))
    datasets.DatasetDict({"test": datasets.Dataset.from_list(HUMANEVAL)}).save_to_disk(str(tmp_path / "humaneval"))
    datasets.Dataset.from_list(ALPACA).save_to_disk(str(tmp_path / "alpaca"))

    mt = load_suite("mt_bench", path=str(write_jsonl(tmp_path / "mt.jsonl", MT_BENCH)))
    assert [item.turns for item in mt] == [row["prompt"] for row in MT_BENCH]  # both turns, in order
    assert mt[0].id == "mt_bench:81"

    gsm = load_suite("gsm8k", path=str(tmp_path / "gsm8k.parquet"))
    assert [item.turns for item in gsm] == [[row["question"]] for row in GSM8K]
    assert [item.id for item in gsm] == ["gsm8k:0", "gsm8k:1"]  # no id column: the row index

    human = load_suite("humaneval", path=str(tmp_path / "humaneval"))  # a DatasetDict: the suite's split
    assert human[1].turns == [HUMANEVAL[1]["prompt"]] and human[1].id == "humaneval:HumanEval/1"

    math = load_suite("math500", path=str(write_jsonl(tmp_path / "math.jsonl", MATH500)))
    assert math[0].turns == [MATH500[0]["problem"] + MATH_SUFFIX]

    alpaca = load_suite("alpaca", path=str(tmp_path / "alpaca"))
    assert alpaca[0].turns == ["Give three tips."]
    assert alpaca[1].turns == ["Translate to French.\n\nGood morning"]


def test_num_samples_takes_the_first_rows(tmp_path):
    items = load_suite("mt_bench", num_samples=2, path=str(write_jsonl(tmp_path / "mt.jsonl", MT_BENCH)))
    assert [item.id for item in items] == ["mt_bench:81", "mt_bench:82"]


def test_a_copy_in_the_wrong_layout_names_the_missing_column_and_the_hub_id(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(UsageError) as err:
        load_suite("gsm8k", path=str(path))
    assert "question" in str(err.value) and "chat.jsonl" in str(err.value)
    assert SUITES["gsm8k"].hub_id in err.value.remedy


def test_unknown_suite_and_missing_copy_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="unknown benchmark suite"):
        load_suite("mmlu")
    with pytest.raises(UsageError, match="not found"):
        load_suite("gsm8k", path=str(tmp_path / "absent.jsonl"))


def test_config_takes_bare_names_and_resolves_paths_against_the_config(tmp_path):
    cfg = parse_config(
        {
            "run_dir": "run",
            "target": {"model": "t"},
            "data": {"prompts": "p.jsonl"},
            "evaluate": {"suites": ["gsm8k", {"name": "mt_bench", "path": "mt.jsonl", "num_samples": 2}]},
            "verify": {"suites": ["math500"]},
        },
        base_dir=tmp_path,
    )
    assert [s.name for s in cfg.evaluate.suites] == ["gsm8k", "mt_bench"]
    assert cfg.evaluate.suites[1].path == str(tmp_path / "mt.jsonl")
    assert cfg.verify.suites is not None and cfg.verify.suites[0].name == "math500"
    assert VerifyConfig().suites is None  # verify then serves evaluate's
    assert EvaluateConfig(reasoning=False).reasoning == "off"  # `reasoning: off` unquoted, as YAML reads it


# ------------------------------------------------------------------------------ τ by context length


def test_context_buckets_cover_every_position_once():
    bounds = [b for _, b in CONTEXT_BUCKETS if b is not None]
    for bound in bounds:
        assert context_bucket(bound - 1) != context_bucket(bound)
    assert context_bucket(0) == CONTEXT_BUCKETS[0][0] and context_bucket(10**6) == CONTEXT_BUCKETS[-1][0]


def test_tau_by_context_averages_each_bucket_alone():
    gens = [
        Generation([], None, accepted_per_round=[3, 1], context_per_round=[100, 2000]),  # type: ignore[arg-type]
        Generation([], None, accepted_per_round=[0, 2], context_per_round=[900, 20000]),  # type: ignore[arg-type]
    ]
    groups = tau_by_context(gens)
    assert list(groups) == ["<1k", "1-4k", ">16k"]  # in bucket order, empty buckets left out
    assert groups["<1k"] == {"rounds": 2, "tau": 1 + (3 + 0) / 2}
    assert groups["1-4k"]["tau"] == 2 and groups[">16k"]["tau"] == 3


class Oracle:
    """Proposes the known greedy continuation with the first ``correct`` drafts right."""

    aux_layer_ids = None

    def __init__(self, reference: list[int], correct: int):
        self.reference, self.correct = reference, correct

    def reset(self, ids, aux):
        self.done = 1

    def propose(self, k, temperature, generator):
        truth = self.reference[self.done : self.done + k]
        return [t if i < self.correct else (t + 1) % 96 for i, t in enumerate(truth)], None

    def update(self, new_ids, aux):
        self.done += len(new_ids)


def test_each_verify_pass_records_the_context_its_draft_starts_after():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
    )
    target = LlamaForCausalLM(cfg).eval()
    prompt = torch.randint(0, 96, (17,), generator=torch.Generator().manual_seed(1)).tolist()
    plain = generate(target, prompt, 30)
    spec = generate(target, prompt, 30, proposer=Oracle(plain.tokens, correct=2), k=4)
    assert spec.tokens == plain.tokens
    # the first draft follows the prompt and the prefill's token; each pass then moves it by what it emitted
    assert spec.context_per_round[0] == len(prompt) + 1
    steps = [b - a for a, b in zip(spec.context_per_round, spec.context_per_round[1:], strict=False)]
    assert steps == [n + 1 for n in spec.accepted_per_round[:-1]]
    assert len(spec.context_per_round) == len(spec.accepted_per_round)


def test_longbench_layout_and_its_middle_cut_to_max_prompt_tokens(tmp_path, tiny_target):
    from eaglekit.data.chat import load_tokenizer
    from eaglekit.speculative.benchmark import suite_prompts

    row = {"_id": "lb1", "question": "Which color?", "answer": "A", "length": "short"}
    row |= {f"choice_{c}": f"color {c}" for c in "ABCD"}
    row["context"] = "HEAD " + " ".join(f"word{i}" for i in range(3000)) + " TAIL"
    (item,) = load_suite("longbench_v2", path=str(write_jsonl(tmp_path / "lb.jsonl", [row])))
    assert item.id == "longbench_v2:lb1" and item.turns[0].startswith("Please read the following text")
    assert "(D) color D" in item.turns[0]

    tokenizer = load_tokenizer(str(tiny_target))
    kept, skipped = suite_prompts(None, tokenizer, [item], None, 8, set(), room=10_000, max_prompt_tokens=400)
    assert skipped == 0 and 350 <= len(kept[0].ids) <= 400  # cut to fit, no more than the seam's margin below
    text = tokenizer.decode(kept[0].ids)
    assert "HEAD" in text and "Which color?" in text and "word1500" not in text  # head and tail kept, middle gone
    whole, skipped = suite_prompts(None, tokenizer, [item], None, 8, set(), room=400)
    assert whole == [] and skipped == 1  # without the cut, a prompt that does not fit is skipped, and counted


def test_preflight_names_an_unknown_suite_and_a_missing_copy(tmp_path):
    from types import SimpleNamespace

    from eaglekit.stages.evaluate import benchmark_suites

    def check(evaluate_suites):
        cfg = parse_config(
            {
                "run_dir": "run",
                "target": {"model": "t"},
                "data": {"prompts": "p.jsonl"},
                "evaluate": {"suites": evaluate_suites},
            },
            base_dir=tmp_path,
        )
        return benchmark_suites(SimpleNamespace(cfg=cfg))

    unknown = check(["mmlu"])
    assert unknown.status == "fail" and "unknown suite 'mmlu'" in unknown.detail and "gsm8k" in unknown.remedy
    missing = check([{"name": "gsm8k", "path": "absent.parquet"}])
    assert missing.status == "fail" and "absent.parquet not found" in missing.detail
    assert "openai/gsm8k" in missing.remedy
    assert check(["gsm8k"]).status == "ok"
