"""Imports point one way: a module imports only from its own layer or the layers below it, and no stage imports
another stage. The order is written down once, here, and explained in docs/architecture.md."""

from __future__ import annotations

import ast
from pathlib import Path

import eaglekit

PACKAGE = Path(eaglekit.__file__).parent

# lowest first; a module may import from its own layer and any layer before it
LAYERS = [
    {"errors", "atomic", "config", "divergences", "progress", "interrupt", "rundir", "plots", "contract"},
    {"data", "model", "tiny"},
    {"serving", "speculative", "training", "drafters"},
    {"preflight"},
    {"stages"},
    {"planning", "status", "failures", "pipeline"},
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
    assert not unplaced, f"add these to LAYERS in tests/test_imports.py (and docs/architecture.md): {sorted(unplaced)}"


def test_no_stage_imports_another_stage():
    bad = [
        f"{m} imports {i}"
        for p, m in modules()
        if m.startswith("eaglekit.stages.")
        for i in imported(p, m)
        if i.startswith("eaglekit.stages.") and i != m
    ]
    assert not bad, "a stage imports a stage (move what they share below stages/):\n" + "\n".join(bad)


def test_imports_point_down():
    bad = []
    for p, m in modules():
        own = layer_of(m)
        for i in imported(p, m):
            theirs = layer_of(i)
            if own is not None and theirs is not None and theirs > own:
                bad.append(f"{m} (layer {own}) imports {i} (layer {theirs})")
    assert not bad, "imports from a lower layer to a higher one:\n" + "\n".join(sorted(bad))


def test_the_check_sees_imports_inside_functions(tmp_path):
    source = tmp_path / "x.py"
    source.write_text("def f():\n    from eaglekit.stages import evaluate\n    import eaglekit.cli\n")
    assert imported(source, "eaglekit.data.x") == {"eaglekit.stages.evaluate", "eaglekit.cli"}
