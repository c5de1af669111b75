"""The long-context tiny target: logs whose replies check names against far-back needles, PoSE positions, prompt sets per context
group, and a scaled-down build (a few steps) that loads like any HF model and is cached apart from the tiny target."""

from __future__ import annotations

import json
import random
import re
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

import eaglekit.tiny.long_build as long_build
from eaglekit.errors import UsageError
from eaglekit.speculative.decode import CONTEXT_BUCKETS, context_bucket
from eaglekit.tiny import build_long_target, ensure_long_target, sample_long_tasks, split_of, write_long_prompts
from eaglekit.tiny.long_corpus import DESKS, NEEDLE_WORDS, NOTE_NAMES, needle_text, reply_token_role

WORD = re.compile(r"[a-z]+")


def test_every_decision_of_a_reply_is_settled_by_needles_in_the_first_half_of_the_log():
    tasks = sample_long_tasks(40, seed=5, filler=(30, 60))
    assert {t.kind for t in tasks} == {"list", "notes"}
    for task in tasks:
        assert len(task.lines) >= 30 and all(line.startswith(f"[{i:05d}] ") for i, line in enumerate(task.lines))
        assert task.needle_lines and max(task.needle_lines) < len(task.lines) // 2 + len(task.needle_lines)
        named = [set(WORD.findall(line)) & set(NOTE_NAMES) for line in task.lines]
        # code names occur on needle lines only, each at most once in the log
        assert all(not names for i, names in enumerate(named) if i not in task.needle_lines)
        present = [name for names in named for name in names]
        assert len(present) == len(set(present)) >= 1
        # the legend under the question gives every name, in order and spelled as the reply spells it, one desk
        legend = task.question.split("\nDesk list: ")[1].rstrip(".").split(", ")
        assert [entry.split()[0] for entry in legend] == [name.capitalize() for name in NOTE_NAMES]
        desks = [entry.split()[1] for entry in legend]
        assert set(desks) <= set(DESKS)
        checks = task.reasoning.split("\n")[1:]
        assert checks == [
            f" {name.capitalize()} {desk} {'yes' if name in present else 'no'}"
            for name, desk in zip(NOTE_NAMES, desks, strict=True)
        ]
        assert not set(WORD.findall(task.question)) & set(NOTE_NAMES)  # the question spells names as the reply does
        assert task.prompt.endswith(task.question) and task.prompt.count("\n") == len(task.lines) + 3
    # both answers are common: a decision cannot be guessed from its name
    decisions = [line.split()[2] for t in tasks for line in t.reasoning.split("\n")[1:]]
    assert 0.35 < decisions.count("yes") / len(decisions) < 0.65


def test_removing_the_needles_keeps_the_length_and_leaves_every_decision_unsettled():
    task = sample_long_tasks(2, seed=2, filler=(40, 40))[1]
    blind = task.without_needles(random.Random(0))
    assert len(blind.lines) == len(task.lines) and blind.question == task.question
    assert not set(WORD.findall(blind.document)) & set(NOTE_NAMES + NEEDLE_WORDS)
    assert [a for a, b in zip(task.lines, blind.lines, strict=True) if a != b] == [
        task.lines[i] for i in task.needle_lines
    ]


def test_long_tasks_are_deterministic_and_the_splits_disjoint():
    assert sample_long_tasks(10, seed=1, filler=(5, 9)) == sample_long_tasks(10, seed=1, filler=(5, 9))
    assert sample_long_tasks(10, seed=1, filler=(5, 9)) != sample_long_tasks(10, seed=2, filler=(5, 9))
    train = sample_long_tasks(60, seed=0, filler=(4, 8))
    heldout = sample_long_tasks(60, seed=0, filler=(4, 8), split="heldout")
    assert {split_of(needle_text(t)) for t in train} == {"train"}
    assert {split_of(needle_text(t)) for t in heldout} == {"heldout"}
    with pytest.raises(UsageError, match="filler"):
        sample_long_tasks(1, seed=0, filler=(9, 3))


def test_spread_positions_jump_only_at_boundaries_up_to_the_span():
    rng = random.Random(0)
    boundaries = [10, 25, 40, 70, 90]
    for span in [100, 101, 5000, 30000]:
        pos = long_build.spread_positions(100, boundaries, span, rng)
        assert len(pos) == 100 and pos[0] == 0 and pos[-1] == max(span, 100) - 1
        steps = [b - a for a, b in zip(pos, pos[1:], strict=False)]
        assert all(s >= 1 for s in steps)
        assert {i + 1 for i, s in enumerate(steps) if s > 1} <= set(boundaries)
    assert long_build.spread_positions(50, [], 9000, rng) == list(range(50))


@pytest.fixture(scope="module")
def small_build(tmp_path_factory):
    """The long target's recipe for 4 steps (its tokenizer is the full build's: it does not depend on steps)."""
    return build_long_target(tmp_path_factory.mktemp("long") / "target", steps=4, heldout=0)


