"""Private names of torch, Lightning and jsonargparse are reached only through mmoe's adapters
(:mod:`mmoe.runtime.lightning_internals`, :mod:`mmoe.runtime.torch_internals`, checked against the installed versions by
``tests/tasks/test_lightning_internals.py``), so no new use can creep in unchecked.

Read from the source of ``mmoe/``, ``scripts/`` and ``benchmarks/``: an import of a ``_`` name or from a ``_`` module
of those libraries, an attribute chain from one of their names through a ``_`` attribute
(``torch._foreach_norm``), a method of a class that overrides or calls a ``_`` method of a library base class
(``self._get``, ``def _run_subcommand``), and any use of a ``_`` name the adapters reach.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("mmoe", "scripts", "benchmarks")
ADAPTERS = ("mmoe/runtime/lightning_internals.py", "mmoe/runtime/torch_internals.py")
LIBRARIES = ("torch", "lightning", "lightning_fabric", "pytorch_lightning", "jsonargparse")

#: Uses in ``mmoe.moe``, below the adapters (it never imports ``mmoe.tasks``), each guarded or documented where it is.
BELOW_THE_ADAPTERS = {
    ("mmoe/moe/experts.py", "torch._grouped_mm"),
    ("mmoe/moe/expert_parallel.py", "import torch.distributed._functional_collectives"),
    ("mmoe/moe/scorers/xmoe.py", "torch.nn.modules.module.Module._register_load_state_dict_pre_hook"),
}


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def from_library(module: str) -> bool:
    return module.split(".")[0] in LIBRARIES


def python_files() -> Iterator[Path]:
    for folder in SCANNED:
        yield from sorted((ROOT / folder).rglob("*.py"))


def library_names(tree: ast.Module) -> set[str]:
    """The names a module binds to torch, Lightning or jsonargparse objects by importing them."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.asname or alias.name.split(".")[0] for alias in node.names if from_library(alias.name)}
        elif isinstance(node, ast.ImportFrom) and node.module and from_library(node.module):
            names |= {alias.asname or alias.name for alias in node.names}
    return names


def private_imports(tree: ast.Module) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if from_library(alias.name) and any(map(is_private, alias.name.split("."))):
                    yield f"import {alias.name}"
        elif isinstance(node, ast.ImportFrom) and node.module and from_library(node.module):
            for alias in node.names:
                if any(map(is_private, [*node.module.split("."), alias.name])):
                    yield f"from {node.module} import {alias.name}"


def private_library_chains(tree: ast.Module) -> Iterator[str]:
    """``torch._foreach_norm``-like chains: from a library name through a ``_`` attribute."""
    roots = library_names(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            chain = ast.unparse(node)
            if chain.split(".")[0] in roots:
                yield chain


def class_private_names(cls_node: ast.ClassDef) -> set[str]:
    """The ``_`` names a class defines as methods or reaches through ``self``, ``cls`` or ``super()``."""
    names = {item.name for item in cls_node.body if isinstance(item, ast.FunctionDef) and is_private(item.name)}
    for node in ast.walk(cls_node):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id in ("self", "cls")) or (
                isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super"
            ):
                names.add(node.attr)
    return names


def inherited_private_names(path: Path, tree: ast.Module) -> Iterator[str]:
    """``Base._name`` for each ``_`` name a module's class overrides or reaches that a library base class defines."""
    classes = [node for node in tree.body if isinstance(node, ast.ClassDef) and class_private_names(node)]
    if not classes or path.parts[len(ROOT.parts)] != "mmoe":
        return
    module = importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts))
    for node in classes:
        cls = getattr(module, node.name)
        for name in sorted(class_private_names(node)):
            for base in inspect.getmro(cls)[1:]:
                if from_library(base.__module__) and name in vars(base):
                    yield f"{base.__module__}.{base.__qualname__}.{name}"
                    break


def adapter_private_names() -> set[str]:
    """Every ``_`` name the adapters reach: attributes, method overrides and imported names."""
    names = set()
    for adapter in ADAPTERS:
        tree = ast.parse((ROOT / adapter).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and is_private(node.attr):
                names.add(node.attr)
            elif isinstance(node, ast.FunctionDef) and is_private(node.name):
                names.add(node.name)
            elif isinstance(node, ast.ImportFrom):
                names |= {alias.name for alias in node.names if is_private(alias.name)}
    return names


def adapter_names_used(tree: ast.Module, adapted: set[str]) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in adapted:
            yield f".{node.attr}"
        elif isinstance(node, ast.FunctionDef) and node.name in adapted:
            yield f"def {node.name}"
        elif isinstance(node, ast.ImportFrom):
            yield from (f"import {alias.name}" for alias in node.names if alias.name in adapted)


def private_uses() -> set[tuple[str, str]]:
    adapted = adapter_private_names()
    uses = set()
    for path in python_files():
        relative = path.relative_to(ROOT).as_posix()
        if relative in ADAPTERS:
            continue
        tree = ast.parse(path.read_text(), filename=relative)
        found = [
            *private_imports(tree),
            *private_library_chains(tree),
            *inherited_private_names(path, tree),
            *adapter_names_used(tree, adapted),
        ]
        uses |= {(relative, what) for what in found}
    return uses


def test_the_adapters_reach_the_private_names_mmoe_relies_on():
    assert {"_run_subcommand", "_signal_connector", "_version", "_SignalConnector"} <= adapter_private_names()


def test_no_module_outside_the_adapters_reaches_a_private_library_name():
    uses = private_uses()
    outside = sorted(uses - BELOW_THE_ADAPTERS)
    assert not outside, (
        "private torch / Lightning / jsonargparse names reached outside mmoe.runtime.lightning_internals and "
        f"mmoe.runtime.torch_internals (put them behind a public name there, with a test): {outside}"
    )
    assert BELOW_THE_ADAPTERS <= uses  # each exception is still needed
