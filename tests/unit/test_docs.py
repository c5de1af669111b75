"""The README and docs/ stay what the code and CI say they are: CI runs the README's test command, every citation
of a docs page's section in the code resolves to a heading, every link between the pages points at a file, and the
config snippets the pages show load; the benchmark results are an index of pages that each open with what holds today,
and every ratio or percentage the README and docs quote is one a results page holds. (The README's τ table is held by
tests/pipeline/test_demo.py.)"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest
import yaml
from support.helpers import REPO

from eaglekit.config import DRAFT_MODELS, LlamaDraft, parse_config

RESULTS = REPO / "benchmarks" / "RESULTS.md"
RESULT_PAGES = sorted((REPO / "benchmarks" / "results").glob("*.md"))
PAGES = [
    REPO / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
    *sorted((REPO / "benchmarks").glob("*.md")),
    *RESULT_PAGES,
]
# Where the code cites the pages: source, tests, benchmarks, scripts, CI, and the pages themselves.
CITING = [
    *(REPO / "src").rglob("*.py"),
    *(REPO / "tests").rglob("*.py"),
    *(REPO / "benchmarks").glob("*.py"),
    *(REPO / "benchmarks").glob("*.sh"),
    *(REPO / "scripts").glob("*.sh"),
    *(REPO / ".ci").iterdir(),
    *PAGES,
]
# `docs/verify.md: "Tolerances"`, `README, "Two commands"`, `docs/formats.md §9`: a page, then a quoted heading (its
# start) or a numbered section. The page is a path from the repository root.
CITATION = re.compile(
    r"(?<![\w/.-])(README\.md|README|docs/[\w.-]+\.md|benchmarks/(?:results/)?[\w.-]+\.md)`?(?:'s)?"
    r"(?:[,:]\s*(?:\"([A-Z`][^\"\n]*)\"|'([A-Z`][^'\n]*)')|\s?§\s?(\d+))?"
)
# A link between the pages, and the quoted heading that may follow it: [verify.md](verify.md), "Tolerances".
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)(?:[,:]\s*\"([A-Z`][^\"\n]*)\")?")


def headings(page: Path) -> list[str]:
    """The page's markdown headings, outside fenced code blocks, without their #s."""
    found, fenced = [], False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#+\s+(.*)", line)):
            found.append(m.group(1).strip())
    return found


def citations(text: str) -> list[tuple[str, str | None, str | None]]:
    """(page, quoted heading start, section number) for each citation of a page in text."""
    out = []
    for m in CITATION.finditer(text):
        page = "README.md" if m.group(1) == "README" else m.group(1)
        out.append((page, m.group(2) or m.group(3), m.group(4)))
    return out


def unresolved(page: str, heading: str | None, number: str | None) -> str | None:
    path = REPO / page
    if not path.exists():
        return f"{page} does not exist"
    if heading is None and number is None:
        return None
    found = headings(path)
    if number is not None:
        return None if any(h.startswith(f"{number}.") for h in found) else f"{page} has no section §{number}"
    return None if any(h.startswith(heading) for h in found) else f'{page} has no heading starting "{heading}"'


def test_citations_parse_page_heading_and_section():
    text = """see docs/verify.md: 'Tolerances' and (README, "Two commands"); docs/formats.md §9, `benchmarks/results/levers.md`,
    "The lever table"; benchmarks/RESULTS.md; export/README.md is a file a run writes, not a citation"""
    assert citations(text) == [
        ("docs/verify.md", "Tolerances", None),
        ("README.md", "Two commands", None),
        ("docs/formats.md", None, "9"),
        ("benchmarks/results/levers.md", "The lever table", None),
        ("benchmarks/RESULTS.md", None, None),
    ]
    assert unresolved("docs/verify.md", "Tolerances", None) is None
    assert unresolved("docs/verify.md", "Verify in your engine", None) is None  # the page's title counts
    assert unresolved("README.md", "Long context", None) == 'README.md has no heading starting "Long context"'
    assert unresolved("docs/formats.md", None, "99") == "docs/formats.md has no section §99"
    nowhere = "docs/" + "nowhere.md"  # spelled apart, so that this file cites no missing page
    assert unresolved(nowhere, None, None) == f"{nowhere} does not exist"


def test_every_citation_of_a_page_resolves():
    """A section that moves or is renamed takes its citations with it: an error message or a comment that sends the
    reader to a heading that no longer exists fails here, naming the file and line."""
    dangling = []
    for file in CITING:
        if not file.is_file():
            continue
        for n, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
            for cited in citations(line):
                if problem := unresolved(*cited):
                    dangling.append(f"{file.relative_to(REPO)}:{n}: {problem}")
    assert not dangling, "\n".join(dangling)


