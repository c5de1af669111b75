"""The built-in tiny target: loads like any HF model, speaks the thinking chat template, and answers held-out prompts."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import eaglekit.tiny.build as tiny_build
from eaglekit.atomic import atomic_dir, write_json
from eaglekit.demo import DEMO_SAMPLES
from eaglekit.errors import UsageError
from eaglekit.tiny import build_tiny_target, ensure_tiny_target, parse_completion, sample_tasks, split_of, write_prompts
from eaglekit.tiny.corpus import WORDS

# Measured on the default build (seed 0, 4000 steps): 100% well formed and 71% answered right over the
# manifest's 96 held-out prompts; 0.5 leaves room for a build that differs in the last float bits.
MIN_WELL_FORMED = 0.9
MIN_ACCURACY = 0.5


@pytest.fixture(scope="session")
def loaded(tiny_target):  # tiny_target: the session fixture of conftest.py (ensure_tiny_target)
    return AutoModelForCausalLM.from_pretrained(tiny_target), AutoTokenizer.from_pretrained(tiny_target)


def test_loads_like_any_hf_model(tiny_target, loaded):
    model, tok = loaded
    cfg = model.config
    n = cfg.num_hidden_layers
    assert n >= 8 and len({2, n // 2, n - 3}) == 3
    assert cfg.tie_word_embeddings is False
    assert cfg.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>") == model.generation_config.eos_token_id
    assert cfg.pad_token_id == tok.pad_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    for special in ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>"]:
        assert len(tok(special, add_special_tokens=False)["input_ids"]) == 1, special
    assert {"config.json", "model.safetensors", "generation_config.json", "eaglekit_tiny.json"} <= {
        p.name for p in tiny_target.iterdir()
    }
    assert json.loads((tiny_target / "tokenizer_config.json").read_text())["chat_template"] == tok.chat_template
    # the lm_head is its own tensor, not the embedding
    weights = load_file(tiny_target / "model.safetensors")
    assert not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])


def test_chat_template_renders_reasoning_in_think_tags(loaded):
    _, tok = loaded
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "2 + 2 = 4"},
    ]
    assert tok.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n2 + 2 = 4\n</think>\n\n4<|im_end|>\n"
    )
    prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    plain = tok.apply_chat_template([messages[1], {"role": "assistant", "content": "4"}], tokenize=False)
    assert plain.endswith("<|im_start|>assistant\n4<|im_end|>\n") and "<think>" not in plain


def test_greedy_generation_thinks_then_answers(loaded):
    model, tok = loaded
    tasks = sample_tasks(24, seed=123, split="heldout")
    tok.padding_side = "left"
    enc = tok.apply_chat_template(
        [[{"role": "user", "content": t.prompt}] for t in tasks],
        add_generation_prompt=True,
        padding=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=256, do_sample=False)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :])
    parsed = [parse_completion(t) for t in texts]
    well_formed = sum(p is not None for p in parsed) / len(tasks)
    accuracy = sum(p is not None and p[1] == t.answer for p, t in zip(parsed, tasks, strict=False)) / len(tasks)
    assert well_formed >= MIN_WELL_FORMED, texts
    assert accuracy >= MIN_ACCURACY, [(t.answer, p) for t, p in zip(tasks, parsed, strict=False)]


def test_manifest_records_the_build(tiny_target):
    manifest = json.loads((tiny_target / "eaglekit_tiny.json").read_text())
    assert manifest["recipe_version"] == tiny_build.RECIPE_VERSION and manifest["steps"] == tiny_build.DEFAULT_STEPS
    assert manifest["heldout_prompts"] > 0 and manifest["well_formed"] >= MIN_WELL_FORMED
    assert manifest["accuracy"] >= MIN_ACCURACY and manifest["build_seconds"] > 0


def test_parse_completion_shape():
    assert parse_completion("<think>\nstep 1\nstep 2\n</think>\n\n42<|im_end|>") == ("step 1\nstep 2", "42")
    assert parse_completion("<think>\nstep\n</think>\n\n42<|im_end|><|endoftext|><|endoftext|>") == ("step", "42")
    assert parse_completion("42<|im_end|>") is None
    assert parse_completion("<think>\nstep\n</think>\n\n42") is None  # never finished


def test_corpus_is_deterministic_correct_and_split():
    assert sample_tasks(30, seed=5) == sample_tasks(30, seed=5)
    assert sample_tasks(30, seed=5) != sample_tasks(30, seed=6)
    train = sample_tasks(800, seed=0)
    heldout = sample_tasks(800, seed=0, split="heldout")
    assert not {t.prompt for t in train} & {t.prompt for t in heldout}
    assert all(split_of(t.prompt) == "heldout" for t in heldout)
    assert {t.kind for t in train} == {"add", "subtract", "sort", "convert", "count", "compare"}
    for t in train:  # every answer is right, checked here without the generators' arithmetic
        nums = [int(x) for x in re.findall(r"\d+", t.prompt)]
        said = [int(x) for x in re.findall(r"\d+", t.answer)]
        assert t.reasoning and "<think>" not in t.reasoning and "\n\n" not in t.reasoning
        if t.kind == "add":
            assert t.answer == f"The sum is {nums[0] + nums[1]}."
        elif t.kind == "subtract":
            assert t.answer == f"The difference is {nums[0] - nums[1]}."
        elif t.kind == "sort":
            assert t.answer == ", ".join(map(str, sorted(nums)))
        elif t.kind == "count":
            word = next(w for w in re.findall(r"[a-z]+", t.prompt) if w in WORDS)
            assert t.answer.startswith(f"{word} has {sum(c in 'aeiou' for c in word)} vowel")
        elif t.kind == "compare":
            ask = "larger" if "larger" in t.prompt else "smaller"
            assert t.answer == f"{max(nums) if ask == 'larger' else min(nums)} is {ask}."
        elif t.kind == "convert":
            factor = 1000 if re.search(r"\bk(m|g)\b|kilo", t.prompt) else 60
            if len(said) == 2:  # "3 km = 3000 m"
                assert said == [nums[0], nums[0] * factor]
            else:  # "That is 5 km."
                assert nums == [said[0] * factor]
    with pytest.raises(UsageError, match="split"):
        sample_tasks(1, seed=0, split="test")


@pytest.mark.parametrize("shape", ["sharegpt", "messages"])
def test_write_prompts(tmp_path, shape):
    path = write_prompts(tmp_path / "prompts.jsonl", n=20, seed=7, shape=shape)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 20 and len({r["id"] for r in rows}) == 20
    turns = [r["conversations"] if shape == "sharegpt" else r["messages"] for r in rows]
    role, text = ("from", "value") if shape == "sharegpt" else ("role", "content")
    users = [t[-1] for t in turns]
    assert {u[role] for u in users} == {"human" if shape == "sharegpt" else "user"}
    assert all(split_of(u[text]) == "heldout" for u in users)  # never a training prompt
    assert any(t[0][role] == "system" for t in turns)
    assert write_prompts(tmp_path / "again.jsonl", n=20, seed=7, shape=shape).read_text() == path.read_text()


def test_write_prompts_are_distinct_and_a_too_small_pool_is_a_clear_error(tmp_path, monkeypatch):
    path = write_prompts(tmp_path / "p.jsonl", n=DEMO_SAMPLES, seed=1234)  # the demo's file
    users = [json.loads(line)["conversations"][-1]["value"] for line in path.read_text().splitlines()]
    assert len(users) == DEMO_SAMPLES and len(set(users)) == DEMO_SAMPLES
    fewer = write_prompts(tmp_path / "fewer.jsonl", n=50, seed=1234).read_text().splitlines()
    assert fewer == path.read_text().splitlines()[:50], "a larger n extends the same file"

    few = sample_tasks(3, seed=0, split="heldout")
    monkeypatch.setattr(tiny_build, "sample_tasks", lambda n, seed, split: [few[i % 3] for i in range(n)])
    with pytest.raises(UsageError, match=r"only 3 distinct held-out prompts .* 5 asked for"):
        write_prompts(tmp_path / "five.jsonl", n=5, seed=0)


def test_write_prompts_rejects_unknown_shape(tmp_path):
    with pytest.raises(UsageError, match="shape"):
        write_prompts(tmp_path / "p.jsonl", n=3, seed=0, shape="alpaca")


@pytest.mark.slow
def test_build_is_deterministic_whatever_the_threads(tmp_path, monkeypatch):
    monkeypatch.setattr(tiny_build, "build_threads", lambda own_threads=0: 1)
    a = build_tiny_target(tmp_path / "a", seed=3, steps=3, heldout=0)
    monkeypatch.setattr(tiny_build, "build_threads", lambda own_threads=0: 2)
    b = build_tiny_target(tmp_path / "b", seed=3, steps=3, heldout=0)
    c = build_tiny_target(tmp_path / "c", seed=4, steps=3, heldout=0)
    # the thread count changing as the build goes (every step here: 2, 1, 2, ...) changes nothing either
    flips = iter([2, 1] * 4)
    monkeypatch.setattr(tiny_build, "build_threads", lambda own_threads=0: next(flips))
    monkeypatch.setattr(tiny_build, "THREADS_RECHECK_STEPS", 1)
    d = build_tiny_target(tmp_path / "d", seed=3, steps=3, heldout=0)
    wa, wb, wc, wd = (load_file(folder / "model.safetensors") for folder in (a, b, c, d))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) and torch.equal(wa[k], wd[k]) for k in wa)
    assert not all(torch.equal(wa[k], wc[k]) for k in wa)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    manifest = json.loads((a / "eaglekit_tiny.json").read_text())
    assert manifest["seed"] == 3 and manifest["steps"] == 3
    assert not list(tmp_path.glob(".*"))  # no temp folder left behind
    with pytest.raises(UsageError, match="steps"):
        build_tiny_target(tmp_path / "e", steps=0)


def test_build_threads_leave_a_core_busy_with_other_work_alone(monkeypatch):
    monkeypatch.setattr(tiny_build.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(tiny_build.os, "getloadavg", lambda: (2.0, 2.0, 2.0))
    assert tiny_build.build_threads() == 1  # two busy cores, none of them ours: still one thread
    assert tiny_build.build_threads(own_threads=2) == 2  # the load is the build's own two threads
    assert tiny_build.build_threads(own_threads=1) == 1  # one thread of ours, something else on the other core
    monkeypatch.setattr(tiny_build.os, "getloadavg", lambda: (1.0, 1.0, 1.0))
    assert tiny_build.build_threads(own_threads=1) == 2  # the other core went idle


def finished_build_manifest(out_dir, arch="llama", corpus="tasks"):
    """A stand-in for build_tiny_target that takes no minutes: the folder with the manifest is_built reads, no model."""
    with atomic_dir(out_dir) as tmp:
        manifest = {"recipe_version": tiny_build.RECIPE_VERSION, "steps": tiny_build.DEFAULT_STEPS, "seed": 0}
        write_json(tmp / tiny_build.MANIFEST, manifest | {"arch": arch, "corpus": corpus})
    return out_dir


def test_ensure_builds_once_under_concurrency(tmp_path, monkeypatch):
    calls = []

    def fake_build(out_dir, seed=0, steps=None, arch="llama", corpus="tasks"):
        calls.append(out_dir)
        time.sleep(0.3)  # long enough for the other caller to reach the lock
        return finished_build_manifest(out_dir, arch, corpus)

    monkeypatch.setattr(tiny_build, "build_tiny_target", fake_build)
    results = []
    threads = [threading.Thread(target=lambda: results.append(ensure_tiny_target(tmp_path))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert results == [tmp_path / f"tiny-target-{tiny_build.RECIPE_VERSION}"] * 3
    monkeypatch.setenv("EAGLEKIT_CACHE", str(tmp_path))
    assert ensure_tiny_target() == results[0] and len(calls) == 1  # cached: no second build


def test_chatty_corpus_adds_remarks_to_the_same_tasks():
    plain, chatty = sample_tasks(200, seed=3), sample_tasks(200, seed=3, corpus="chatty")
    assert [(t.prompt, t.answer, t.kind) for t in plain] == [(t.prompt, t.answer, t.kind) for t in chatty]
    remarks = 0
    for p, c in zip(plain, chatty, strict=True):
        extra = [line for line in c.reasoning.split("\n") if line not in p.reasoning.split("\n")]
        # the plain lines stay in order; every added line is a remark with two words of the corpus
        assert [line for line in c.reasoning.split("\n") if line not in extra] == p.reasoning.split("\n")
        for line in extra:
            assert len([w for w in re.findall(r"[a-z]+", line) if w in WORDS]) == 2, line
        remarks += len(extra)
    assert remarks == sum(len(p.reasoning.split("\n")) for p in plain)  # one after every line
    assert len({c.reasoning for c in chatty}) > len({p.reasoning for p in plain})
    assert sample_tasks(50, seed=3, corpus="chatty") == chatty[:50]
    with pytest.raises(UsageError, match="corpus"):
        sample_tasks(1, seed=0, corpus="noisy")


def test_chatty_target_builds_and_caches_apart(tmp_path, monkeypatch):
    built = []

    def fake_build(out_dir, arch="llama", corpus="tasks", **_):
        built.append(corpus)
        return finished_build_manifest(out_dir, arch, corpus)

    monkeypatch.setattr(tiny_build, "build_tiny_target", fake_build)
    plain = ensure_tiny_target(tmp_path)
    chatty = ensure_tiny_target(tmp_path, corpus="chatty")
    assert plain.name == f"tiny-target-{tiny_build.RECIPE_VERSION}"
    assert chatty.name == f"tiny-chatty-{tiny_build.RECIPE_VERSION}"
    assert ensure_tiny_target(tmp_path, corpus="chatty") == chatty and built == ["tasks", "chatty"]
    with pytest.raises(UsageError, match="corpus"):
        ensure_tiny_target(tmp_path, corpus="noisy")


def test_chatty_build_really_trains(tmp_path):
    out = build_tiny_target(tmp_path / "chatty", steps=6, heldout=0, corpus="chatty")
    manifest = json.loads((out / "eaglekit_tiny.json").read_text())
    assert manifest["corpus"] == "chatty" and manifest["steps"] == 6
    tok = AutoTokenizer.from_pretrained(out)
    remark = "Maybe the kiwi likes the castle."
    assert tok.decode(tok(remark, add_special_tokens=False)["input_ids"]) == remark


def test_tiny_target_command_without_a_folder_builds_the_cached_one(cli, tmp_path, monkeypatch):
    built = []

    def fake_build(out_dir, arch="llama", corpus="tasks", **_):
        built.append(out_dir)
        return finished_build_manifest(out_dir, arch, corpus)

    monkeypatch.setattr(tiny_build, "build_tiny_target", fake_build)
    monkeypatch.setenv("EAGLEKIT_CACHE", str(tmp_path))
    result = cli("tiny-target", "--json")
    assert result.code == 0, result.err
    assert json.loads(result.out)["path"] == str(tmp_path / f"tiny-target-{tiny_build.RECIPE_VERSION}")
    assert cli("tiny-target").code == 0 and len(built) == 1  # the second call finds the cached build
    refused = cli("tiny-target", "--seed", "3")
    assert refused.code == 2 and "OUT_DIR" in refused.err and len(built) == 1