def test_scaled_down_build_loads_like_any_hf_model_with_long_positions(small_build):
    model = AutoModelForCausalLM.from_pretrained(small_build)
    tok = AutoTokenizer.from_pretrained(small_build)
    cfg = model.config
    assert cfg.max_position_embeddings == long_build.MAX_POSITIONS >= 16384
    assert cfg.rope_parameters["rope_theta"] == long_build.ROPE_THETA
    assert cfg.num_hidden_layers == 8 and cfg.tie_word_embeddings is False
    assert cfg.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>") == model.generation_config.eos_token_id
    assert tok.model_max_length == long_build.MAX_POSITIONS
    for special in ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>"]:
        assert len(tok(special, add_special_tokens=False)["input_ids"]) == 1, special
    # both spellings of every name are one token each: a decision is one lookup
    spellings = NOTE_NAMES + [name.capitalize() for name in NOTE_NAMES]
    assert all(len(tok(" " + w, add_special_tokens=False)["input_ids"]) == 1 for w in spellings)
    manifest = json.loads((small_build / "eaglekit_tiny.json").read_text())
    assert manifest["variant"] == "long" and manifest["steps"] == 4 and manifest["train_span"] == 30000
    with torch.no_grad():  # the far end of the positions runs (RoPE tables cover it) and gives finite logits
        logits = model(input_ids=torch.tensor([[5, 6]]), position_ids=torch.tensor([[32000, 32767]])).logits
    assert torch.isfinite(logits).all()


def test_every_token_of_the_checks_has_its_role(small_build):
    """benchmarks/long_context_misses.py counts a drafter's misses by the role of the reply token: each check line
    is a name, its desk, a decision, and the line break before the next line."""
    tok = AutoTokenizer.from_pretrained(small_build)
    task = sample_long_tasks(1, seed=3, filler=(2, 4))[0]
    checks = task.reasoning.split("\n", 1)[1]
    roles = Counter(reply_token_role(tok.decode([i])) for i in tok(checks, add_special_tokens=False)["input_ids"])
    n = len(NOTE_NAMES)
    assert roles == {"name": n, "desk": n, "decision": n, "separator": n - 1}


def started_model(tok) -> LlamaForCausalLM:
    """A fresh long target with its lookup heads started (init_name_matcher), before any training; eager attention,
    whose weights the tests read."""
    config = long_build.long_model_config(tok)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    long_build.init_name_matcher(model, tok, torch.Generator().manual_seed(0))
    return model


def test_the_name_matcher_finds_a_mention_20k_positions_back_and_nothing_else(small_build):
    """At init, before any training: layer 0's head 0 takes a reply's " Bravo" to the log's " bravo" wherever it
    is, and to itself when the log does not mention it (from a random init the build never learned this)."""
    tok = AutoTokenizer.from_pretrained(small_build)
    model = started_model(tok)

    def attention(text: str, far: int) -> tuple[list[str], torch.Tensor]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        positions = list(range(3)) + [far + i for i in range(len(ids) - 3)]  # the log's first 3 tokens 20K back
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions]), output_attentions=True)
        return tok.convert_ids_to_tokens(ids), out.attentions[0][0, 0, -1]

    filler = " cache miss key shard worker job retry disk read write" * 20
    tokens, weights = attention(" on call bravo" + filler + "\n Bravo", far=20_000)
    assert tokens[2] == "Ġbravo" and weights[2] > 0.9
    tokens, weights = attention(" on call kilo" + filler + "\n Bravo", far=20_000)
    assert weights[-1] > 0.9 and weights[2] < 0.01  # not mentioned: itself, not another name


def test_the_legend_heads_find_the_desk_after_a_name_20k_positions_on(small_build):
    """At init: layer 0's query head 2 attends the token before, everywhere; layer 1's query head 0 takes a
    reply's " Bravo" to the desk after " Bravo" in the legend (from a random init the build's loss held at chance
    on the desks). Layer 1's positional head starts blurred, as its RMSNorm also sees what layer 0 wrote: the
    build sharpens it."""
    tok = AutoTokenizer.from_pretrained(small_build)
    model = started_model(tok)
    filler = " cache miss key shard worker job retry disk read write" * 8
    text = "Desk list: Alpha north, Bravo south, Charlie east, Delta west." + filler + "\n Alpha north no\n Bravo"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor([ids]),
            position_ids=torch.arange(20_000, 20_000 + len(ids))[None],
            output_attentions=True,
        )
    tokens = tok.convert_ids_to_tokens(ids)
    before = out.attentions[0][0, 2].diagonal(offset=-1)  # each query's weight on the token before
    assert before.min() > 0.9
    desk = tokens.index("ĠBravo") + 1
    assert tokens[desk] == "Ġsouth"
    weights = out.attentions[1][0, 0, -1]
    assert weights.argmax() == desk and weights[desk] > 0.5


