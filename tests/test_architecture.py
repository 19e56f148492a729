"""The import rules of ARCHITECTURE.md: which package may import which, and no import cycles inside mmoe.

Imports are read from the source (``ast``), function-level ones included, so a lazy import hides neither a breach nor
a cycle. mmoe uses no relative imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mmoe"
LIGHTNING = ("lightning", "pytorch_lightning")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The imports of one file, function-level ones included, as dotted names (``from a import b`` gives ``a`` and
    ``a.b``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


MODULES = {module_name(path): imports(path) for path in sorted(PACKAGE.rglob("*.py"))}


def within(name: str, *packages: str) -> bool:
    return any(name == package or name.startswith(f"{package}.") for package in packages)


def breaches(layer: str, forbidden: tuple[str, ...], allowed_in: tuple[str, ...] = ()) -> list[str]:
    return [
        f"{module} imports {name}"
        for module, every in MODULES.items()
        if within(module, layer) and not within(module, *allowed_in)
        for name in sorted(every)
        if within(name, *forbidden)
    ]


#: The layers on top: the command, the demo, the claims study and inference.
TOP = ("mmoe.demo", "mmoe.study", "mmoe.infer", "mmoe.cli")

RULES = {
    "mmoe.moe is the bottom layer": ("mmoe.moe", ("mmoe.model", "mmoe.data", "mmoe.tasks", "mmoe.metrics", "mmoe.viz",
                                                  *TOP, *LIGHTNING), ()),
    "mmoe.model builds on mmoe.moe only": ("mmoe.model", ("mmoe.data", "mmoe.tasks", "mmoe.metrics", "mmoe.viz",
                                                          *TOP, *LIGHTNING), ()),
    "mmoe.metrics are functions over records and predictions": (
        "mmoe.metrics", ("mmoe.model", "mmoe.tasks", "mmoe.viz", *TOP, *LIGHTNING),
        ()),
    "mmoe.data knows no model, task or figure": (
        "mmoe.data", ("mmoe.model", "mmoe.tasks", "mmoe.viz", *TOP, *LIGHTNING),
        ("mmoe.data.datamodules",)),
    "mmoe.viz reads backbones through their public API": (
        "mmoe.viz", ("mmoe.model.layers", *TOP, *LIGHTNING), ()),
    "mmoe.tasks do not draw or run the demo": ("mmoe.tasks", ("mmoe.viz", "mmoe.demo", "mmoe.study", "mmoe.infer"), ()),
    "the demo does not run the study": ("mmoe.demo", ("mmoe.study",), ()),
}  # fmt: skip


@pytest.mark.parametrize("rule", RULES)
def test_import_rule(rule):
    layer, forbidden, allowed_in = RULES[rule]
    assert breaches(layer, forbidden, allowed_in) == []


def test_no_import_cycles_inside_mmoe():
    """Imports between mmoe modules, function-level ones included, form no cycle (a package's ``__init__`` counts
    as its module)."""
    graph = {
        module: {name for name in every if name in MODULES and name != module} for module, every in MODULES.items()
    }
    cycles, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_the_rules_see_a_breach():
    """The checker itself: a forbidden import in a module is reported."""
    MODULES["mmoe.moe.example"] = {"lightning", "mmoe.tasks.base"}
    try:
        assert breaches("mmoe.moe", ("mmoe.tasks", *LIGHTNING)) == [
            "mmoe.moe.example imports lightning",
            "mmoe.moe.example imports mmoe.tasks.base",
        ]
    finally:
        del MODULES["mmoe.moe.example"]
