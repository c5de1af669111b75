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
PLACES = ["ones", "tens", "hundreds", "thousands", "ten-thousands"]
WORDS = (
    "apple banana strawberry cherry orange lemon melon grape mango peach pear plum kiwi papaya "
    "tomato potato carrot pepper onion garlic bottle window garden letter paper pencil rabbit "
    "turtle monkey parrot kitten puppy dragon castle mirror butter coffee summer winter spring "
    "river mountain forest island desert planet rocket school teacher doctor bridge tunnel "
    "balloon library mississippi banana committee success address hello bubble"
).split()
WORDS = sorted(set(WORDS))
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


def add_task(rng: random.Random) -> Task:
    a, b = (rng.randint(10, 10 ** rng.randint(2, 4) - 1) for _ in range(2))
    prompt = rng.choice(["What is {a} + {b}?", "Compute {a} + {b}.", "Add {a} and {b}."]).format(a=a, b=b)
    lines = [f"We add {a} and {b} digit by digit, from right to left."]
    da, db = str(a)[::-1], str(b)[::-1]
    carry, so_far = 0, ""
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        total = x + y + carry
        so_far = str(total % 10) + so_far
        lines.append(f"{PLACES[i]}: {x} + {y} + {carry} = {total}, write {total % 10}, carry {total // 10}, so far {so_far}")
        carry = total // 10
    if carry:
        so_far = "1" + so_far
        lines.append(f"the last carry 1 goes in front, so far {so_far}")
    assert int(so_far) == a + b
    return Task("add", prompt, "\n".join(lines), f"{a} + {b} = {a + b}")


def subtract_task(rng: random.Random) -> Task:
    a, b = sorted((rng.randint(10, 10 ** rng.randint(2, 4) - 1) for _ in range(2)), reverse=True)
    prompt = rng.choice(["What is {a} - {b}?", "Compute {a} - {b}.", "Subtract {b} from {a}."]).format(a=a, b=b)
    lines = [f"We subtract {b} from {a} digit by digit, from right to left."]
    da, db = str(a)[::-1], str(b)[::-1]
    borrow, so_far = 0, ""
    for i in range(len(da)):
        x, y = int(da[i]), int(db[i]) if i < len(db) else 0
        if x - y - borrow >= 0:
            digit = x - y - borrow
            so_far = str(digit) + so_far
            lines.append(f"{PLACES[i]}: {x} - {y} - {borrow} = {digit}, borrow 0, so far {so_far}")
            borrow = 0
        else:
            digit = x + 10 - y - borrow
            so_far = str(digit) + so_far
            lines.append(f"{PLACES[i]}: {x} - {y} - {borrow} is negative, so {x + 10} - {y} - {borrow} = {digit}, borrow 1, so far {so_far}")
            borrow = 1
    result = str(int(so_far))
    if result != so_far:
        lines.append(f"drop the leading zeros: {result}")
    assert int(result) == a - b
    return Task("subtract", prompt, "\n".join(lines), f"{a} - {b} = {a - b}")


def sort_task(rng: random.Random) -> Task:
    nums = rng.sample(range(1, 100), rng.randint(3, 5))
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


# (from unit, to unit, factor, the largest amount in the from unit); every factor is exact
CONVERSIONS = [("km", "m", 1000, 999), ("h", "min", 60, 24), ("min", "s", 60, 24), ("kg", "g", 1000, 999)]
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
    digits = rng.randint(2, 4)
    a = rng.randint(10 ** (digits - 1), 10 ** digits - 1)
    if rng.random() < 0.3:  # different lengths
        b = rng.randint(10 ** (digits - 2) if digits > 2 else 1, 10 ** (digits - 1) - 1)
    else:  # same length, often sharing a prefix so the digit walk matters
        keep = rng.randint(0, digits - 1)
        b = int(str(a)[:keep] + "".join(str(rng.randint(1 if keep == 0 and i == 0 else 0, 9)) for i in range(digits - keep)))
    if a == b:
        b = a + 1 if a + 1 < 10 ** digits else a - 1
    if rng.random() < 0.5:
        a, b = b, a
    ask = rng.choice(["larger", "smaller"])
    prompt = rng.choice(["Which is {q}, {a} or {b}?", "Which number is {q}: {a} or {b}?"]).format(q=ask, a=a, b=b)
    sa, sb = str(a), str(b)
    if len(sa) != len(sb):
        longer = a if len(sa) > len(sb) else b
        lines = [f"{a} has {len(sa)} digits and {b} has {len(sb)} digits, so {longer} is larger."]
    else:
        lines = [f"Both have {len(sa)} digits, so compare from the left."]
        for i, (x, y) in enumerate(zip(sa, sb)):
            place = PLACES[len(sa) - 1 - i]
            if x == y:
                lines.append(f"{place}: {x} and {y} are equal.")
            else:
                lines.append(f"{place}: {x} and {y}, {max(x, y)} is larger, so {a if x > y else b} is larger.")
                break
    pick = max(a, b) if ask == "larger" else min(a, b)
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
