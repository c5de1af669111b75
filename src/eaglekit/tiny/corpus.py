"""The tiny target's training corpus: small programmatic tasks solved step by step.

Each task is a user prompt, a reasoning trace and a short answer. The reasoning follows a fixed,
line-by-line procedure (digit-by-digit arithmetic with carries, selection sort, running letter counts)
so that a tiny model can learn it in a minute and a drafter trained on its outputs sees text that is
predictable but not constant: the numbers and words change, the shape does not.

Train and held-out prompts are disjoint by construction: a prompt belongs to the held-out split when
a stable hash of its text falls in one bucket out of ``HELDOUT_BUCKETS``, so no seed can ever put a
held-out prompt into training.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Callable, Literal

Split = Literal["train", "heldout"]
HELDOUT_BUCKETS = 8
WORDS = sorted(set(
    "apple banana cherry orange lemon melon grape mango peach pear plum kiwi tomato potato carrot "
    "onion bottle window garden letter paper pencil rabbit turtle monkey parrot kitten puppy dragon "
    "castle mirror butter coffee summer winter river forest island planet rocket school".split()))
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


# Operands are two-digit and every reasoning line reads single digits by place: a tiny model learns
# to look digits up reliably long before it learns to copy a long digit string in order.
def add_task(rng: random.Random) -> Task:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    prompt = rng.choice(["What is {a} + {b}?", "Compute {a} + {b}.", "Add {a} and {b}."]).format(a=a, b=b)
    ones = a % 10 + b % 10
    tens = a // 10 + b // 10 + ones // 10
    reasoning = (f"We add digit by digit, from right to left.\n"
                 f"ones: {a % 10} + {b % 10} = {ones}, write {ones % 10}, carry {ones // 10}\n"
                 f"tens: {a // 10} + {b // 10} + {ones // 10} = {tens}, write {tens}")
    assert tens * 10 + ones % 10 == a + b
    return Task("add", prompt, reasoning, f"The sum is {a + b}.")


def subtract_task(rng: random.Random) -> Task:
    a, b = sorted(rng.sample(range(10, 100), 2), reverse=True)
    prompt = rng.choice(["What is {a} - {b}?", "Compute {a} - {b}.", "Subtract {b} from {a}."]).format(a=a, b=b)
    x, y = a % 10, b % 10
    if x >= y:
        ones_line, borrow = f"ones: {x} - {y} = {x - y}, borrow 0", 0
    else:
        ones_line, borrow = f"ones: {x} - {y} is negative, so {x + 10} - {y} = {x + 10 - y}, borrow 1", 1
    tens = a // 10 - b // 10 - borrow
    reasoning = (f"We subtract digit by digit, from right to left.\n{ones_line}\n"
                 f"tens: {a // 10} - {b // 10} - {borrow} = {tens}, write {tens}")
    return Task("subtract", prompt, reasoning, f"The difference is {a - b}.")


def sort_task(rng: random.Random) -> Task:
    nums = rng.sample(range(1, 10), rng.randint(3, 5))
    listed = ", ".join(map(str, nums))
    prompt = rng.choice(["Sort these numbers from smallest to largest: {l}.", "Put {l} in increasing order."]).format(l=listed)
    lines, left = [], list(nums)
    while len(left) > 1:
        smallest = min(left)
        before = ", ".join(map(str, left))
        left.remove(smallest)
        lines.append(f"The smallest of {before} is {smallest}, leaving {', '.join(map(str, left))}.")
    lines.append(f"Only {left[0]} is left.")
    return Task("sort", prompt, "\n".join(lines), ", ".join(map(str, sorted(nums))))


# (big unit, small unit, small units per big unit, the largest amount of the big unit asked about)
CONVERSIONS = [("km", "m", 1000, 9), ("kg", "g", 1000, 9), ("h", "min", 60, 12), ("min", "s", 60, 12)]
UNIT_NAMES = {"km": "kilometers", "m": "meters", "h": "hours", "min": "minutes", "s": "seconds", "kg": "kilograms", "g": "grams"}


def convert_task(rng: random.Random) -> Task:
    big, small, factor, largest = rng.choice(CONVERSIONS)
    n = rng.randint(1, largest)
    if rng.random() < 0.5:  # big -> small: multiply
        prompt = rng.choice(["Convert {n} {u} to {v}.", "How many {v} are in {n} {u}?"]).format(n=n, u=big, v=UNIT_NAMES[small])
        reasoning = f"1 {big} = {factor} {small}, so we multiply by {factor}.\n{n} × {factor} = {n * factor}"
        answer = f"{n} {big} = {n * factor} {small}"
    else:  # small -> big: divide
        m = n * factor
        prompt = rng.choice(["Convert {m} {v} to {u}.", "How many {u} are in {m} {v}?"]).format(m=m, v=small, u=UNIT_NAMES[big])
        reasoning = f"1 {big} = {factor} {small}, so we divide by {factor}.\n{m} / {factor} = {n}"
        answer = f"{m} {small} = {n} {big}"
    return Task("convert", prompt, reasoning, answer)


def count_letters_task(rng: random.Random) -> Task:
    word = rng.choice(WORDS)
    letter = rng.choice(word) if rng.random() < 0.8 else rng.choice([c for c in "abcdefghijklmnopqrstuvwxyz" if c not in word])
    prompt = rng.choice(["How many times does the letter {c} appear in {w}?", "Count the letter {c} in the word {w}."]).format(c=letter, w=word)
    running, count = [], 0
    for c in word:
        count += c == letter
        running.append(f"{c} {count}")
    reasoning = (f"Spell {word}: {', '.join(word)}.\nGo through the letters and count each {letter}:\n"
                 f"{', '.join(running)}.")
    return Task("count", prompt, reasoning, f"The letter {letter} appears {count} {'time' if count == 1 else 'times'} in {word}.")


def compare_task(rng: random.Random) -> Task:
    a = rng.randint(10, 99)
    # half the pairs share the tens digit, so the ones digit has to decide
    b = rng.choice([d for d in range(10 * (a // 10), 10 * (a // 10) + 10) if d != a]) if rng.random() < 0.5 else \
        rng.choice([d for d in range(10, 100) if d // 10 != a // 10])
    ask = rng.choice(["larger", "smaller"])
    prompt = rng.choice(["Which is {q}, {a} or {b}?", "Which number is {q}: {a} or {b}?"]).format(q=ask, a=a, b=b)
    pick = max(a, b) if ask == "larger" else min(a, b)
    decide = max if ask == "larger" else min
    lines = ["Compare the digits from the left."]
    if a // 10 == b // 10:
        lines.append(f"tens: {a // 10} and {b // 10} are equal.")
        lines.append(f"ones: {a % 10} and {b % 10}, {decide(a % 10, b % 10)} is {ask}, so {pick} is {ask}.")
    else:
        lines.append(f"tens: {a // 10} and {b // 10}, {decide(a // 10, b // 10)} is {ask}, so {pick} is {ask}.")
    return Task("compare", prompt, "\n".join(lines), f"{pick} is {ask}.")


TASK_MAKERS: list[Callable[[random.Random], Task]] = [
    add_task, subtract_task, sort_task, convert_task, count_letters_task, compare_task,
]


def split_of(prompt: str) -> Split:
    """The split a prompt belongs to, from a hash of its text (stable across runs and machines)."""
    bucket = int.from_bytes(hashlib.blake2b(prompt.encode(), digest_size=8).digest(), "little") % HELDOUT_BUCKETS
    return "heldout" if bucket == 0 else "train"


def sample_tasks(n: int, seed: int, split: Split = "train") -> list[Task]:
    """``n`` tasks of every kind in turn, deterministic in ``seed``, all from ``split``."""
    rng = random.Random(f"eaglekit-tiny/{split}/{seed}")
    tasks: list[Task] = []
    while len(tasks) < n:
        task = TASK_MAKERS[len(tasks) % len(TASK_MAKERS)](rng)
        if split_of(task.prompt) == split:
            tasks.append(task)
    return tasks
