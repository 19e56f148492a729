"""The import rules of ARCHITECTURE.md: which package may import which, and no import cycles inside mmoe.

Imports are read from the source (``ast``), function-level ones included, so a lazy import hides neither a breach nor
a cycle. mmoe uses no relative imports.
"""

from __future__ import annotations

import ast
import re
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


#: The layers on top: the pipeline kit, the commands, the demo, the claims study, inference and the harness adapters.
TOP = ("mmoe.pipeline", "mmoe.demo", "mmoe.study", "mmoe.infer", "mmoe.cli", "mmoe.commands", "mmoe.harness")

#: The training house, bottom up: what every run has, the tasks, how a run is configured.
TRAINING = ("mmoe.runtime", "mmoe.tasks", "mmoe.config")

#: Rule -> (the package it holds for, the packages it never imports, its modules the rule leaves out).
RULES: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "mmoe.moe is the bottom layer": (
        "mmoe.moe",
        ("mmoe.model", "mmoe.data", "mmoe.metrics", "mmoe.viz", *TRAINING, *TOP, *LIGHTNING),
        (),
    ),
    "mmoe.model builds on mmoe.moe only": (
        "mmoe.model",
        ("mmoe.data", "mmoe.metrics", "mmoe.viz", *TRAINING, *TOP, *LIGHTNING),
        (),
    ),
    "mmoe.metrics are functions over records and predictions": (
        "mmoe.metrics",
        ("mmoe.model", "mmoe.viz", *TRAINING, *TOP, *LIGHTNING),
        (),
    ),
    "mmoe.data knows no model, task or figure": (
        "mmoe.data",
        ("mmoe.model", "mmoe.viz", *TRAINING, *TOP, *LIGHTNING),
        ("mmoe.data.datamodules",),
    ),
    "mmoe.routing draws pixels with numpy alone": (
        "mmoe.routing",
        ("matplotlib", "mmoe.moe", "mmoe.model", "mmoe.data", "mmoe.metrics", "mmoe.viz", *TRAINING, *TOP, *LIGHTNING),
        (),
    ),
    "mmoe.viz reads backbones through their public API": (
        "mmoe.viz",
        ("mmoe.model.layers", "mmoe.tasks", "mmoe.config", *TOP, *LIGHTNING),
        (),
    ),
    "mmoe.runtime knows no task, config or figure": (
        "mmoe.runtime",
        ("mmoe.tasks", "mmoe.config", "mmoe.viz", "matplotlib", *TOP),
        (),
    ),
    "mmoe.timm builds on the model alone": (
        "mmoe.timm",
        ("mmoe.data", "mmoe.metrics", *TRAINING, *TOP, *LIGHTNING),
        (),
    ),
    "mmoe.tasks are not configured, drawn or run by a pipeline": ("mmoe.tasks", ("mmoe.config", "mmoe.viz", *TOP), ()),
    "mmoe.config runs no pipeline and draws nothing": ("mmoe.config", ("mmoe.viz", *TOP), ()),
    "the pipeline kit knows no recipe": (
        "mmoe.pipeline",
        ("mmoe.demo", "mmoe.study", "mmoe.infer", "mmoe.cli", "mmoe.commands"),
        (),
    ),
    "the demo does not run the study": ("mmoe.demo", ("mmoe.study",), ()),
    "the study does not run the demo": ("mmoe.study", ("mmoe.demo",), ()),
}


@pytest.mark.parametrize("rule", RULES)
def test_import_rule(rule):
    layer, forbidden, allowed_in = RULES[rule]
    assert breaches(layer, forbidden, allowed_in) == []


ARCHITECTURE = PACKAGE.parent / "ARCHITECTURE.md"

#: Where code outside the package lives, and the folders allowed to import the demo (its own tests).
OUTSIDE = ("scripts", "benchmarks", "tests")
DEMO_TESTS = PACKAGE.parent / "tests" / "demo"


def test_scripts_benchmarks_and_tests_reach_the_pipeline_through_the_kit():
    """Scripts, benchmarks and test helpers import :mod:`mmoe.pipeline`, never the demo's or the study's recipe
    modules (the demo's own tests aside)."""
    outside = [
        f"{path.relative_to(PACKAGE.parent)} imports {name}"
        for folder in OUTSIDE
        for path in sorted((PACKAGE.parent / folder).rglob("*.py"))
        if DEMO_TESTS not in path.parents
        for name in sorted(imports(path))
        if within(name, "mmoe.demo")
    ]
    assert outside == []


def layer_table() -> list[tuple[int, list[str], str]]:
    """ARCHITECTURE.md's layer table: (layer, packages or modules, "may import" cell) per row."""
    rows = []
    for line in ARCHITECTURE.read_text().split("## Where each paper equation lives")[0].splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].isdigit():
            rows.append((int(cells[0]), re.findall(r"`(mmoe[\w.]*)`", cells[1]), cells[3]))
    return rows