def test_training_rows_jump_between_log_lines_and_keep_the_reply_contiguous(small_build):
    tok = AutoTokenizer.from_pretrained(small_build)
    tasks = sample_long_tasks(24, seed=0, filler=long_build.TRAIN_FILLER)
    rows = long_build.encode_long(tok, tasks, random.Random(0))
    spans = []
    for (ids, start, pos), task in zip(rows, tasks, strict=True):
        assert tok.decode(ids[start:]).startswith("<think>\n" + task.reasoning.split("\n")[0])
        assert pos[start:] == list(range(pos[start], pos[start] + len(ids) - start))
        assert pos[-1] < long_build.MAX_POSITIONS and len(pos) == len(ids)
        for i in (i for i in range(1, len(ids)) if pos[i] - pos[i - 1] > 1):
            assert tok.decode(ids[i - 1 : i + 1]).startswith("\n") or tok.decode(ids[i])[0] == "["
        spans.append(pos[-1] + 1)
    # some rows contiguous, most spread far beyond their length
    assert any(s == len(r[0]) for s, r in zip(spans, rows, strict=True)) and max(spans) > 8 * max(
        len(r[0]) for r in rows
    )


def test_prompt_sets_fill_every_context_group(small_build, tmp_path):
    tok = AutoTokenizer.from_pretrained(small_build)
    bounds = dict(CONTEXT_BUCKETS)
    labels = [label for label, _ in CONTEXT_BUCKETS]
    assert list(long_build.PROMPT_TOKENS) == labels
    for label in labels:
        path = write_long_prompts(tmp_path / f"{label}.jsonl", 3, seed=0, context=label)
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert len({r["id"] for r in rows}) == 3 and len({r["conversations"][-1]["value"] for r in rows}) == 3
        assert [r["conversations"][0]["from"] for r in rows] == ["human", "system", "human"]
        for row in rows:
            messages = [
                {"role": "user" if c["from"] == "human" else c["from"], "content": c["value"]}
                for c in row["conversations"]
            ]
            n = len(
                tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
                    "input_ids"
                ]
            )
            # every draft of the reply, from its first token to its longest, starts in this group
            assert context_bucket(n) == label and context_bucket(n + long_build.MAX_NEW_TOKENS) == label, (label, n)
            assert bounds[label] is not None or n + long_build.MAX_NEW_TOKENS < long_build.MAX_POSITIONS
    messages = write_long_prompts(tmp_path / "m.jsonl", 1, seed=0, context="<1k", shape="messages")
    assert json.loads(messages.read_text())["messages"][0]["role"] == "user"
    with pytest.raises(UsageError, match="context group"):
        write_long_prompts(tmp_path / "x.jsonl", 1, seed=0, context="8k")


def test_far_context_scores_run_on_a_scaled_down_target(small_build, monkeypatch):
    monkeypatch.setitem(long_build.PROMPT_TOKENS, ">16k", 400)  # a short "far" group: an untrained model, seconds
    monkeypatch.setattr(long_build, "MAX_NEW_TOKENS", 8)
    model = AutoModelForCausalLM.from_pretrained(small_build)
    tok = AutoTokenizer.from_pretrained(small_build)
    scores = long_build.far_context_scores(model, tok, 2)
    assert scores["prompts"] == 2 and 300 < scores["mean_prompt_tokens"] < 700
    for key in ("with_far_context", "far_context_removed"):
        assert 0 <= scores[key]["reply_token_agreement"] <= 1 and 0 <= scores[key]["decision_agreement"] <= 1
        assert scores[key]["accuracy"] == 0  # 4 steps: no reply is right yet


def test_ensure_long_target_builds_once_in_its_own_folder(tmp_path, monkeypatch):
    built = []

    def fake_build(out_dir, **_):
        built.append(out_dir)
        return build_long_target(out_dir, steps=2, heldout=0)

    monkeypatch.setattr(long_build, "build_long_target", fake_build)
    monkeypatch.setattr(long_build, "DEFAULT_LONG_STEPS", 2)
    path = ensure_long_target(tmp_path)
    assert path == tmp_path / f"tiny-long-{long_build.LONG_RECIPE_VERSION}" and built == [path]
    assert ensure_long_target(tmp_path) == path and len(built) == 1  # cached
    assert not (tmp_path / "tiny-target-v2").exists()
    monkeypatch.setattr(long_build, "LONG_RECIPE_VERSION", "v999")  # another recipe is another folder, rebuilt
    assert ensure_long_target(tmp_path).name == "tiny-long-v999" and len(built) == 2


def test_tiny_target_command_takes_long(cli, tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr(long_build, "build_long_target", lambda out_dir, **kw: built.append((out_dir, kw)) or out_dir)
    monkeypatch.setattr(long_build, "is_long_built", lambda _: False)
    import eaglekit.tiny as tiny

    monkeypatch.setattr(tiny, "build_long_target", long_build.build_long_target)
    monkeypatch.setenv("EAGLEKIT_CACHE", str(tmp_path))
    result = cli("tiny-target", "--long", "--json")
    assert result.code == 0, result.err
    assert json.loads(result.out)["path"] == str(tmp_path / f"tiny-long-{long_build.LONG_RECIPE_VERSION}")
    result = cli("tiny-target", "--long", str(tmp_path / "mine"), "--seed", "3")
    assert result.code == 0, result.err
    assert built[-1] == (tmp_path / "mine", {"seed": 3})
    refused = cli("tiny-target", "--long", "--seed", "3")
    assert refused.code == 2 and "long-context" in refused.err and "OUT_DIR" in refused.err