def test_the_code_cites_a_page_by_its_path():
    """ "README: Long context" can only be checked when it names a file and quotes a heading; a bare README in the
    source is a citation nobody can follow once the section moves (README.md, the file a run writes, is fine)."""
    bare = [
        f"{file.relative_to(REPO)}:{n}"
        for file in (REPO / "src").rglob("*.py")
        for n, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1)
        if re.search(r"\bREADME\b(?!\.md)", line)
    ]
    assert not bare, f"cite the docs page and heading instead, e.g. docs/verify.md: 'Tolerances': {bare}"


def test_every_link_between_the_pages_points_at_a_file_and_heading():
    broken = []
    for page in PAGES:
        for target, heading in LINK.findall(page.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            path = (page.parent / target).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(REPO)}: ({target}) does not exist")
            elif heading and not any(h.startswith(heading) for h in headings(path)):
                broken.append(f'{page.relative_to(REPO)}: ({target}) has no heading starting "{heading}"')
    assert not broken, broken


def test_every_results_page_is_in_the_index():
    """benchmarks/RESULTS.md is an index of one page per subject: a page it does not link is a page nobody finds."""
    index = RESULTS.read_text(encoding="utf-8")
    assert RESULT_PAGES, "benchmarks/results/ holds no page"
    assert [p.name for p in RESULT_PAGES if f"](results/{p.name})" not in index] == []


def table_rows(lines: list[str]) -> list[list[str]]:
    """The cells of the first markdown table in lines, its header first, the |---| line left out."""
    rows, started = [], False
    for line in lines:
        if line.startswith("|"):
            started = True
            if not re.fullmatch(r"\|[\s|:-]+\|", line.strip()):
                rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
        elif started:
            break
    return rows


def what_holds_today(page: Path) -> list[dict[str, str]]:
    """The rows of the table a results page opens with, under its first section, "What holds today"."""
    lines = page.read_text(encoding="utf-8").splitlines()
    sections = [n for n, line in enumerate(lines) if line.startswith("## ")]
    assert sections and lines[sections[0]] == "## What holds today", f"{page.name}: its first section is not that"
    end = sections[1] if len(sections) > 1 else len(lines)
    header, *rows = table_rows(lines[sections[0] + 1 : end]) or [[]]
    assert {"figure", "value", "command", "commit", "machine"} <= set(header), f"{page.name}: columns {header}"
    return [dict(zip(header, row, strict=True)) for row in rows]


def test_each_results_page_opens_with_what_holds_today():
    """A reader of a results page sees first what stands today, each figure with the command that gives it, the
    commit and the machine; the measurements follow. A commit named there is one of this repository's."""
    commits = set()
    for page in RESULT_PAGES:
        rows = what_holds_today(page)
        assert rows, f"{page.name}: no figure under What holds today"
        for row in rows:
            assert row["figure"] and row["value"] and row["command"] and row["machine"], (page.name, row)
            named = re.findall(r"\b[0-9a-f]{7,40}\b", row["commit"])
            assert named, f"{page.name}: no commit for {row['figure']!r}"
            commits.update(named)
    git = shutil.which("git")
    if git is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: the commits cannot be looked up")
    shallow = subprocess.run([git, "rev-parse", "--is-shallow-repository"], cwd=REPO, capture_output=True, text=True)
    if shallow.stdout.strip() != "false":
        pytest.skip("a shallow clone: older commits are not here")
    missing = [
        c
        for c in sorted(commits)
        if subprocess.run([git, "cat-file", "-e", f"{c}^{{commit}}"], cwd=REPO, capture_output=True).returncode
    ]
    assert not missing, f"commits named in What holds today that this repository does not have: {missing}"


# A number, and a run of them as the pages write ranges and pairs: 96.5 % / 96.5 %, ×0.24–0.37, 82–85 %.
NUMBER = r"\d+(?:\.\d+)?"
QUOTED = {
    "%": re.compile(rf"({NUMBER}(?:\s?[–/]\s?{NUMBER})*)\s?%"),
    "×": re.compile(rf"×({NUMBER}(?:\s?[–/]\s?×?{NUMBER})*)"),
}
HELD = {
    "%": re.compile(rf"({NUMBER}(?:\s?(?:–|/|,|and|or|to)\s?{NUMBER})*)\s?%"),
    "×": re.compile(rf"×\s?({NUMBER}(?:\s?[–/,]\s?×?{NUMBER})*)"),
}
# Percentages the pages quote that are no measurement: a rule of the code, a line of the demo's own output.
NOT_MEASURED = {
    ("docs/features.md", "90%"): "pre-flight refuses a spool_gb above 90% of the Mooncake segments (a rule)",
    (
        "docs/preflight.md",
        "17.5%",
    ): "the demo's pre-flight output: its prompts file repeats rows (printed, not measured)",
}


def quoted_figures(page: Path) -> list[tuple[int, str, str]]:
    """(line, number, kind) for each percentage and ratio (×) the page quotes outside code blocks."""
    found, fenced = [], False
    for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        for kind, pattern in QUOTED.items():
            found += [(n, number, kind) for m in pattern.finditer(line) for number in re.findall(NUMBER, m.group(1))]
    return found


