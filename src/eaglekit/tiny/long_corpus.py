"""The long-context tiny target's corpus: tool logs whose replies check 26 code names against lines far back.

A prompt is a tool log (one line per event) with a question at its end. Most lines are filler: requests,
cache misses, retries, in words of their own. The *needles* name about half of the 26 code names (alpha to
zulu): either a roster on the first line (``list``: ``on call today: mike quebec ...``) or one note per name in
the first half of the log (``notes``: ``note bravo: amber falcon.``). Under the question a legend gives each
name a desk (``Desk list: Alpha inner, Bravo north, ...``). The reply goes through all 26 names in alphabetical
order, one line each, `` Bravo north yes`` or `` Bravo north no``: the name (capitalised, as the legend spells it:
another token than the log's), its desk from the legend, and whether the needles name it; then a fixed closing
sentence.

Why this shape (the target exists to show drafters falling at long context):
- a quarter of the reply's tokens are decisions that only the far needles settle, and settle exactly: given the
  context the reply is deterministic, without it each decision is a coin flip;
- an EAGLE-3 drafter drafts without attention any token that follows from the target's features at the last
  verified token, or from its own drafts since (it carries its hidden state from draft to draft). A reply that
  followed from a line's place alone (``- Bravo yes``: the v1 recipe) left it only one token in four to find by
  attention, which bounded its fall near three tokens in four. Here the desk is read from the legend, ~100
  tokens back, and the decision after it from the needles: a drafter that proposes a line's desk and decision
  beyond its first draft must look both up itself, the decision thousands of tokens back at long context, a
  distance a drafter trained on short rows has never attended over;
- the lookups are learnable in a build of minutes because the build starts their heads
  (long_build.init_name_matcher): a name matcher for the needles, a previous-token head and a matcher against
  it for the legend, a previous-token head carrying the decision from the name to its desk. Copying a passage
  word by word needs two composed heads (an induction circuit), which the 8-layer, 128-wide model did not learn
  from a random start within the build's budget (1,200 and 1,800 steps: no word copied), nor the legend (its
  loss held at chance).

The length of a log is its number of filler lines, so one generator serves rows of a few hundred tokens
(training) and prompts of 20K (evaluation). Train and held-out logs are disjoint by ``corpus.split_of``
of their needles' text.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from eaglekit.errors import UsageError
from eaglekit.tiny.corpus import Split, split_of

# Single tokens in the long target's vocabulary (the builder's tokenizer learns them from this corpus).
NOTE_NAMES = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
    "sierra",
    "tango",
    "uniform",
    "victor",
    "whiskey",
    "xray",
    "yankee",
    "zulu",
]
NEEDLE_WORDS = [
    "amber",
    "azure",
    "basil",
    "birch",
    "bronze",
    "cedar",
    "cobalt",
    "coral",
    "crimson",
    "dune",
    "ember",
    "fern",
    "flint",
    "frost",
    "garnet",
    "glacier",
    "granite",
    "harbor",
    "hazel",
    "indigo",
    "ivory",
    "jade",
    "jasper",
    "juniper",
    "lagoon",
    "lantern",
    "lava",
    "lilac",
    "linen",
    "maple",
    "marble",
    "meadow",
    "moss",
    "nectar",
    "ocean",
    "olive",
    "onyx",
    "opal",
    "orchid",
    "pebble",
    "pepper",
    "pine",
    "prairie",
    "quartz",
    "raven",
    "reef",
    "ripple",
    "ruby",
    "saffron",
    "sage",
    "scarlet",
    "shadow",
    "silver",
    "slate",
    "spruce",
    "storm",
    "summit",
    "sunset",
    "thistle",
    "thunder",
    "timber",
    "topaz",
    "tulip",
    "tundra",
    "valley",
    "velvet",
    "violet",
    "walnut",
    "willow",
    "zephyr",
    "anchor",
    "arrow",
    "badge",
    "barrel",
    "basket",
    "beacon",
    "bell",
    "blade",
    "bridge",
    "bucket",
    "candle",
    "canvas",
    "carpet",
    "chain",
    "chisel",
    "clock",
    "compass",
    "crown",
    "crystal",
    "drum",
    "feather",
    "flag",
    "flute",
    "funnel",
    "glove",
    "hammer",
    "helmet",
    "hinge",
    "kettle",
    "ladder",
    "lamp",
    "lens",
    "lever",
    "locket",
    "magnet",
    "mask",
    "needle",
    "oar",
    "paddle",
    "pillow",
    "prism",
    "pulley",
    "quill",
    "rope",
    "saddle",
    "scroll",
    "shield",
    "shovel",
    "spindle",
    "spoon",
    "stamp",
    "sword",
    "tablet",
    "thimble",
    "torch",
    "trumpet",
    "tunnel",
    "vase",
    "wagon",
    "wheel",
    "whistle",
    "wrench",
    "badger",
    "beetle",
    "bison",
    "cobra",
    "condor",
    "coyote",
    "crane",
    "falcon",
    "ferret",
    "gecko",
    "heron",
    "ibis",
    "jackal",
    "lemur",
    "lynx",
    "marmot",
    "moose",
    "newt",
    "otter",
    "panda",
    "pelican",
    "puffin",
    "quail",
    "salmon",
    "seal",
    "shark",
    "sloth",
    "stork",
    "swan",
    "tapir",
    "toad",
    "trout",
    "viper",
    "walrus",
    "weasel",
    "wombat",
    "zebra",
]
# Filler: a tool's log, in words no needle uses.
SERVICES = ["api", "auth", "billing", "search", "upload", "mailer", "scheduler", "gateway"]
PATHS = ["/v1/items", "/v1/users", "/v1/orders", "/v2/files", "/v2/jobs", "/health", "/metrics", "/login"]

SYSTEM_PROMPT = "You are an agent that reads tool logs and answers from them exactly."
HEADER = "Tool log of session {session}:"
WORDS_PER_NOTE = (2, 4)
# Filler lines average ~20 tokens in the long target's tokenizer (measured on its build; ``filler_lines``).
TOKENS_PER_FILLER_LINE = 20

KINDS = ("list", "notes")
DESKS = ["north", "south", "east", "west", "upper", "lower", "inner", "outer"]


@dataclass(frozen=True)
class LongTask:
    """A log (its lines), which of them the reply depends on, the question, and the reference reply."""

    kind: str
    session: int
    lines: tuple[str, ...]
    needle_lines: tuple[int, ...]
    question: str
    reasoning: str
    answer: str

    @property
    def document(self) -> str:
        return "\n".join([HEADER.format(session=self.session), *self.lines])

    @property
    def prompt(self) -> str:
        return f"{self.document}\n\n{self.question}"

    def without_needles(self, rng: random.Random) -> LongTask:
        """The same log with every needle line replaced by a filler line: the length kept, the far material gone."""
        lines = list(self.lines)
        for i in self.needle_lines:
            lines[i] = stamped(i, filler_line(rng))
        return replace(self, lines=tuple(lines), needle_lines=())


def stamped(index: int, body: str) -> str:
    return f"[{index:05d}] {body}"


def filler_line(rng: random.Random) -> str:
    kind = rng.randrange(5)
    if kind == 0:
        verb = rng.choice(["GET", "POST", "PUT", "DELETE"])
        status = rng.choice([200, 201, 204, 404, 500])
        return f"{rng.choice(SERVICES)}: {verb} {rng.choice(PATHS)} -> {status} ({rng.randint(2, 999)} ms)"
    if kind == 1:
        return f"cache {rng.choice(['hit', 'miss'])} key=u{rng.randint(1000, 9999)} shard {rng.randint(0, 15)}"
    if kind == 2:
        state = rng.choice(["started", "finished", "paused"])
        return f"worker {rng.randint(1, 32)} {state} job {rng.randint(100, 9999)}"
    if kind == 3:
        return f"retry {rng.randint(1, 4)} of 5 for {rng.choice(SERVICES)} after timeout"
    return f"disk {rng.choice(['read', 'write'])} {rng.randint(1, 512)} MB in {rng.randint(1, 90)} s"


def make_task(rng: random.Random, filler: int, kind: str) -> LongTask:
    """One log of ``filler`` filler lines plus its needles, with the question and reply of ``kind``."""
    present = [name for name in NOTE_NAMES if rng.random() < 0.5] or [rng.choice(NOTE_NAMES)]
    rng.shuffle(present)
    where = "is on the list" if kind == "list" else "left a note"
    question = rng.choice(
        [
            f"Go through the code names from Alpha to Zulu: which {where}?",
            f"For each code name, Alpha to Zulu, say whether it {where}.",
        ]
    )
    # each name's desk, listed under the question (the name spelled as the reply spells it) and read back on the
    # name's line: a lookup settled near and just in time (long_build.init_name_matcher starts its heads)
    desks = [rng.choice(DESKS) for _ in NOTE_NAMES]
    question += (
        "\nDesk list: " + ", ".join(f"{n.capitalize()} {d}" for n, d in zip(NOTE_NAMES, desks, strict=True)) + "."
    )
    reasoning = "\n".join(
        [f"Check each code name's desk, and the {'list at the start' if kind == 'list' else 'notes in the log'}:"]
        # the reply spells a name capitalised (" Bravo"), the log lower case (" bravo"): two tokens, so that a
        # head matching the name finds the log's mention apart from the reply's own (long_build.init_name_matcher)
        + [f" {n.capitalize()} {d} {'yes' if n in present else 'no'}" for n, d in zip(NOTE_NAMES, desks, strict=True)]
    )
    answer = f"I checked all {len(NOTE_NAMES)} code names against the {'list' if kind == 'list' else 'notes'}."
    if kind == "list":
        lines = [f"on call today: {' '.join(present)}."] + [filler_line(rng) for _ in range(filler)]
        return LongTask(
            kind,
            rng.randint(100, 999),
            tuple(stamped(i, x) for i, x in enumerate(lines)),
            (0,),
            question,
            reasoning,
            answer,
        )
    # one note per present name, in the first half of the log
    words = rng.sample(NEEDLE_WORDS, len(NEEDLE_WORDS))
    total = filler + len(present)
    needle_lines = tuple(sorted(rng.sample(range(max(len(present), total // 2)), len(present))))
    in_order = iter(present)
    lines = []
    for i in range(total):
        if i in needle_lines:
            note = " ".join(words.pop() for _ in range(rng.randint(*WORDS_PER_NOTE)))
            lines.append(stamped(i, f"note {next(in_order)}: {note}."))
        else:
            lines.append(stamped(i, filler_line(rng)))
    return LongTask(kind, rng.randint(100, 999), tuple(lines), needle_lines, question, reasoning, answer)


# What a reply's tokens are, for telling where a drafter loses (benchmarks/long_context_misses.py)
REPLY_ROLES = ("decision", "desk", "name", "separator", "other")


def reply_token_role(text: str) -> str:
    """The role in a reply of the token spelled ``text``: a decision (yes/no: only the far needles settle it), a
    desk (the legend under the question settles it), a code name (capitalised: it follows from the line before),
    a separator (a line break), or other."""
    word = text.strip()
    if word in ("yes", "no"):
        return "decision"
    if word in DESKS:
        return "desk"
    if word.lower() in NOTE_NAMES and word[:1].isupper():
        return "name"
    return "separator" if word == "" else "other"


def needle_text(task: LongTask) -> str:
    return "\n".join(task.lines[i] for i in task.needle_lines)


def sample_long_tasks(n: int, seed: int, filler: tuple[int, int], split: Split = "train") -> list[LongTask]:
    """``n`` tasks, the kinds alternating, each log ``filler`` = (fewest, most) filler lines (uniform), all from
    ``split``, deterministic in ``seed``."""
    if split not in ("train", "heldout"):
        raise UsageError(f"sample_long_tasks: unknown split {split!r}", "use split='train' or split='heldout'")
    low, high = filler
    if not 0 <= low <= high:
        raise UsageError(
            f"sample_long_tasks: filler={filler}", "pass (fewest, most) filler lines with 0 <= fewest <= most"
        )
    rng = random.Random(f"eaglekit-tiny-long/{split}/{seed}")
    tasks: list[LongTask] = []
    while len(tasks) < n:
        task = make_task(rng, rng.randint(low, high), KINDS[len(tasks) % len(KINDS)])
        if split_of(needle_text(task)) == split:
            tasks.append(task)
    return tasks


def filler_lines(context_tokens: int) -> int:
    """Filler lines that make a log of about ``context_tokens`` tokens."""
    return max(2, context_tokens // TOKENS_PER_FILLER_LINE)
