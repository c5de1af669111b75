"""The tiny target's training corpus: small programmatic tasks solved step by step.

Each task is a user prompt, a reasoning trace and a short answer. The reasoning follows a fixed,
line-by-line procedure (digit-by-digit arithmetic with carries, a counting sort, running vowel counts)
so that a tiny model can learn it in a few CPU minutes and a drafter trained on its outputs sees text
that is predictable but not constant: the numbers and words change, the shape does not.

The procedures are chosen for what an 8-layer, 128-wide model learns from ~16k samples: looking a
single token up (a digit by its place, a letter, "is 5 in the list?") and small memorised tables.
Copying a multi-digit string in order is what it learns last, so no step asks for it.

The ``chatty`` corpus is the same tasks with a free remark after every line of the reasoning ("Maybe
the kiwi likes the castle."): four slots the target learns as near-uniform choices, so its replies have real
entropy, as a chat model's do. Sampled (temperature 1, for the training replies and when decoding), each remark
is a fresh draw that no drafter can foresee past its first token, and drafters accept about as much as on real
chat (τ ≈ 3.4 at K=5; the τ race's second target, `benchmarks/tau_vs_speculators.py --target chatty
--generate-temperature 1`). Greedy decoding does not show it: it picks whichever remark the target's logits
favour by a hair, the same one after every line of a reply, which a drafter copies from the context after its
first occurrence (τ ≈ 4.3 at K=5, near the plain corpus's 4.5). A remark follows every line, not some: were it
optional, "no remark" would be the single likeliest continuation and greedy decoding would never make one.

Train and held-out prompts are disjoint by construction: a prompt belongs to the held-out split when
a stable hash of its text falls in one bucket out of ``HELDOUT_BUCKETS``, so no seed can ever put a
held-out prompt into training.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from eaglekit.data.responses import RESPONSES, make_record
from eaglekit.errors import UsageError

Split = Literal["train", "heldout"]
Corpus = Literal["tasks", "chatty"]
CORPORA: tuple[Corpus, ...] = ("tasks", "chatty")
HELDOUT_BUCKETS = 8
VOWELS = "aeiou"
WORDS = sorted(
    set(
        [
            "apple",
            "banana",
            "cherry",
            "orange",
            "lemon",
            "melon",
            "grape",
            "mango",
            "peach",
            "pear",
            "plum",
            "kiwi",
            "tomato",
            "potato",
            "carrot",
            "onion",
            "bottle",
            "window",
            "garden",
            "letter",
            "paper",
            "pencil",
            "rabbit",
            "turtle",
            "monkey",
            "parrot",
            "kitten",
            "puppy",
            "dragon",
            "castle",
            "mirror",
            "butter",
            "coffee",
            "summer",
            "winter",
            "river",
            "forest",
            "island",
            "planet",
            "rocket",
            "school",
        ]
    )
)
SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a careful assistant. Think step by step.",
    "You solve small math and word puzzles.",
]


@dataclass(frozen=True)
class Task:
    kind: str
    prompt: str
    reasoning: str
    answer: str


# Operands are two-digit and every line reads single digits by place. Both places use the same one-digit
# table (the carry or borrow is a separate +1/-1 step), so every sample rehearses that table twice.
def add_task(rng: random.Random) -> Task:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    prompt = rng.choice(["What is {a} + {b}?", "Compute {a} + {b}.", "Add {a} and {b}."]).format(a=a, b=b)
    ones = a % 10 + b % 10
    carry = ones // 10
    tens = a // 10 + b // 10
    reasoning = (
        f"We add digit by digit, from right to left.\n"
        f"ones: {a % 10}+{b % 10}={ones}, write {ones % 10}, carry {carry}\n"
        f"tens: {a // 10}+{b // 10}={tens}, {tens}+{carry}={tens + carry}, write {tens + carry}"
    )
    return Task("add", prompt, reasoning, f"The sum is {a + b}.")


def subtract_task(rng: random.Random) -> Task:
    a, b = sorted(rng.sample(range(10, 100), 2), reverse=True)
    # always "a - b" in this order: the reasoning then reads the digits in the order they were given
    prompt = rng.choice(["What is {a} - {b}?", "Compute {a} - {b}.", "Find {a} - {b}."]).format(a=a, b=b)
    x, y = a % 10, b % 10
    borrow = int(x < y)
    ones_line = (
        f"ones: {x} is less than {y}, so borrow: {x + 10}-{y}={x + 10 - y}, write {x + 10 - y}, borrow 1"
        if borrow
        else f"ones: {x}-{y}={x - y}, write {x - y}, borrow 0"
    )
    tens = a // 10 - b // 10
    reasoning = (
        f"We subtract digit by digit, from right to left.\n{ones_line}\n"
        f"tens: {a // 10}-{b // 10}={tens}, {tens}-{borrow}={tens - borrow}, write {tens - borrow}"
    )
    return Task("subtract", prompt, reasoning, f"The difference is {a - b}.")


def sort_task(rng: random.Random) -> Task:
    # A counting sort: "is 5 in the list?" for 1..9 is a lookup, where selection sort would need the
    # remaining list copied in order on every line.
    nums = rng.sample(range(1, 10), rng.randint(3, 5))
    listed = ", ".join(map(str, nums))
    prompt = rng.choice(["Sort these numbers from smallest to largest: {l}.", "Put {l} in increasing order."]).format(
        l=listed
    )
    checks = ", ".join(f"{d} {'yes' if d in nums else 'no'}" for d in range(1, 10))
    reasoning = f"Check each number from one to nine against the list:\n{checks}."
    return Task("sort", prompt, reasoning, ", ".join(map(str, sorted(nums))))


# (big unit, small unit, small units per big unit, the largest amount of the big unit asked about)
CONVERSIONS = [("km", "m", 1000, 9), ("kg", "g", 1000, 9), ("h", "min", 60, 12), ("min", "s", 60, 12)]
UNIT_NAMES = {
    "km": "kilometers",
    "m": "meters",
    "h": "hours",
    "min": "minutes",
    "s": "seconds",
    "kg": "kilograms",
    "g": "grams",
}


def convert_task(rng: random.Random) -> Task:
    big, small, factor, largest = rng.choice(CONVERSIONS)
    n = rng.randint(1, largest)
    if rng.random() < 0.5:  # big -> small: multiply
        prompt = rng.choice(["Convert {n} {u} to {v}.", "How many {v} are in {n} {u}?"]).format(
            n=n, u=big, v=UNIT_NAMES[small]
        )
        reasoning = f"1 {big} = {factor} {small}, so we multiply by {factor}.\n{n}×{factor}={n * factor}"
        answer = f"{n} {big} = {n * factor} {small}"
    else:  # small -> big: divide, shown by multiplying back (the same table as the other direction)
        m = n * factor
        prompt = rng.choice(["Convert {m} {v} to {u}.", "How many {u} are in {m} {v}?"]).format(
            m=m, v=small, u=UNIT_NAMES[big]
        )
        reasoning = f"1 {big} = {factor} {small}, so we divide by {factor}.\n{n}×{factor}={m}, so it is {n} {big}."
        answer = f"That is {n} {big}."
    return Task("convert", prompt, reasoning, answer)


def count_vowels_task(rng: random.Random) -> Task:
    # Vowels rather than a letter named in the prompt: whether a letter counts is then a property of the
    # letter itself, which a tiny model learns long before it can compare against a letter named far back.
    word = rng.choice(WORDS)
    prompt = rng.choice(
        ["How many vowels are in the word {w}?", "Count the vowels in {w}.", "How many vowels does {w} have?"]
    ).format(w=word)
    running, count = [], 0
    for c in word:
        count += c in VOWELS
        running.append(f"{c} {count}")
    reasoning = f"Spell {word}: {', '.join(word)}.\nCount the vowels one by one:\n{', '.join(running)}."
    return Task("count", prompt, reasoning, f"{word} has {count} {'vowel' if count == 1 else 'vowels'}.")


def compare_task(rng: random.Random) -> Task:
    a = rng.randint(10, 99)
    # half the pairs share the tens digit, so the ones digit has to decide
    b = (
        rng.choice([d for d in range(10 * (a // 10), 10 * (a // 10) + 10) if d != a])
        if rng.random() < 0.5
        else rng.choice([d for d in range(10, 100) if d // 10 != a // 10])
    )
    ask = rng.choice(["larger", "smaller"])
    prompt = rng.choice(["Which is {q}, {a} or {b}?", "Which number is {q}: {a} or {b}?"]).format(q=ask, a=a, b=b)
    pick = max(a, b) if ask == "larger" else min(a, b)
    # digits are read by place, as in addition; the winner is then put together from the digits just written
    same_tens = a // 10 == b // 10
    winner, loser = sorted((a % 10, b % 10) if same_tens else (a // 10, b // 10), reverse=ask == "larger")
    reasoning = (
        f"Compare digit by digit, from left to right.\ntens: {a // 10} and {b // 10}\nones: {a % 10} and {b % 10}\n"
        f"The tens {'are equal' if same_tens else 'differ'}: {winner} is {ask} than {loser}.\n"
        f"So the {'first' if pick == a else 'second'} number, {pick}, is {ask}."
    )
    return Task("compare", prompt, reasoning, f"{pick} is {ask}.")


# addition and subtraction twice: their digit tables are the most to learn
TASK_MAKERS: list[Callable[[random.Random], Task]] = [
    add_task,
    subtract_task,
    sort_task,
    add_task,
    convert_task,
    subtract_task,
    count_vowels_task,
    compare_task,
]


# The four slots of a remark are drawn independently: 8 x 41 x 8 x 41 remarks.
REMARK_OPENERS = ["Maybe", "I think", "Note that", "Well,", "It seems", "Of course", "Clearly", "Perhaps"]
REMARK_VERBS = ["likes", "sees", "needs", "finds", "keeps", "wants", "holds", "meets"]


def with_remarks(task: Task, rng: random.Random) -> Task:
    """``task`` with a remark after each of its reasoning lines (the prompt and the answer unchanged)."""
    lines = []
    for line in task.reasoning.split("\n"):
        opener, verb = rng.choice(REMARK_OPENERS), rng.choice(REMARK_VERBS)
        lines += [line, f"{opener} the {rng.choice(WORDS)} {verb} the {rng.choice(WORDS)}."]
    return Task(task.kind, task.prompt, "\n".join(lines), task.answer)


def split_of(prompt: str) -> Split:
    """The split a prompt belongs to, from a hash of its text (stable across runs and machines)."""
    bucket = int.from_bytes(hashlib.blake2b(prompt.encode(), digest_size=8).digest(), "little") % HELDOUT_BUCKETS
    return "heldout" if bucket == 0 else "train"


def sample_tasks(n: int, seed: int, split: Split = "train", corpus: Corpus = "tasks") -> list[Task]:
    """``n`` tasks, the kinds in a fixed rotation, deterministic in ``seed``, all from ``split``; ``chatty``
    adds remarks to the same tasks (its own random stream, so the tasks are those of the plain corpus)."""
    if split not in ("train", "heldout"):
        raise UsageError(f"sample_tasks: unknown split {split!r}", "use split='train' or split='heldout'")
    if corpus not in CORPORA:
        raise UsageError(f"sample_tasks: unknown corpus {corpus!r}", f"use one of {', '.join(CORPORA)}")
    rng = random.Random(f"eaglekit-tiny/{split}/{seed}")
    tasks: list[Task] = []
    while len(tasks) < n:
        task = TASK_MAKERS[len(tasks) % len(TASK_MAKERS)](rng)
        if split_of(task.prompt) == split:
            tasks.append(task)
    if corpus == "chatty":
        remarks = random.Random(f"eaglekit-tiny/remarks/{split}/{seed}")
        tasks = [with_remarks(task, remarks) for task in tasks]
    return tasks


def write_responses(generate_dir: Path, tasks: Iterable[Task], prefix: str) -> Path:
    """``tasks`` as generate records the tiny target's replies (the reasoning in its own field) in a run's
    ``generate/responses.jsonl``, prompt ids ``{prefix}{i}``: a run that starts at prepare, for tests and benchmarks."""
    rows = [
        make_record(
            f"{prefix}{i}",
            [{"role": "user", "content": t.prompt}],
            {"reasoning": t.reasoning, "content": t.answer},
            "stop",
            0,
            0,
            "tiny",
            None,
        )[0]
        for i, t in enumerate(tasks)
    ]
    generate_dir.mkdir(parents=True, exist_ok=True)
    path = generate_dir / RESPONSES
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
