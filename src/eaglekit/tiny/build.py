"""Builds the tiny target: a real, trained Llama that thinks in ``<think>`` tags, in about three minutes on 2 CPU cores.

The demo and the tests need a target model that loads like any Hugging Face model, speaks a Qwen3-style
chat template and produces reasoning regular enough for a drafter to learn. Nothing can be downloaded,
so we train one: a byte-level BPE tokenizer and an 8-layer Llama fitted to the programmatic corpus in
``corpus.py``. The build is deterministic from its seed and is cached once per machine (and per recipe
version) by ``ensure_tiny_target``.

``arch="deepseek_v3"`` builds the same target DeepSeek-V3-shaped instead: multi-head latent attention and a
mixture of experts (the MLA drafter's natural target). Its latent is 512 + 64 wide because that is the only
shape vLLM's CPU MLA kernel runs (``v1/attention/backends/mla/cpu_mla.py``, ``get_supported_head_sizes``).
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import random
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import jinja2
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from eaglekit.atomic import atomic_dir, write_json, write_text
from eaglekit.errors import UsageError
from eaglekit.progress import Meter
from eaglekit.tiny.corpus import CORPORA, SYSTEM_PROMPTS, Corpus, Task, sample_tasks

# Bump whenever the corpus, the tokenizer or the training changes: it names the cache folder.
RECIPE_VERSION = "v2"
MANIFEST = "eaglekit_tiny.json"
# Held-out accuracy by steps (seed 0): 2400 -> 43%, 3200 -> 59%, 4000 -> 71% (the counting sort is only
# learned past 3200 steps). 4000 steps take ~170 s on two idle cores.
DEFAULT_STEPS = 4000
# Small batches, many steps: at a fixed budget of tokens the tiny model learned far more from more
# updates (batches of 4 x 3600 steps: 37% of held-out answers right; 16 x 900 steps: 12%).
BATCH_SIZE = 4
# How often the build re-decides its thread count (build_threads), in steps: ~20 s of training
THREADS_RECHECK_STEPS = 100
LEARNING_RATE = 2e-3
VOCAB_SIZE = 512
HIDDEN_SIZE = 128
INTERMEDIATE_SIZE = 256
HELDOUT_SEED = 10_000  # held-out prompts come from another split *and* another seed stream
MAX_NEW_TOKENS = 256

IM_START, IM_END, PAD, THINK, END_THINK = "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>"

# Qwen3's layout without its tool-calling branches: the reasoning of an assistant turn goes inside
# <think> tags before the answer; an assistant turn without reasoning is rendered as is.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.reasoning_content is defined and message.reasoning_content is not none %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# a finished completion; batched generation pads the rows that finish early with <|endoftext|>
COMPLETION = re.compile(r"<think>\n(.+?)\n</think>\n\n(.+?)<\|im_end\|>(?:<\|endoftext\|>)*\n?", re.DOTALL)


ARCHITECTURES = ("llama", "deepseek_v3")


def model_config(tokenizer: PreTrainedTokenizerFast, arch: str = "llama") -> LlamaConfig | DeepseekV3Config:
    # 8 layers so that the default aux taps [2, N//2, N-3] = [2, 4, 5] are distinct layers
    if arch == "deepseek_v3":
        # MLA + routed experts (4, two per token, one shared), the first layer dense as in DeepSeek-V3; the router
        # fields vLLM reads (noaux_tc: the gate has an e_score_correction_bias) are DeepSeek-V3's.
        # transformers 5's typed signature omits the keys it still takes through **kwargs (rope_theta,
        # topk_method, scoring_func): hence the ignore.
        return DeepseekV3Config(  # type: ignore[call-arg]
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=8,
            num_attention_heads=2,
            num_key_value_heads=2,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=32,
            kv_lora_rank=512,
            qk_nope_head_dim=16,
            qk_rope_head_dim=64,
            v_head_dim=16,
            max_position_embeddings=1024,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            tie_word_embeddings=False,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            bos_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    if arch != "llama":
        raise UsageError(f"unknown tiny target architecture {arch!r}", f"use one of {list(ARCHITECTURES)}")
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HIDDEN_SIZE // 4,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,  # type: ignore[call-arg]  # transformers 5 takes it through **kwargs, unlisted
        tie_word_embeddings=False,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def conversation(task: Task, system: str | None = None, with_answer: bool = True) -> list[dict]:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": task.prompt})
    if with_answer:
        messages.append({"role": "assistant", "content": task.answer, "reasoning_content": task.reasoning})
    return messages


def train_tokenizer(
    texts: list[str], vocab_size: int = VOCAB_SIZE, model_max_length: int = 1024
) -> PreTrainedTokenizerFast:
    """Byte-level BPE (any text encodes) where every digit is one token of its own, so arithmetic is learnable."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[PAD, IM_START, IM_END],
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    # Like Qwen3, the think tags are single tokens but not "special": decoding keeps them in the text.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (THINK, END_THINK)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=PAD, model_max_length=model_max_length
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def encode(tokenizer: PreTrainedTokenizerFast, tasks: list[Task], rng: random.Random) -> list[tuple[list[int], int]]:
    """Token ids of each full conversation and where its assistant turn starts (the loss covers only that)."""
    systems = [rng.choice(SYSTEM_PROMPTS) if rng.random() < 0.25 else None for _ in tasks]
    full = tokenizer.apply_chat_template(
        [conversation(t, s) for t, s in zip(tasks, systems, strict=False)], tokenize=False
    )
    prompts = tokenizer.apply_chat_template(
        [conversation(t, s, with_answer=False) for t, s in zip(tasks, systems, strict=False)],
        tokenize=False,
        add_generation_prompt=True,
    )
    full_ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    for f, p in zip(full_ids, prompt_ids, strict=False):
        assert f[: len(p)] == p, "the chat template must render the prompt as a prefix of the conversation"
    return [(f, len(p)) for f, p in zip(full_ids, prompt_ids, strict=False)]