def rounds_to(quoted: str, candidates: set[str]) -> bool:
    places = Decimal(1).scaleb(-len(quoted.partition(".")[2]))
    return any(Decimal(c).quantize(places, rounding=ROUND_HALF_UP) == Decimal(quoted) for c in candidates)


def test_every_figure_the_readme_and_docs_quote_is_held_by_a_results_page():
    """A percentage or a ratio the README or a docs page quotes is one that a results page holds, at the precision
    quoted (96.5 % stands for 96.5 %, 55 % for 55.3 %), so a figure whose measurement moved or was dropped fails
    here. docs/config.md is generated from the code and docs/architecture.md quotes no measurement."""
    results = " ".join(page.read_text(encoding="utf-8") for page in RESULT_PAGES)
    held = {kind: {n for m in p.finditer(results) for n in re.findall(NUMBER, m.group(1))} for kind, p in HELD.items()}
    quoting = [
        REPO / "README.md",
        *(p for p in sorted((REPO / "docs").glob("*.md")) if p.name not in ("config.md", "architecture.md")),
    ]
    unheld = [
        f"{page.relative_to(REPO)}:{n}: {number}{kind}"
        for page in quoting
        for n, number, kind in quoted_figures(page)
        if not rounds_to(number, held[kind]) and (str(page.relative_to(REPO)), f"{number}{kind}") not in NOT_MEASURED
    ]
    assert not unheld, (
        "figures no page of benchmarks/results/ holds (add the measurement there, or drop the figure):\n"
        + "\n".join(unheld)
    )


def test_every_docs_page_is_linked_from_the_readme():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert [p.name for p in (REPO / "docs").glob("*.md") if f"](docs/{p.name})" not in readme] == []


def test_ci_runs_the_readmes_test_command_byte_for_byte():
    """.ci/run says it runs exactly the README's test command; the README's "Two commands" block shows it."""
    ci = [
        line
        for line in (REPO / ".ci" / "run").read_text().splitlines()
        if line and not line.startswith(("#", "set ", "cd "))
    ]
    assert len(ci) == 1, ci
    section = (REPO / "README.md").read_text(encoding="utf-8").split("## Two commands", 1)[1].split("\n## ", 1)[0]
    commands = [
        line.split("  #", 1)[0].rstrip() for line in re.findall(r"```bash\n(.*?)```", section, re.S)[0].splitlines()
    ]
    assert ci[0] in commands, (ci[0], commands)


def yaml_snippets() -> list:
    """Each ```yaml block of the pages, as a pytest param named by its page and line."""
    snippets = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for m in re.finditer(r"```yaml\n(.*?)```", text, re.S):
            where = f"{page.relative_to(REPO)}:{text[: m.start()].count(chr(10)) + 2}"
            snippets.append(pytest.param(where, m.group(1), id=where))
    return snippets


@pytest.mark.parametrize(("where", "snippet"), yaml_snippets())
def test_the_config_snippets_the_pages_show_load(where, snippet, tmp_path):
    """A snippet is a whole config (it has `run_dir`) or sections to add to one; either way every key in it is a key
    the config accepts, with a value it accepts."""
    data = yaml.safe_load(snippet)
    if "run_dir" not in data:
        data = {"run_dir": "runs/r", "target": {"model": "/models/t"}, "data": {"prompts": "p.jsonl"}, **data}
    parse_config(data, where, tmp_path)


def _config_reference():
    """scripts/config_reference.py, loaded as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("config_reference", REPO / "scripts" / "config_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_config_reference_is_what_the_models_say(monkeypatch):
    """docs/config.md's key reference is what scripts/config_reference.py makes of config.py's models: every key of
    every section, and train.draft's keys with the families that read them. A key added, removed or described
    anew in config.py fails here until the script is run."""
    reference = _config_reference()
    page = reference.PAGE.read_text(encoding="utf-8")
    assert reference.updated(page) == page, "docs/config.md is out of date: run python scripts/config_reference.py"
    block = page.split(reference.BEGIN)[1].split(reference.END)[0]
    for name, model in DRAFT_MODELS.items():
        for key in model.model_fields:
            rows = [line.split("|")[2] for line in block.splitlines() if line.startswith(f"| `{key}` |")]
            assert any(name in families or families.strip() == "all" for families in rows), (name, key)
    assert "| `markov_rank` | dspark |" in block and "| `norm_before_fc` | peagle, llama |" in block
    assert "| `steps` | int, ≥ 1 | `7` |" in block  # train.ttt's, with its bound and default
    field = LlamaDraft.model_fields["norm_before_fc"]
    monkeypatch.setattr(field, "description", field.description + " (reworded)")
    assert reference.updated(page) != page  # the page no longer says what the model does
