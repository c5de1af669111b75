"""Builds the long-context tiny target: the tiny target's shape and chat template, replies read from 20K back.

Training directly on 16K-token rows is out of reach on 2 CPU cores (a 4K-token row already took ~1.2 s a
step, and attention grows with the square of the length), so the target learns long positions the way PoSE
does (Zhu et al., arXiv 2309.10400): its rows are short logs (~100 to ~900 real tokens) whose position ids
jump forward at random line boundaries, so that a row of 800 tokens spans positions up to ``TRAIN_SPAN``.
Every relative distance up to the span is rehearsed, each line stays contiguous (the jumps fall between
lines, where a real log would have had more lines), RoPE's base is raised (``ROPE_THETA``) so that its
slowest rotations do not wrap inside the span, and one head starts as a name matcher on those rotations
(``init_name_matcher``, which also starts the heads that read the legend under the question). A few rows are
logs of ~3K to ~5K tokens, so that the heads also learn to stay sharp among many keys. Served, the target reads
real 20K-token logs with contiguous positions, which it never saw in training: the manifest's held-out accuracy
by context length, and ``far_context_scores``, measure how well.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import jinja2
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from eaglekit.atomic import write_text
from eaglekit.errors import UsageError
from eaglekit.tiny.build import (
    CHAT_TEMPLATE,
    HIDDEN_SIZE,
    INTERMEDIATE_SIZE,
    MANIFEST,
    build_once,
    build_threads,
    cache_root,
    parse_completion,
    save_target,
    train,
    train_tokenizer,
)
from eaglekit.tiny.long_corpus import NOTE_NAMES, SYSTEM_PROMPT, LongTask, filler_lines, sample_long_tasks

# Bump whenever the corpus, the tokenizer or the training changes: it names the cache folder.
LONG_RECIPE_VERSION = "v6"
MAX_POSITIONS = 32768
# Rows are trained at positions up to here; the rest of MAX_POSITIONS leaves room for a reply after the log.
TRAIN_SPAN = 30000
ROPE_THETA = 1e8
# Share of rows trained at their own contiguous positions (no jumps): short prompts are served that way.
CONTIGUOUS_SHARE = 0.25
# Most position jumps in one row: more jumps rehearse more distances, fewer keep longer stretches contiguous.
MOST_JUMPS = 8
TRAIN_FILLER = (2, 40)  # filler lines of a training log: ~100 to ~900 tokens
# The first rows are short logs at their own positions: the lookup is learned where the needles are near and
# few, then carried to long logs and far positions.
NEAR_SHARE = 0.3
NEAR_FILLER = (0, 3)
# Short rows rehearse far positions but never many keys: a head that finds the token two back among 800 keys
# loses it among 20,000 (the v2 recipe's names did, its decisions did not). A few rows of ~3K to ~5K tokens,
# mixed in after the near rows, train the heads to stay sharp among many keys.
MANY_KEYS_SHARE = 0.08
MANY_KEYS_FILLER = (150, 250)
DEFAULT_LONG_STEPS = 1000
LONG_BATCH_SIZE = 2
LONG_VOCAB_SIZE = 1024
MAX_NEW_TOKENS = 192  # a reply is ~140 tokens
HELDOUT_SEED = 10_000
HELDOUT_PER_GROUP = 4  # held-out prompts per context group that the build answers for its manifest

# Prompt lengths (tokens, about) that put every draft of a reply into one of evaluate's context groups
# (speculative/decode.py CONTEXT_BUCKETS, keyed by its labels): a reply adds ~140 tokens (MAX_NEW_TOKENS at most).
PROMPT_TOKENS = {"<1k": 300, "1-4k": 2500, "4-16k": 9000, ">16k": 20000}


def long_model_config(tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    # the tiny target's shape (8 layers, so the default aux taps are distinct), long positions
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HIDDEN_SIZE // 4,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        rope_theta=ROPE_THETA,  # type: ignore[call-arg]  # transformers 5 takes it through **kwargs, unlisted
        tie_word_embeddings=False,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


# Every decision is a membership test far back: is the reply's " Bravo" mentioned in the log as " bravo"? From a
# random init the build never learned it (2,000 steps at chance on every decision; a random same-token matcher
# as well: over hundreds of tokens its chance matches were as strong as the true one). So the build starts one
# head of layer 0 as a name matcher:
# - each name gets a code, a random unit vector in a NAME_DIMS-wide slice of the embedding that every other
#   token is cleared of; both spellings of a name carry it, and differ by one offset outside the slice;
# - head 0 reads the slice as query and key on RoPE's slowest rotary pairs, whose rotation over TRAIN_SPAN stays
#   small (ROPE_THETA is large for that), so a name matches its other spelling at any distance and no other token.
# " Bravo" then attends to itself and, where the log mentions it, to " bravo", whose value differs by the same
# vector for every name: the decision is readable from the first step.
# The legend's desk is a lookup of two composed heads, which the build did not learn from a random init either
# (its loss held at chance), so init_name_matcher starts them too: layer 0's query head 2 attends the token
# before (PREVIOUS_PAIRS) and writes its name code into a second slice, so that each legend desk carries the code
# of the name before it; layer 1's query head 0 matches a name's code against that slice, which takes the reply's
# " Bravo" to the desk after the legend's " Bravo"; layer 1's query head 2 starts attending the token before too
# (blurred at init: its RMSNorm also sees what layer 0 wrote), to bring the name's decision to the desk after it,
# where the reply asks for it. Training is free to change all of it.
NAME_DIMS = 12  # 6 rotary pairs: at ROPE_THETA 1e8 the slowest turn at most 0.3 rad over TRAIN_SPAN
NAME_CODE_SIZE = 1.0  # the code's norm against the rest of the embedding's
MATCH_LOGIT = 20.0  # a name's attention logit to itself and to its other spelling at init
SPELLING_OFFSET = 2.0  # the spellings' offset, in units of an embedding's own size
CONST_SIZE = 1.0  # the constant coordinate against the rest of an embedding's norm
PREVIOUS_LOGIT = 30.0  # a positional head's logit to the token before at init
PREVIOUS_PAIRS = (0, 1, 2)  # RoPE's fastest pairs (1, 0.32, 0.1 rad a token): together they single out one step back


@torch.no_grad()
def init_name_matcher(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, generator: torch.Generator) -> None:
    """Start the heads of both lookups in a freshly initialised ``model``: the needles' name matcher and the
    legend's circuit (the comment above says how each works)."""
    hidden, head_dim = model.config.hidden_size, HIDDEN_SIZE // 4  # long_model_config's head_dim
    half = head_dim // 2
    slice_ = torch.arange(hidden - NAME_DIMS, hidden)  # the embedding's last NAME_DIMS coordinates
    prev_slice = torch.arange(hidden - 2 * NAME_DIMS, hidden - NAME_DIMS)  # layer 0 writes the code before here
    const = hidden - 2 * NAME_DIMS - 1  # one coordinate every token has alike: what a positional head reads
    embed = model.model.embed_tokens.weight
    scale = embed.norm(dim=1).mean()
    embed[:, slice_] = 0.0
    embed[:, prev_slice] = 0.0
    offset = torch.randn(hidden, generator=generator)
    offset[slice_] = 0.0
    offset[prev_slice] = 0.0
    offset[const] = 0.0
    offset *= SPELLING_OFFSET * scale / offset.norm()
    codes = torch.nn.functional.normalize(torch.randn(len(NOTE_NAMES), NAME_DIMS, generator=generator), dim=1)
    for name, code in zip(NOTE_NAMES, codes, strict=True):
        (logged,) = tokenizer(" " + name, add_special_tokens=False)["input_ids"]
        (replied,) = tokenizer(" " + name.capitalize(), add_special_tokens=False)["input_ids"]
        embed[logged, slice_] = code * NAME_CODE_SIZE * scale
        embed[replied] = embed[logged] - offset
    # the constant coordinate as the same share of every token's norm: after RMSNorm it is the same for all
    embed[:, const] = 0.0
    embed[:, const] = CONST_SIZE * embed.norm(dim=1)
    # after RMSNorm a name's code has norm ~ sqrt(hidden) * share of the code in the embedding's norm
    code_norm = (
        math.sqrt(hidden)
        * NAME_CODE_SIZE
        / math.sqrt((1 + CONST_SIZE**2) * (NAME_CODE_SIZE**2 + 1 + SPELLING_OFFSET**2))
    )
    gain = math.sqrt(MATCH_LOGIT * math.sqrt(head_dim)) / code_norm
    dims = torch.tensor([d for i in range(half - NAME_DIMS // 2, half) for d in (i, i + half)])  # rotate_half pairs

    def read_on_slowest_pairs(weight: torch.Tensor, coordinates: torch.Tensor) -> None:
        """Head 0's rows of a q or k projection read ``coordinates`` on RoPE's slowest pairs, and nothing else."""
        weight[dims] = 0.0
        weight[dims[:, None], coordinates] = torch.eye(NAME_DIMS) * gain

    attn = model.model.layers[0].self_attn
    for proj in (attn.q_proj, attn.k_proj):  # query head 0 and key head 0 (read by query heads 0..groups-1)
        read_on_slowest_pairs(proj.weight, slice_)
    # the legend's circuit (the comment above NAME_DIMS): layer 0's query head 2 (key head 1) writes the code of the
    # token before into prev_slice; layer 1's query head 0 matches a name's code against it; its query head 2
    # attends the token before
    x_const = math.sqrt(hidden) * CONST_SIZE / math.sqrt(CONST_SIZE**2 + 1)  # the constant after RMSNorm, about
    previous_token_head(
        attn.q_proj.weight, attn.k_proj.weight, q_head=2, kv_head=1, const=const, x_const=x_const, theta=ROPE_THETA
    )
    # nothing else of layer 0 writes into the coordinates layer 1's heads read (training may change that)
    reserved = torch.cat([slice_, prev_slice, torch.tensor([const])])
    attn.o_proj.weight[reserved] = 0.0
    model.model.layers[0].mlp.down_proj.weight[reserved] = 0.0
    v_rows = torch.arange(head_dim, head_dim + NAME_DIMS)  # key/value head 1's first NAME_DIMS dims
    attn.v_proj.weight[v_rows] = 0.0
    attn.v_proj.weight[v_rows[:, None], slice_] = torch.eye(NAME_DIMS)
    o_cols = torch.arange(2 * head_dim, 2 * head_dim + NAME_DIMS)  # query head 2's output dims
    attn.o_proj.weight[:, o_cols] = 0.0
    attn.o_proj.weight[prev_slice[:, None], o_cols] = torch.eye(NAME_DIMS) * (scale * NAME_CODE_SIZE / code_norm)
    attn.o_proj.weight[:, torch.arange(3 * head_dim, 3 * head_dim + NAME_DIMS)] = 0.0  # head 3 reads the same values
    attn1 = model.model.layers[1].self_attn
    read_on_slowest_pairs(attn1.q_proj.weight, slice_)
    read_on_slowest_pairs(attn1.k_proj.weight, prev_slice)
    previous_token_head(
        attn1.q_proj.weight, attn1.k_proj.weight, q_head=2, kv_head=1, const=const, x_const=x_const, theta=ROPE_THETA
    )


def previous_token_head(
    q_weight: torch.Tensor, k_weight: torch.Tensor, q_head: int, kv_head: int, const: int, x_const: float, theta: float
) -> None:
    """Start query head ``q_head`` of an attention (its q_proj and k_proj weights) attending the token before: its
    query and key read the constant coordinate on RoPE's fastest pairs, the key turned one step ahead, so that their
    product peaks one position back."""
    head_dim = HIDDEN_SIZE // 4
    half = head_dim // 2
    g = math.sqrt(PREVIOUS_LOGIT * math.sqrt(head_dim) / len(PREVIOUS_PAIRS)) / x_const
    for i in PREVIOUS_PAIRS:
        angle = theta ** (-2 * i / head_dim)
        q_rows = (q_head * head_dim + i, q_head * head_dim + i + half)
        k_rows = (kv_head * head_dim + i, kv_head * head_dim + i + half)
        q_weight[q_rows[0]] = 0.0
        q_weight[q_rows[1]] = 0.0
        q_weight[q_rows[0], const] = g
        k_weight[k_rows[0]] = 0.0
        k_weight[k_rows[1]] = 0.0
        k_weight[k_rows[0], const] = g * math.cos(angle)
        k_weight[k_rows[1], const] = g * math.sin(angle)


def long_conversation(task: LongTask, system: bool, with_answer: bool = True) -> list[dict]:
    messages = [{"role": "system", "content": SYSTEM_PROMPT}] if system else []
    messages.append({"role": "user", "content": task.prompt})
    if with_answer:
        messages.append({"role": "assistant", "content": task.answer, "reasoning_content": task.reasoning})
    return messages


def render(tokenizer: PreTrainedTokenizerFast, task: LongTask, system: bool, prompt_only: bool = False) -> str:
    """The conversation of ``task`` as text: the whole of it, or the prompt up to the assistant turn's header."""
    text = tokenizer.apply_chat_template(
        long_conversation(task, system, with_answer=not prompt_only), tokenize=False, add_generation_prompt=prompt_only
    )
    assert isinstance(text, str)
    return text


def spread_positions(length: int, boundaries: list[int], span: int, rng: random.Random) -> list[int]:
    """Position ids for a row of ``length`` tokens that jump forward at some of ``boundaries`` (token indices)
    so that the last one is ``span - 1``; contiguous where ``span <= length`` or there is no boundary."""
    extra = span - length
    if extra <= 0 or not boundaries:
        return list(range(length))
    jumps = sorted(rng.sample(boundaries, min(len(boundaries), rng.randint(1, MOST_JUMPS))))
    cuts = sorted(rng.randint(0, extra) for _ in range(len(jumps) - 1))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, extra], strict=True)]
    shift, positions, at = 0, [], 0
    for jump, size in zip(jumps, sizes, strict=True):
        positions += [i + shift for i in range(at, jump)]
        shift, at = shift + size, jump
    positions += [i + shift for i in range(at, length)]
    return positions


