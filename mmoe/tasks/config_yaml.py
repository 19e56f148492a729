"""Reading a YAML config safely: what ``mmoe fit --config`` and every other config read parse their files with.

PyYAML alone resolves a key given twice in one mapping to the last value without a word (a second ``trainer:`` block
at the end of a file drops the first one whole), and expands anchors and aliases without bound (a 520-byte "billion
laughs" file grows past any memory once the parser copies its value). :func:`load_yaml_config` refuses both before
any value is built:

* a key given twice in one mapping: one :class:`ConfigFileError` naming the file, the key and both lines;
* aliases (``*name``) are allowed, but the config they expand to may hold at most :data:`MAX_CONFIG_NODES` values
  (each scalar, list and mapping counts once per place it appears), and an anchor may not contain itself.

Values are then built by jsonargparse's own YAML loader, so a config means what it meant before (``1e-4`` is a
float, dates stay strings).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

#: The most values a config may expand to through its aliases; the shipped configs hold a few hundred.
MAX_CONFIG_NODES = 100_000


class ConfigFileError(yaml.YAMLError):
    """A config refused before its values are built; the message names the file (or the command-line value), the
    key or anchor, and the line. A ``yaml.YAMLError`` so that jsonargparse reports it like a malformed file."""


def load_yaml_config(text: str, path: str = "", build: Callable[[str], Any] | None = None) -> Any:
    """The value of the YAML ``text`` (a config file's content, or a command-line value), built by ``build``
    (``yaml.safe_load`` unless given) once the text is known to hold no duplicate key and to expand to at most
    :data:`MAX_CONFIG_NODES` values.

    Args:
        text: the YAML text.
        path: the file it was read from, named in errors ("" for a command-line value).
        build: what turns the checked text into a value.

    Raises:
        ConfigFileError: a duplicate key or an alias expansion over the bound.
        yaml.YAMLError: malformed YAML.
    """
    where = f"config {path}" if path else "config value"
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        if root is not None:
            refuse_duplicate_keys(root, where)
            expanded_size(root, where, {}, set())
    except RecursionError:
        raise ConfigFileError(f"{where}: nested too deeply to read") from None
    return (build or yaml.safe_load)(text)


def refuse_duplicate_keys(root: Node, where: str) -> None:
    """Raises :class:`ConfigFileError` for the first mapping of ``root`` that gives one key twice."""
    seen_nodes: set[int] = set()
    pending = [root]
    while pending:
        node = pending.pop()
        if id(node) in seen_nodes:  # an aliased node is checked once
            continue
        seen_nodes.add(id(node))
        if isinstance(node, SequenceNode):
            pending.extend(node.value)
        elif isinstance(node, MappingNode):
            first_line: dict[str, int] = {}
            for key, value in node.value:
                pending.append(value)
                if not isinstance(key, ScalarNode):
                    continue
                line = key.start_mark.line + 1
                if key.value in first_line and key.tag != "tag:yaml.org,2002:merge":
                    raise ConfigFileError(
                        f"{where}: key {shorten(key.value)!r} is given twice in one mapping (line "
                        f"{first_line[key.value]} and line {line}); the second would silently replace the first"
                    )
                first_line.setdefault(key.value, line)


def expanded_size(node: Node, where: str, sizes: dict[int, int], open_nodes: set[int]) -> int:
    """The number of values ``node`` expands to with its aliases resolved (``sizes``: those already counted, by node
    id; ``open_nodes``: the nodes being counted, to find an anchor that contains itself).

    Raises:
        ConfigFileError: more than :data:`MAX_CONFIG_NODES` values, or an anchor inside itself.
    """
    if id(node) in sizes:
        return sizes[id(node)]
    if id(node) in open_nodes:
        raise ConfigFileError(f"{where}: line {node.start_mark.line + 1}: an anchor is used inside itself")
    open_nodes.add(id(node))
    children: list[Node] = []
    if isinstance(node, SequenceNode):
        children = node.value
    elif isinstance(node, MappingNode):
        children = [part for pair in node.value for part in pair]
    size = 1 + sum(expanded_size(child, where, sizes, open_nodes) for child in children)
    open_nodes.discard(id(node))
    if size > MAX_CONFIG_NODES:
        raise ConfigFileError(
            f"{where}: its anchors and aliases (&name, *name) expand to more than {MAX_CONFIG_NODES} values "
            f"(from line {node.start_mark.line + 1}); a config expands to a few hundred"
        )
    sizes[id(node)] = size
    return size


def shorten(text: str, limit: int = 200) -> str:
    """``text`` cut to ``limit`` characters, saying how many were cut: values quoted in errors stay readable."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"