def allowed_imports(rows: list[tuple[int, list[str], str]]) -> dict[str, tuple[str, ...]]:
    """Package or module -> the mmoe packages and modules it may import, read from the "may import" cells:
    backticked names, ``layer 0``, ``everything below``, ``everything``, or plain package names (``data``);
    parentheses are comments."""
    layer_of = {name: layer for layer, names, _ in rows for name in names}
    allowed = {}
    for layer, names, cell in rows:
        cell = re.sub(r"\([^)]*\)", "", cell)
        if cell.strip() == "everything":
            may = ("mmoe",)
        else:
            may = tuple(re.findall(r"`(mmoe[\w.]*)`", cell))
            words = re.sub(r"`[^`]*`", "", cell)
            if "everything below" in words:
                may += tuple(name for name, other in layer_of.items() if other < layer)
            if "layer 0" in words:
                may += tuple(name for name, other in layer_of.items() if other == 0)
            may += tuple(
                f"mmoe.{word}" for word in re.findall(r"\b(data|metrics|model|moe|runtime|tasks|config|viz)\b", words)
            )
        for name in names:
            allowed[name] = (name, *may)
    return allowed


ALLOWED = allowed_imports(layer_table())


def owner(module: str) -> str:
    """The ARCHITECTURE.md row a module belongs to (the longest package or module name containing it)."""
    return max((name for name in ALLOWED if within(module, name)), key=len)


def test_every_module_of_mmoe_has_a_row_in_architecture_md():
    rows = [module for module in MODULES if module != "mmoe" and not any(within(module, name) for name in ALLOWED)]
    assert rows == []


def test_every_import_is_allowed_by_its_may_import_cell():
    """The "may import" cells are allow-lists: an mmoe import outside a module's cell (layer 0 included) fails."""
    outside = [
        f"{module} imports {name}"
        for module, every in MODULES.items()
        if module != "mmoe"
        for name in sorted(every)
        if name.startswith("mmoe.") and name in MODULES and not within(name, *ALLOWED[owner(module)])
    ]
    assert outside == []


def test_the_allow_lists_see_a_breach():
    MODULES["mmoe.io.example"] = {"mmoe.tasks.base"}
    MODULES["mmoe.viz.example"] = {"mmoe.model.layers", "mmoe.runtime.checkpoint"}
    try:
        assert not within("mmoe.tasks.base", *ALLOWED[owner("mmoe.io.example")])
        assert not within("mmoe.model.layers", *ALLOWED[owner("mmoe.viz.example")])
        assert within("mmoe.runtime.checkpoint", *ALLOWED[owner("mmoe.viz.example")])
    finally:
        del MODULES["mmoe.io.example"], MODULES["mmoe.viz.example"]


def package_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_no_import_cycles_between_mmoe_packages():
    """Packages (``mmoe.data``, ``mmoe.metrics``, ...) import each other in one direction only."""
    edges = {
        (package_of(module), package_of(name))
        for module, every in MODULES.items()
        for name in every
        if name in MODULES and package_of(name) != package_of(module)
    }
    assert sorted(f"{a} <-> {b}" for a, b in edges if (b, a) in edges and a < b) == []


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
        MODULES["mmoe.runtime.example"] = {"mmoe.tasks.base", "mmoe.model"}
        assert breaches("mmoe.runtime", RULES["mmoe.runtime knows no task, config or figure"][1]) == [
            "mmoe.runtime.example imports mmoe.tasks.base"
        ]
    finally:
        del MODULES["mmoe.moe.example"]
        MODULES.pop("mmoe.runtime.example", None)


#: The size limits of ``mmoe``: lines per module, lines per function (its docstring included) and ``# fmt: skip``
#: lines, which only a table that reads better aligned may take (ARCHITECTURE.md, STYLE.md).
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_FORMAT_SKIPS = 400, 60, 30


def sources() -> dict[str, str]:
    return {str(path.relative_to(PACKAGE.parent)): path.read_text() for path in sorted(PACKAGE.rglob("*.py"))}


def test_modules_and_functions_stay_within_their_sizes():
    lines = {name: text.count("\n") for name, text in sources().items()}
    long_modules = [f"{name}: {count} lines" for name, count in lines.items() if count > MAX_MODULE_LINES]
    long_functions = [
        f"{name}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines"
        for name, text in sources().items()
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert (long_modules, long_functions) == ([], [])


def test_the_formatter_is_switched_off_for_tables_only():
    skips = sum(text.count("# fmt: skip") for text in sources().values())
    assert skips <= MAX_FORMAT_SKIPS, f"{skips} '# fmt: skip' lines in mmoe/: split at a seam instead"


#: Where a dict with LightningCLI's ``init_args`` key may be written: the config package (a RunSpec's options), and
#: the ``task`` entry of an ``mmoe export`` folder's ``config.json`` (a file format of its own, read by the catalog).
INIT_ARGS_WRITERS = ("mmoe.config", "mmoe.commands.export")


def init_args_writers(modules: dict[str, str]) -> list[str]:
    """``module:line`` of each dict literal with an ``init_args`` key in ``modules`` (name -> source)."""
    return [
        f"{module}:{node.lineno}"
        for module, text in modules.items()
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.Dict)
        and any(isinstance(key, ast.Constant) and key.value == "init_args" for key in node.keys)
    ]


def test_only_the_config_package_writes_lightning_cli_s_init_args():
    modules = {module_name(path): path.read_text() for path in sorted(PACKAGE.rglob("*.py"))}
    outside = [place for place in init_args_writers(modules) if not within(place.split(":")[0], *INIT_ARGS_WRITERS)]
    assert outside == []
    launch = {"mmoe.pipeline.example": 'overrides = {"model": {"init_args": {"optimizer": {"learning_rate": 1.0}}}}'}
    assert init_args_writers(launch) == ["mmoe.pipeline.example:1"]  # the check sees such a dict
