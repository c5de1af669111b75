"""Imports point one way: a module imports only from its own layer or the layers below it, and no stage imports
another stage. The order is written down once, here, and explained in docs/architecture.md."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.helpers import subprocess_env, write_config

import eaglekit

PACKAGE = Path(eaglekit.__file__).parent

# lowest first; a module may import from its own layer and any layer before it
LAYERS = [
    {"errors", "atomic", "config", "divergences", "progress", "interrupt", "rundir", "plots", "hub"},
    {"data", "model", "tiny", "resolved", "contract"},
    {"serving", "speculative", "training"},
    {"drafters"},  # the families, assembled from the generic parts below them
    {"preflight"},
    {"stages"},
    {"planning", "status", "failures", "pipeline", "watch", "adapt", "publish"},
    {"cli", "demo"},
]


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "eaglekit" or len(parts) < 2:
        return None
    return next((i for i, names in enumerate(LAYERS) if parts[1] in names), None)


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imported(path: Path, module: str) -> set[str]:
    """Every eaglekit module ``path`` imports, at the top or inside a function."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            # `from eaglekit.stages import evaluate` imports the module eaglekit.stages.evaluate
            out |= {
                f"{base}.{a.name}"
                if (PACKAGE.parent / f"{base}.{a.name}".replace(".", "/")).with_suffix(".py").exists()
                or (PACKAGE.parent / f"{base}.{a.name}".replace(".", "/")).is_dir()
                else base
                for a in node.names
            }
    return {m for m in out if m.startswith("eaglekit")}


def modules() -> list[tuple[Path, str]]:
    return [(p, module_name(p)) for p in sorted(PACKAGE.rglob("*.py")) if "vllm_plugin" not in p.parts]


def test_every_package_has_a_layer():
    unplaced = {m.split(".")[1] for _, m in modules() if m != "eaglekit" and layer_of(m) is None}
    assert not unplaced, (
        f"add these to LAYERS in tests/unit/test_imports.py (and docs/architecture.md): {sorted(unplaced)}"
    )


def test_no_stage_imports_another_stage():
    bad = [
        f"{m} imports {i}"
        for p, m in modules()
        if m.startswith("eaglekit.stages.")
        for i in imported(p, m)
        if i.startswith("eaglekit.stages.") and i != m
    ]
    assert not bad, "a stage imports a stage (move what they share below stages/):\n" + "\n".join(bad)


def upward(imports: dict[str, set[str]]) -> list[str]:
    """Each import, of ``imports`` (module -> the modules it imports), from a lower layer to a higher one."""
    bad = []
    for m, names in imports.items():
        own = layer_of(m)
        for i in names:
            theirs = layer_of(i)
            if own is not None and theirs is not None and theirs > own:
                bad.append(f"{m} (layer {own}) imports {i} (layer {theirs})")
    return sorted(bad)


def mutual(imports: dict[str, set[str]]) -> list[str]:
    """Each pair of packages that import each other (in either direction, by any of their modules)."""

    def package(module: str) -> str:
        return module.split(".")[1] if "." in module else module

    edges = {(package(m), package(i)) for m, names in imports.items() for i in names if package(m) != package(i)}
    return sorted(f"{a} <-> {b}" for a, b in edges if a < b and (b, a) in edges)


def the_tree() -> dict[str, set[str]]:
    return {m: imported(p, m) for p, m in modules()}


def test_imports_point_down():
    bad = upward(the_tree())
    assert not bad, "imports from a lower layer to a higher one:\n" + "\n".join(bad)


def test_no_two_packages_import_each_other():
    pairs = mutual(the_tree())
    assert not pairs, "packages importing each other (move what they share into the lower one):\n" + "\n".join(pairs)


def test_the_checks_refuse_an_upward_import_and_a_cycle():
    """What a change that broke the order would meet: the training loop looking its family up in the registry (the
    drafters sit above training), and two packages of one layer importing each other."""
    loop_asks = {"eaglekit.training.loop": {"eaglekit.drafters.registry", "eaglekit.training.data"}}
    assert upward(loop_asks) == [
        f"eaglekit.training.loop (layer {layer_of('eaglekit.training')}) imports eaglekit.drafters.registry "
        f"(layer {layer_of('eaglekit.drafters')})"
    ]
    assert mutual({"eaglekit.data.chat": {"eaglekit.model.target"}, "eaglekit.model.x": {"eaglekit.data.vocab"}}) == [
        "data <-> model"
    ]