def batch_tensors(rows: list[tuple[list[int], int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, start) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, start : len(ids)] = torch.tensor(ids[start:])
        mask[i, : len(ids)] = 1
    return input_ids, labels, mask


def batches(rows: list[tuple[list[int], int]], rng: random.Random) -> list[list[tuple[list[int], int]]]:
    """Batches of rows of similar length (little padding), in random order."""
    out = []
    for pool in range(0, len(rows), BATCH_SIZE * 16):
        chunk = sorted(rows[pool : pool + BATCH_SIZE * 16], key=lambda r: len(r[0]))
        out += [chunk[i : i + BATCH_SIZE] for i in range(0, len(chunk), BATCH_SIZE)]
    rng.shuffle(out)
    return out


def train(model, batches: list, pad_id: int, model_inputs: Callable[[list], dict] | None = None) -> float:
    """AdamW with warmup and cosine decay, one step per batch; returns the mean loss of the last tenth of the steps.

    ``model_inputs``: the model's keyword arguments for a batch (labels included); left out, ``batches`` hold
    (ids, assistant start) rows and ``batch_tensors`` pads them."""
    steps = len(batches)
    opt = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.95), weight_decay=0.01, fused=True)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * s / steps)))
    )
    tail: list[float] = []
    model.train()
    with Meter("tiny target: train", total=steps, unit="step", log_every=10.0) as meter:
        for step in range(steps):
            if step and step % THREADS_RECHECK_STEPS == 0:
                # the build often starts beside other work (setup, test workers) that ends before it does
                torch.set_num_threads(build_threads(own_threads=torch.get_num_threads()))
            if model_inputs is None:
                input_ids, labels, mask = batch_tensors(batches[step], pad_id)
                loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
            else:
                loss = model(**model_inputs(batches[step])).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if step >= steps - max(1, steps // 10):
                tail.append(loss.item())
            meter.update(1, loss=loss.item())
    model.eval()
    return sum(tail) / len(tail)


def parse_completion(text: str) -> tuple[str, str] | None:
    """(reasoning, answer) from a completion shaped ``<think>\\n...\\n</think>\\n\\nanswer<|im_end|>``, else None."""
    m = COMPLETION.fullmatch(text)
    return (m.group(1), m.group(2)) if m else None


@torch.no_grad()
def heldout_scores(model, tokenizer, n: int, seed: int = HELDOUT_SEED) -> dict:
    """Greedy completions of ``n`` held-out prompts: the share that is well formed and the share answered right."""
    tasks = sample_tasks(n, seed, split="heldout")
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # generation continues from the end of every row
    try:
        enc = tokenizer.apply_chat_template(
            [conversation(t, with_answer=False) for t in tasks],
            add_generation_prompt=True,
            padding=True,
            return_tensors="pt",
            return_dict=True,
        )
    finally:
        tokenizer.padding_side = side
    out = model.generate(**enc, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :])
    parsed = [parse_completion(t) for t in texts]
    right = [p is not None and p[1] == t.answer for p, t in zip(parsed, tasks, strict=False)]
    kinds = sorted({t.kind for t in tasks})
    return {
        "heldout_prompts": n,
        "well_formed": sum(p is not None for p in parsed) / n,
        "accuracy": sum(right) / n,
        "accuracy_by_kind": {
            k: round(
                sum(r for r, t in zip(right, tasks, strict=False) if t.kind == k) / sum(t.kind == k for t in tasks), 3
            )
            for k in kinds
        },
    }