def encode_long(
    tokenizer: PreTrainedTokenizerFast, tasks: list[LongTask], rng: random.Random, spread: bool = True
) -> list[tuple[list[int], int, list[int]]]:
    """(token ids, where the assistant turn starts, position ids) of each task's conversation; PoSE jumps
    (module docstring) at the starts of log lines unless ``spread`` is off."""
    rows = []
    for task in tasks:
        system = rng.random() < 0.5
        text = render(tokenizer, task, system)
        prompt = render(tokenizer, task, system, prompt_only=True)
        assert text.startswith(prompt), "the chat template must render the prompt as a prefix of the conversation"
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        start = next(i for i, (a, _) in enumerate(offsets) if a >= len(prompt))
        # the character where each log line after the first starts, then the first token at or after it
        doc_at = text.index(task.document)
        line_starts, at = [], doc_at
        for line in task.document.split("\n")[:-1]:
            at += len(line) + 1
            line_starts.append(at)
        tokens_at = [next(i for i, (a, _) in enumerate(offsets) if a >= c) for c in line_starts]
        span = len(ids)
        if spread and rng.random() >= CONTIGUOUS_SHARE:
            span = round(math.exp(rng.uniform(math.log(len(ids)), math.log(TRAIN_SPAN))))
        rows.append((ids, start, spread_positions(len(ids), tokens_at, span, rng)))
    return rows


