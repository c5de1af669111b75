"""evaluate with benchmark suites on the tiny target: one row per suite × mode × K × T with its interval, MT-Bench's
second turn after the target's own first answer, the reasoning switch in the prompt, τ by context length."""

from __future__ import annotations

import json

import datasets
from support.helpers import write_config
from test_evaluate_export import drafter_dir, prompts_file  # noqa: F401  (module fixtures, reused)

from eaglekit import pipeline, status
from eaglekit.config import load_config
from eaglekit.data.chat import end_of_turn_token_ids, load_tokenizer
from eaglekit.data.suites import load_suite
from eaglekit.speculative.benchmark import suite_prompts, template_kwargs
from eaglekit.speculative.decode import CONTEXT_BUCKETS, generate
from eaglekit.tiny.corpus import sample_tasks

# the tiny target's template with Qwen3's thinking switch: enable_thinking false opens each reply with an empty think
TEMPLATE = (
    "{%- set quiet = enable_thinking is defined and enable_thinking is false %}"
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.role == 'assistant' and quiet %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{{- (message.content or '') + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if quiet %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


def suite_copies(tmp_path):
    """MT-Bench and GSM8K in their hub layouts, with the tiny target's own kind of questions."""
    tasks = sample_tasks(6, seed=7, split="heldout")
    mt = tmp_path / "mt_bench.jsonl"
    mt.write_text(
        "".join(
            json.dumps(
                {"prompt_id": 81 + i, "category": "math", "prompt": [tasks[2 * i].prompt, tasks[2 * i + 1].prompt]}
            )
            + "\n"
            for i in range(2)
        )
    )
    gsm = tmp_path / "gsm8k.parquet"
    datasets.Dataset.from_list([{"question": t.prompt, "answer": "#### 1"} for t in tasks[4:]]).to_parquet(str(gsm))
    return mt, gsm


def test_the_second_turn_follows_the_targets_own_first_answer(tmp_path, tiny_target):
    from transformers import AutoModelForCausalLM

    mt, _ = suite_copies(tmp_path)
    target = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    tokenizer = load_tokenizer(str(tiny_target), TEMPLATE)
    stops = end_of_turn_token_ids(tokenizer)
    items = load_suite("mt_bench", 1, str(mt))
    for mode in ("on", "off"):
        prompts, skipped = suite_prompts(target, tokenizer, items, template_kwargs(None, {}, mode), 24, stops, 10_000)
        assert skipped == 0 and [p.turn for p in prompts] == [1, 2]
        first, second = prompts
        answer = generate(target, first.ids, 24, stop_ids=stops).tokens
        rendered = tokenizer.decode(second.ids)
        assert tokenizer.decode(answer, skip_special_tokens=True) in rendered  # what the target said, as history
        assert rendered.startswith(tokenizer.decode(first.ids))
        assert rendered.endswith("<think>\n\n</think>\n\n" if mode == "off" else "<|im_start|>assistant\n")


def test_evaluate_reports_each_suite_mode_k_and_temperature(tmp_path, tiny_target, drafter_dir, prompts_file):  # noqa: F811
    mt, gsm = suite_copies(tmp_path)
    config = write_config(
        tmp_path / "config.yaml",
        {
            "run_dir": str(tmp_path / "run"),
            "target": {"model": str(tiny_target), "chat_template": TEMPLATE},
            "data": {"prompts": str(prompts_file)},
            "evaluate": {
                "prompts": str(prompts_file),
                "checkpoint": str(drafter_dir),
                "num_samples": 2,
                "num_speculative_tokens": [1, 3],
                "temperatures": [0.0],
                "max_new_tokens": 24,
                "suites": [{"name": "mt_bench", "path": str(mt)}, {"name": "gsm8k", "path": str(gsm)}],
                "reasoning": "both",
            },
        },
    )
    cfg = load_config(config)
    row = pipeline.run_stage(cfg, "evaluate", skip_preflight=True)
    out = cfg.run_path / "evaluate"
    section = json.loads((out / "report.json").read_text())["suites"]
    rows = section["rows"]
    assert {(r["suite"], r["mode"], r["k"], r["temperature"]) for r in rows} == {
        (s, m, k, 0.0) for s in ("mt_bench", "gsm8k") for m in ("on", "off") for k in (1, 3)
    }
    for r in rows:
        assert r["tau_ci95"][0] <= r["tau"] <= r["tau_ci95"][1] and 1.0 <= r["tau_ci95"][0] <= r["k"] + 1
        assert len(r["acceptance_by_position"]) == r["k"]
        assert sum(g["rounds"] for g in r["tau_by_context"].values()) == r["draft_rounds"] <= r["rounds"]
        assert set(r["tau_by_context"]) <= {label for label, _ in CONTEXT_BUCKETS}
    mt_rows = [r for r in rows if r["suite"] == "mt_bench"]
    assert all(r["prompts"] == 4 and set(r["tau_by_turn"]) == {"1", "2"} for r in mt_rows)  # 2 questions × 2 turns
    # the training data was rendered with the template's default, which thinks: only "off" renders differently
    assert section["training_mode"] == "default" and section["modes_unlike_training"] == ["off"]
    assert "reasoning mode off, whose prompts render differently" in section["warnings"][0]
    assert section["warnings"][0] in row["warnings"]
    md = (out / "report.md").read_text()
    assert "| mt_bench (turn 1:" in md and "| gsm8k | off | 3 | 0 |" in md and "τ ctx <1k" in md
    assert (out / "suites_tau.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert row["counts"]["gsm8k_off_tau_k3"] == next(
        r["tau"] for r in rows if (r["suite"], r["mode"], r["k"]) == ("gsm8k", "off", 3)
    )
    lines = status.suite_lines(cfg, status.stage_rows(cfg))  # `eaglekit status` prints these under its table
    assert len(lines) == 4 and all(line.startswith("evaluate: ") and "K=3" in line for line in lines)
    gsm_off = next(r for r in rows if (r["suite"], r["mode"], r["k"]) == ("gsm8k", "off", 3))
    assert f"gsm8k, reasoning off, K=3, T=0: τ {gsm_off['tau']:.2f}" in "\n".join(lines)