def build_threads(own_threads: int = 0) -> int:
    """Threads for training: one per idle core, at most two, at least one (whatever the caller set).

    The matrices are tiny, so threads must never wait on each other: on an idle 2-core machine two
    threads made a step 1.5x faster than one, while on the same machine busy with other jobs two threads
    made each step about six times slower than one. More than two were not measured.
    ``own_threads``: threads this process already runs, which the load average counts as busy cores.
    """
    others = max(0.0, os.getloadavg()[0] - own_threads)
    idle = (os.cpu_count() or 1) - others
    return max(1, min(2, round(idle)))


def build_tiny_target(
    out_dir: Path,
    seed: int = 0,
    steps: int | None = None,
    heldout: int = 96,
    arch: str = "llama",
    corpus: Corpus = "tasks",
) -> Path:
    """Train the tiny target from ``seed`` and write it to ``out_dir`` atomically; returns ``out_dir``.

    ``heldout`` prompts are answered greedily after training to record accuracy in the manifest (0 skips that).
    ``arch``: "llama", or "deepseek_v3" for the DeepSeek-V3-shaped variant (module docstring).
    ``corpus``: "tasks", or "chatty" for the unsaturated variant (corpus.py's docstring).
    """
    steps = DEFAULT_STEPS if steps is None else steps
    if steps < 1:
        raise UsageError(
            f"steps={steps}: the tiny target needs at least one training step", "pass steps >= 1 or leave it unset"
        )
    out_dir = Path(out_dir)
    t0 = time.monotonic()
    rng = random.Random(seed)
    # the tokenizer learns from rendered conversations (so role names and tags merge like the real thing),
    # always the same 2000 of them: the vocabulary does not depend on the number of steps
    template = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(CHAT_TEMPLATE)
    tokenizer = train_tokenizer(
        [
            template.render(messages=conversation(t, SYSTEM_PROMPTS[i % len(SYSTEM_PROMPTS)]))
            for i, t in enumerate(sample_tasks(2000, seed, split="train", corpus=corpus))
        ]
    )
    rows = encode(tokenizer, sample_tasks(steps * BATCH_SIZE, seed, split="train", corpus=corpus), rng)
    caller_threads = torch.get_num_threads()
    torch.set_num_threads(build_threads())  # the weights do not depend on it (the tests build with 1 and 2)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            config = model_config(tokenizer, arch)
            model = DeepseekV3ForCausalLM(config) if isinstance(config, DeepseekV3Config) else LlamaForCausalLM(config)
            model.generation_config = GenerationConfig(
                bos_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
                do_sample=False,
            )
            final_loss = train(model, batches(rows, rng), tokenizer.pad_token_id)
        scores = heldout_scores(model, tokenizer, heldout) if heldout else {}
        threads_used = torch.get_num_threads()
    finally:
        torch.set_num_threads(caller_threads)
    build_seconds = time.monotonic() - t0
    save_target(
        out_dir,
        model,
        tokenizer,
        {
            "recipe_version": RECIPE_VERSION,
            "arch": arch,
            "corpus": corpus,
            "seed": seed,
            "steps": steps,
            "batch_size": BATCH_SIZE,
            "final_loss": round(final_loss, 4),
            "build_seconds": round(build_seconds, 1),
            "torch_threads": threads_used,
            # the weights depend on the kernels this picks (AVX2 and AVX-512 round differently), not on threads
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            **scores,
        },
    )
    return out_dir


def save_target(out_dir: Path, model, tokenizer, manifest: dict) -> None:
    """A built target, atomically: weights, tokenizer with the chat template, and the build's manifest."""
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        # transformers 5 writes the template to chat_template.jinja; older readers look in tokenizer_config.json
        config_path = tmp / "tokenizer_config.json"
        tok_config = json.loads(config_path.read_text())
        tok_config["chat_template"] = CHAT_TEMPLATE
        write_json(config_path, tok_config)
        write_json(tmp / MANIFEST, manifest)