def batches_in_order(rows: list, rng: random.Random, pool: int = 32) -> list[list]:
    """Batches of LONG_BATCH_SIZE rows of similar length (little padding) that keep the rows' order at the scale
    of ``pool`` rows: the curriculum (NEAR_SHARE) survives."""
    out = []
    for at in range(0, len(rows), pool):
        chunk = sorted(rows[at : at + pool], key=lambda r: len(r[0]))
        group = [chunk[i : i + LONG_BATCH_SIZE] for i in range(0, len(chunk), LONG_BATCH_SIZE)]
        rng.shuffle(group)
        out += group
    return out


def batch_inputs(batch: list[tuple[list[int], int, list[int]]], pad_id: int) -> dict:
    width = max(len(ids) for ids, _, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id)
    labels = torch.full((len(batch), width), -100)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    positions = torch.zeros((len(batch), width), dtype=torch.long)
    for i, (ids, start, pos) in enumerate(batch):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, start : len(ids)] = torch.tensor(ids[start:])
        mask[i, : len(ids)] = 1
        positions[i, : len(ids)] = torch.tensor(pos)
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask, "position_ids": positions}


def prompt_ids(tokenizer, task: LongTask, system: bool = False) -> list[int]:
    return tokenizer(render(tokenizer, task, system, prompt_only=True), add_special_tokens=False)["input_ids"]