def test_the_check_sees_imports_inside_functions(tmp_path):
    source = tmp_path / "x.py"
    source.write_text("def f():\n    from eaglekit.stages import evaluate\n    import eaglekit.cli\n")
    assert imported(source, "eaglekit.data.x") == {"eaglekit.stages.evaluate", "eaglekit.cli"}


# An import inside a function says why it is not at the top, in one form: heavy (what it would cost every command,
# `eaglekit --help` included), optional (a module that may be absent) or cycle (the modules that would import each
# other).
LAZY_MARKER = re.compile(r"# lazy: (heavy|optional|cycle) \(.+\)")
# Modules `eaglekit --help` must never pay for, whoever comes to import them: seconds each, or a second engine.
NEVER_AT_HELP = (
    "transformers",
    "datasets",
    "matplotlib",
    "pyarrow",
    "huggingface_hub",
    "vllm",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
)


def function_level_imports(path: Path) -> list[ast.Import | ast.ImportFrom]:
    """The imports inside functions, those under `if TYPE_CHECKING:` aside (they never run)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                if in_function:
                    found.append(child)
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            else:
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


def marker_of(path: Path, node: ast.stmt) -> str | None:
    lines = path.read_text().splitlines()[node.lineno - 1 : node.end_lineno]
    return next((m.group(0) for line in lines if (m := LAZY_MARKER.search(line))), None)


def is_module(name: str) -> bool:
    path = PACKAGE.parent / name.replace(".", "/")
    return path.with_suffix(".py").exists() or path.is_dir()


def lazily_heavy(torch_too: bool = True) -> set[str]:
    """Every module some function imports lazily because it is heavy (`from eaglekit import plots`: eaglekit.plots);
    without ``torch_too``, those deferred for torch alone (`# lazy: heavy (torch...)`), which the stages carry."""
    out = set()
    for p, _ in modules():
        for node in function_level_imports(p):
            marker = marker_of(p, node) or ""
            if not marker.startswith("# lazy: heavy") or (not torch_too and marker.startswith("# lazy: heavy (torch")):
                continue
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names}
            else:
                base = node.module or ""
                out |= {f"{base}.{a.name}" if is_module(f"{base}.{a.name}") else base for a in node.names}
    return out


def test_imports_inside_functions_say_why():
    unmarked = [
        f"{p.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)}"
        for p, _ in modules()
        for node in function_level_imports(p)
        if marker_of(p, node) is None
    ]
    assert not unmarked, (
        "imports inside functions go to the top of the module, or say why not with "
        "'# lazy: heavy|optional|cycle (why)':\n" + "\n".join(unmarked)
    )


def test_every_stage_has_its_own_summary_in_the_list_of_commands():
    from eaglekit import cli, pipeline

    assert list(cli.STAGE_SUMMARIES) == list(pipeline.STAGE_ORDER)
    assert len(set(cli.STAGE_SUMMARIES.values())) == len(pipeline.STAGE_ORDER)


def help_loads(argvs: list[list[str]], heavy: list[str]) -> tuple[str, list[str]]:
    """Run `eaglekit ARGV` for each of ``argvs`` in one fresh interpreter: what it printed, and which of ``heavy``
    it had loaded by the end."""
    code = (
        "import json, sys\n"
        "from eaglekit.cli import main\n"
        f"for argv in {argvs!r}:\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        f"print(json.dumps([m for m in {heavy!r} if m in sys.modules]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(), timeout=300, check=True
    )
    return out.stdout + out.stderr, json.loads(out.stdout.splitlines()[-1])


def test_help_loads_no_heavy_module():
    """`eaglekit --help` lists the commands without importing a stage: it loads nothing a function imports lazily for
    its weight (torch among them), nor the list above."""
    printed, loaded = help_loads([["--help"]], sorted(lazily_heavy() | set(NEVER_AT_HELP) | {"torch"}))
    assert "Usage" in printed, printed  # the help was printed: the check ran after it
    assert not loaded, f"`eaglekit --help` imports {loaded} (import it inside the function that needs it, marked)"


def test_the_stages_load_no_heavy_module_but_torch():
    """Every stage's command help imports its stage: the stages may carry torch (they work on tensors), but nothing
    a function imports lazily for another weight, nor the list above."""
    from eaglekit import pipeline

    argvs = [[stage, "--help"] for stage in pipeline.STAGE_ORDER]
    printed, loaded = help_loads(argvs, sorted(lazily_heavy(torch_too=False) | set(NEVER_AT_HELP)))
    assert "Reads" in printed, printed  # the help was printed: the check ran after it
    assert not loaded, f"a stage imports {loaded} (import it inside the function that needs it, marked)"


def test_the_cli_and_a_config_load_import_no_torch(tmp_path):
    """`eaglekit --help`, `--version`, usage errors and anything that only reads a config start without torch (a
    second or two): torch comes with the stage a command runs."""
    config = tmp_path / "c.yaml"
    config.write_text("run_dir: run\ntarget: {model: model}\ndata: {prompts: prompts.jsonl}\n")
    code = (
        "import json, sys\n"
        "import eaglekit.cli\n"
        "from eaglekit.config import load_config\n"
        "cfg = load_config(sys.argv[1])\n"
        "print(json.dumps([cfg.train.ttt.loss.name, [m for m in ('torch', 'transformers') if m in sys.modules]]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(config)],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=300,
        check=True,
    )
    loss, loaded = json.loads(out.stdout.splitlines()[-1])
    assert loss == "kl_div", out.stdout  # the config (and its divergences) loaded
    assert not loaded, f"importing eaglekit.cli and loading a config imports {loaded}"


def test_the_marker_check_sees_unmarked_imports(tmp_path):
    source = tmp_path / "x.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "import os\n"
        "if TYPE_CHECKING:\n    import torch\n"
        "def f():\n"
        "    import json\n"
        "    from transformers import (  # lazy: heavy (transformers)\n        AutoConfig,\n    )\n"
        "    import vllm  # lazy: vllm\n"
    )
    found = {ast.unparse(node): marker_of(source, node) for node in function_level_imports(source)}
    assert found == {
        "import json": None,
        "from transformers import AutoConfig": "# lazy: heavy (transformers)",
        "import vllm": None,  # a marker without its reason in the one form
    }


# What `eaglekit status` must never pay for: it reads the ledger and takes each stage's fingerprint over the run as
# resolved (the target's context read from its config.json), from any shell while a run goes on. Each stage's module
# is imported for its declaration, so a stage imports torch (and what imports it) in the functions that run it.
NEVER_AT_STATUS = sorted({*NEVER_AT_HELP, "torch", "safetensors.torch"})


def status_config(tmp_path: Path, target: Path) -> Path:
    """A run of the tiny target with every stage but verify (extract offline), its window chosen by auto."""
    (tmp_path / "prompts.jsonl").write_text(
        json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}]}) + "\n"
    )
    return write_config(
        tmp_path / "c.yaml",
        {
            "run_dir": "run",
            "target": {"model": str(target)},
            "data": {"prompts": "prompts.jsonl"},
            "extract": {"mode": "offline"},
        },
    )


def test_status_loads_neither_torch_nor_transformers(tmp_path, tiny_target):
    """`eaglekit status` (and --json) of a run takes every stage's fingerprint without torch or transformers."""
    config = status_config(tmp_path, tiny_target)
    printed, loaded = help_loads([["status", str(config)], ["status", str(config), "--json"]], NEVER_AT_STATUS)
    assert "extract" in printed and '"fingerprint"' in printed, printed  # both printed every stage: the check ran
    assert not loaded, f"`eaglekit status` imports {loaded} (import it inside the function that needs it, marked)"


@pytest.mark.slow
def test_status_of_the_finished_demo_loads_neither_torch_nor_transformers(demo_run):
    """The same on a run with every stage done: the recorded counts, data flags and exported drafter are read too."""
    run_dir, _, _ = demo_run
    printed, loaded = help_loads([["status", str(run_dir)], ["status", str(run_dir), "--json"]], NEVER_AT_STATUS)
    assert '"state": "done"' in printed, printed
    assert not loaded, f"`eaglekit status` of the demo imports {loaded}"