def cache_root(cache_dir: Path | None = None) -> Path:
    """Where the tiny target is cached: ``cache_dir``, else $EAGLEKIT_CACHE, else $XDG_CACHE_HOME/eaglekit, else
    ~/.cache/eaglekit."""
    if cache_dir or os.environ.get("EAGLEKIT_CACHE"):
        return Path(cache_dir or os.environ["EAGLEKIT_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "eaglekit"


def cached_target_dir(cache_dir: Path | None = None, arch: str = "llama", corpus: Corpus = "tasks") -> Path:
    """The folder ``ensure_tiny_target`` builds into and returns (built or not)."""
    variant = [corpus] * (corpus != "tasks") + [arch.replace("_", "-")] * (arch != "llama")
    name = "-".join(["tiny", *variant, RECIPE_VERSION]) if variant else f"tiny-target-{RECIPE_VERSION}"
    return cache_root(cache_dir) / name


def is_built(model_dir: Path, arch: str = "llama", corpus: Corpus = "tasks") -> bool:
    """True when ``model_dir`` holds a finished build of the current recipe (atomic_dir only ever renames in whole builds)."""
    try:
        manifest = json.loads((model_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return (
        manifest.get("recipe_version") == RECIPE_VERSION
        and manifest.get("steps") == DEFAULT_STEPS
        and manifest.get("seed") == 0
        and manifest.get("arch", "llama") == arch
        and manifest.get("corpus", "tasks") == corpus
    )


def ensure_tiny_target(cache_dir: Path | None = None, arch: str = "llama", corpus: Corpus = "tasks") -> Path:
    """The cached tiny target (``cache_root()/tiny-target-<version>``, or ``tiny-deepseek-v3-<version>``, or
    ``tiny-chatty-<version>`` for the chatty corpus), built on first use (``build_once``)."""
    if corpus not in CORPORA:
        raise UsageError(f"unknown tiny-target corpus {corpus!r}", f"use one of {', '.join(CORPORA)}")
    model_dir = cached_target_dir(cache_dir, arch, corpus)
    return build_once(
        model_dir,
        lambda: is_built(model_dir, arch, corpus),
        lambda: build_tiny_target(model_dir, arch=arch, corpus=corpus),
    )


def build_once(model_dir: Path, built: Callable[[], bool], build: Callable[[], object]) -> Path:
    """``model_dir`` once ``built()`` holds, calling ``build()`` first where it does not.

    Concurrent callers (parallel test processes) serialise on a lock file: one builds, the others wait
    and then find the finished folder.
    """
    root, name = model_dir.parent, model_dir.name
    if built():
        return model_dir
    try:
        root.mkdir(parents=True, exist_ok=True)
        # opened here so that an unwritable cache gets its own message; the `with lock` below closes it
        lock = open(root / f".{name}.lock", "a")  # noqa: SIM115
    except OSError as e:
        raise UsageError(
            f"cannot write the eaglekit cache at {root}: {e.strerror}", "set EAGLEKIT_CACHE to a writable folder"
        ) from e
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not built():
            build()
    return model_dir


def _distinct_heldout_prompts(n: int, seed: int) -> list[str]:
    """The first ``n`` distinct prompts of the held-out draw for ``seed``.

    Some task kinds have only a few dozen held-out prompts, so a plain draw repeats rows; a prompts file
    with repeats wastes generation and trips pre-flight's duplicate check. Draws are a prefix of one
    seeded stream, so drawing more keeps the earlier prompts and their order."""
    draws = max(2 * n, 64)
    while True:
        prompts = list(dict.fromkeys(task.prompt for task in sample_tasks(draws, seed, split="heldout")))
        if len(prompts) >= n:
            return prompts[:n]
        if draws >= 32 * n:
            raise UsageError(
                f"write_prompts: only {len(prompts)} distinct held-out prompts in {draws} draws, {n} asked for",
                f"ask for at most {len(prompts)} prompts, or join files written with different seeds",
            )
        draws *= 2


def write_prompts(path: Path, n: int, seed: int, shape: Literal["sharegpt", "messages"] = "sharegpt") -> Path:
    """Write ``n`` distinct held-out prompts (never seen in training) as JSONL for the demo; every fourth row has a system turn."""
    if shape not in ("sharegpt", "messages"):
        raise UsageError(f"write_prompts: unknown shape {shape!r}", "use shape='sharegpt' or shape='messages'")
    rows = []
    for i, prompt in enumerate(_distinct_heldout_prompts(n, seed)):
        turns = [("system", SYSTEM_PROMPTS[(i // 4) % len(SYSTEM_PROMPTS)])] if i % 4 == 3 else []
        turns.append(("user", prompt))
        row_id = f"tiny-{seed}-{i:05d}"
        if shape == "sharegpt":
            rows.append(
                {"id": row_id, "conversations": [{"from": "human" if r == "user" else r, "value": c} for r, c in turns]}
            )
        else:
            rows.append({"id": row_id, "messages": [{"role": r, "content": c} for r, c in turns]})
    write_text(path, "".join(json.dumps(row) + "\n" for row in rows))
    return Path(path)