def heldout_long_tasks(n: int, label: str, seed: int = HELDOUT_SEED) -> list[LongTask]:
    """``n`` held-out tasks whose prompts fall in context group ``label`` (PROMPT_TOKENS)."""
    lines = filler_lines(PROMPT_TOKENS[label])
    return sample_long_tasks(n, seed, (lines * 9 // 10, lines), split="heldout")


@torch.no_grad()
def greedy_reply(model, tokenizer, task: LongTask) -> str:
    ids = torch.tensor([prompt_ids(tokenizer, task)])
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW_TOKENS, do_sample=False
    )
    return tokenizer.decode(out[0, ids.shape[1] :])


def is_right(text: str, task: LongTask) -> bool:
    parsed = parse_completion(text)
    return parsed is not None and parsed == (task.reasoning, task.answer)


@torch.no_grad()
def reply_token_agreement(model, tokenizer, task: LongTask) -> tuple[float, float]:
    """Shares of the reference reply's tokens, and of its yes/no decisions alone, that are the target's greedy
    next token, fed the reference so far."""
    prompt = prompt_ids(tokenizer, task)
    full = tokenizer(render(tokenizer, task, system=False), add_special_tokens=False)["input_ids"]
    reply = torch.tensor(full[len(prompt) :])
    logits = model(input_ids=torch.tensor([full])).logits[0, len(prompt) - 1 : -1]
    agree = logits.argmax(-1) == reply
    decisions = torch.isin(reply, torch.tensor(tokenizer([" yes", " no"], add_special_tokens=False)["input_ids"]))
    return float(agree.float().mean()), float(agree[decisions].float().mean())


def heldout_long_scores(model, tokenizer, per_group: int, seed: int = HELDOUT_SEED) -> dict:
    """Greedy replies to ``per_group`` held-out prompts of each context group: the share answered right."""
    by_group = {}
    for label in PROMPT_TOKENS:
        tasks = heldout_long_tasks(per_group, label, seed)
        by_group[label] = round(sum(is_right(greedy_reply(model, tokenizer, t), t) for t in tasks) / per_group, 3)
    return {"heldout_prompts_per_group": per_group, "accuracy_by_context": by_group}


def far_context_scores(model, tokenizer, n: int, label: str = ">16k", seed: int = HELDOUT_SEED) -> dict:
    """Whether the target reads the far context: on ``n`` held-out prompts of group ``label``, greedy accuracy
    (the whole reply right) and agreement with the reference reply token by token and on its decisions alone
    (``reply_token_agreement``), as written and with every needle line replaced by filler (same length, the
    far material gone)."""
    tasks = heldout_long_tasks(n, label, seed)
    blind = [t.without_needles(random.Random(f"blind/{i}")) for i, t in enumerate(tasks)]

    def scores(ts: list[LongTask]) -> dict:
        right = sum(is_right(greedy_reply(model, tokenizer, t), ref) for t, ref in zip(ts, tasks, strict=True))
        agree = [reply_token_agreement(model, tokenizer, t) for t in ts]
        return {
            "accuracy": round(right / n, 3),
            "reply_token_agreement": round(sum(a for a, _ in agree) / n, 3),
            "decision_agreement": round(sum(d for _, d in agree) / n, 3),
        }

    lengths = [len(prompt_ids(tokenizer, t)) for t in tasks]
    return {
        "group": label,
        "prompts": n,
        "mean_prompt_tokens": round(sum(lengths) / n),
        "with_far_context": scores(tasks),
        "far_context_removed": scores(blind),
    }


def build_long_target(out_dir: Path, seed: int = 0, steps: int | None = None, heldout: int | None = None) -> Path:
    """Train the long-context tiny target from ``seed`` and write it to ``out_dir`` atomically; returns ``out_dir``.

    ``heldout`` prompts per context group are answered greedily after training, for the manifest (0 skips that)."""
    steps = DEFAULT_LONG_STEPS if steps is None else steps
    heldout = HELDOUT_PER_GROUP if heldout is None else heldout
    if steps < 1:
        raise UsageError(
            f"steps={steps}: the long tiny target needs at least one training step", "pass steps >= 1 or leave it unset"
        )
    out_dir = Path(out_dir)
    t0 = time.monotonic()
    rng = random.Random(seed)
    template = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(CHAT_TEMPLATE)
    tokenizer = train_tokenizer(
        [
            template.render(messages=long_conversation(t, system=i % 2 == 0))
            for i, t in enumerate(sample_long_tasks(300, seed, TRAIN_FILLER))
        ],
        vocab_size=LONG_VOCAB_SIZE,
        model_max_length=MAX_POSITIONS,
    )
    near = round(NEAR_SHARE * steps) * LONG_BATCH_SIZE
    rows = encode_long(tokenizer, sample_long_tasks(near, seed, NEAR_FILLER), rng, spread=False)
    many = round(MANY_KEYS_SHARE * steps) * LONG_BATCH_SIZE
    later = encode_long(
        tokenizer, sample_long_tasks(steps * LONG_BATCH_SIZE - near - many, seed + 1, TRAIN_FILLER), rng
    )
    later += encode_long(tokenizer, sample_long_tasks(many, seed + 2, MANY_KEYS_FILLER), rng)
    rng.shuffle(later)
    rows += later
    batches = batches_in_order(rows, rng)
    caller_threads = torch.get_num_threads()
    torch.set_num_threads(build_threads())
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(long_model_config(tokenizer))
            init_name_matcher(model, tokenizer, torch.Generator().manual_seed(seed))
            model.generation_config = GenerationConfig(
                bos_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
                do_sample=False,
            )
            pad = tokenizer.pad_token_id
            final_loss = train(model, batches, pad, lambda batch: batch_inputs(batch, pad))
        train_seconds = time.monotonic() - t0
        scores = heldout_long_scores(model, tokenizer, heldout) if heldout else {}
        threads_used = torch.get_num_threads()
    finally:
        torch.set_num_threads(caller_threads)
    build_seconds = time.monotonic() - t0
    save_target(
        out_dir,
        model,
        tokenizer,
        {
            "recipe_version": LONG_RECIPE_VERSION,
            "variant": "long",
            "arch": "llama",
            "seed": seed,
            "steps": steps,
            "batch_size": LONG_BATCH_SIZE,
            "train_span": TRAIN_SPAN,
            "final_loss": round(final_loss, 4),
            "train_seconds": round(train_seconds, 1),
            "build_seconds": round(build_seconds, 1),
            "torch_threads": threads_used,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            **scores,
        },
    )
    return out_dir


def cached_long_target_dir(cache_dir: Path | None = None) -> Path:
    return cache_root(cache_dir) / f"tiny-long-{LONG_RECIPE_VERSION}"


def is_long_built(model_dir: Path) -> bool:
    try:
        manifest = json.loads((model_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return (
        manifest.get("variant") == "long"
        and manifest.get("recipe_version") == LONG_RECIPE_VERSION
        and manifest.get("steps") == DEFAULT_LONG_STEPS
        and manifest.get("seed") == 0
    )


def ensure_long_target(cache_dir: Path | None = None) -> Path:
    """The cached long-context tiny target (``cache_root()/tiny-long-<version>``), built on first use."""
    model_dir = cached_long_target_dir(cache_dir)
    return build_once(model_dir, lambda: is_long_built(model_dir), lambda: build_long_target(model_dir))


def write_long_prompts(path: Path, n: int, seed: int, context: str, shape: str = "sharegpt") -> Path:
    """Write ``n`` held-out long prompts whose replies fall in evaluate's context group ``context`` (a key of
    PROMPT_TOKENS) as JSONL, like ``write_prompts``; every other row has a system turn."""
    if context not in PROMPT_TOKENS:
        raise UsageError(f"write_long_prompts: unknown context group {context!r}", f"use one of {list(PROMPT_TOKENS)}")
    if shape not in ("sharegpt", "messages"):
        raise UsageError(f"write_long_prompts: unknown shape {shape!r}", "use shape='sharegpt' or shape='messages'")
    rows = []
    for i, task in enumerate(heldout_long_tasks(n, context, seed)):
        turns = [("system", SYSTEM_PROMPT)] if i % 2 else []
        turns.append(("user", task.prompt))
        row_id = f"tiny-long-{context}-{seed}-{i:05d}"
        if shape == "sharegpt":
            rows.append(
                {"id": row_id, "conversations": [{"from": "human" if r == "user" else r, "value": c} for r, c in turns]}
            )
        else:
            rows.append({"id": row_id, "messages": [{"role": r, "content": c} for r, c in turns]})
    write_text(path, "".join(json.dumps(row) + "\n" for row in rows))
    return Path(path)
