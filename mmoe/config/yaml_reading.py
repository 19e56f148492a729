"""Reading a YAML config safely: what ``mmoe fit --config`` and every other config read parse their files with.

PyYAML alone resolves a key given twice in one mapping to the last value without a word (a second ``trainer:`` block
at the end of a file drops the first one whole), and expands anchors and aliases without bound (a 520-byte "billion
laughs" file grows past any memory once the parser copies its value). :func:`load_yaml_config` refuses both before
any value is built:

* a key given twice in one mapping: one :class:`ConfigFileError` naming the file, the key and both lines; a dotted
  key is the key of its block (``trainer.max_steps: 7`` beside ``trainer: {max_steps: 300}`` gives ``max_steps``
  twice), as jsonargparse merges the two;
* aliases (``*name``) are allowed, but the config they expand to may hold at most :data:`MAX_CONFIG_NODES` values
  (each scalar, list and mapping counts once per place it appears), and an anchor may not contain itself. A quoted
  value that is YAML itself (jsonargparse reads a string given for a number, a list or a class as YAML again) counts
  with the values it expands to.

Values are then built by jsonargparse's own YAML loader, so a config means what it meant before (``1e-4`` is a
float, dates stay strings).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

#: The most values a config may expand to through its aliases; the shipped configs hold a few hundred.
MAX_CONFIG_NODES = 100_000

MERGE_TAG = "tag:yaml.org,2002:merge"

#: What YAML needs to read a text as more than one scalar: a line break, a key (``:``, ``?``), an anchor or alias
#: (``&``, ``*``), a flow collection, or a sequence entry (``-`` before a space or at the end).
STRUCTURE = re.compile(r"[\n\r\x85\u2028\u2029:?&*{}\[\]]|-(\s|$)")


class ConfigFileError(yaml.YAMLError):
    """A config refused before its values are built; the message names the file (or the command-line value), the
    key or anchor, and the line. A ``yaml.YAMLError`` so that jsonargparse reports it like a malformed file."""


def load_yaml_config(text: str, path: str = "", build: Callable[[str], Any] | None = None) -> Any:
    """The value of the YAML ``text`` (a config file's content, or a command-line value), built by ``build``
    (``yaml.safe_load`` unless given) once :func:`check_yaml_config` passed it.

    Args:
        text: the YAML text.
        path: the file it was read from, named in errors ("" for a command-line value).
        build: what turns the checked text into a value.

    Raises:
        ConfigFileError: a duplicate key or an alias expansion over the bound.
        yaml.YAMLError: malformed YAML.
    """
    check_yaml_config(text, f"config {path}" if path else "config value")
    return (build or yaml.safe_load)(text)


def check_yaml_config(text: str, where: str) -> None:
    """Raises :class:`ConfigFileError` (its message starting with ``where``) when the YAML ``text`` gives a key twice
    in one mapping or expands to more than :data:`MAX_CONFIG_NODES` values, and ``yaml.YAMLError`` when it is not
    YAML; builds no value. The expansion is bounded first: the key check walks what the aliases expand to.

    A text without a line break, a key, an anchor, an alias, a flow collection or a sequence entry (most values
    jsonargparse reads, such as ``shards/pretrain-images`` or ``1e-4``) is one scalar: it passes without being
    composed (jsonargparse reads about a thousand such values in each parse)."""
    if not STRUCTURE.search(text):
        return
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        if root is not None:
            expanded_size(root, where, {}, set())
            refuse_duplicate_keys(root, where)
    except RecursionError:
        raise ConfigFileError(f"{where}: nested too deeply to read") from None


def refuse_duplicate_keys(root: Node, where: str) -> None:
    """Raises :class:`ConfigFileError` for the first mapping of ``root`` that gives one key twice, directly or as a
    dotted key beside its block (:func:`refuse_dotted_duplicates`)."""
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
                if key.value in first_line and key.tag != MERGE_TAG:
                    raise duplicate_key(where, key.value, first_line[key.value], line)
                first_line.setdefault(key.value, line)
            refuse_dotted_duplicates(node, where)


def refuse_dotted_duplicates(node: MappingNode, where: str) -> None:
    """Raises :class:`ConfigFileError` when a dotted key of the mapping ``node`` (``trainer.max_steps``) names a
    setting that another of its keys gives too (``trainer: {max_steps: ...}``), or a part of one."""
    dotted_heads = {key.value.split(".")[0] for key, _ in node.value if is_plain_key(key) and "." in key.value}
    if not dotted_heads:
        return
    leaves: dict[tuple[str, ...], int] = {}  # each setting given, by its dotted path, and the line that gives it
    branches: dict[tuple[str, ...], int] = {}  # the paths above them
    for key, value in node.value:
        if not is_plain_key(key) or key.value.split(".")[0] not in dotted_heads:
            continue
        for path, line in setting_paths(tuple(key.value.split(".")), key.start_mark.line + 1, value):
            given = next((path[:end] for end in range(1, len(path) + 1) if path[:end] in leaves), None)
            if given is not None:
                raise duplicate_key(where, ".".join(given), leaves[given], line)
            if path in branches:
                raise duplicate_key(where, ".".join(path), branches[path], line)
            leaves[path] = line
            for end in range(1, len(path)):
                branches.setdefault(path[:end], line)


def setting_paths(path: tuple[str, ...], line: int, value: Node) -> Iterator[tuple[tuple[str, ...], int]]:
    """The dotted path of each setting that ``value``, given at ``path`` on ``line``, holds: itself, or the settings
    of its mapping (a merge key ``<<`` left out: it gives defaults that the mapping's own keys replace by design)."""
    if not isinstance(value, MappingNode):
        yield path, line
        return
    for key, item in value.value:
        if is_plain_key(key):
            yield from setting_paths(path + tuple(key.value.split(".")), key.start_mark.line + 1, item)


def is_plain_key(key: Node) -> bool:
    """Whether ``key`` is a scalar key other than a merge key."""
    return isinstance(key, ScalarNode) and key.tag != MERGE_TAG


def duplicate_key(where: str, key: str, first_line: int, line: int) -> ConfigFileError:
    return ConfigFileError(
        f"{where}: key {shorten(key)!r} is given twice in one mapping (line {first_line} and line {line}); the second "
        "would silently replace the first"
    )


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
    size = 1
    if isinstance(node, SequenceNode):
        size += sum(expanded_size(child, where, sizes, open_nodes) for child in node.value)
    elif isinstance(node, MappingNode):
        size += sum(expanded_size(part, where, sizes, open_nodes) for pair in node.value for part in pair)
    elif isinstance(node, ScalarNode):
        size += quoted_yaml_size(node, where)
    open_nodes.discard(id(node))
    if size > MAX_CONFIG_NODES:
        raise ConfigFileError(
            f"{where}: its anchors and aliases (&name, *name) expand to more than {MAX_CONFIG_NODES} values "
            f"(from line {node.start_mark.line + 1}); a config expands to a few hundred"
        )
    sizes[id(node)] = size
    return size


def quoted_yaml_size(node: ScalarNode, where: str) -> int:
    """The number of values the text of the scalar ``node`` expands to when read as YAML again: 0 unless it holds an
    anchor and an alias (without both, nothing in it is repeated) and is YAML."""
    text = node.value
    if "&" not in text or "*" not in text:
        return 0
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return 0  # a string jsonargparse keeps as it is
    if root is None:
        return 0
    return expanded_size(root, f"{where}: the value on line {node.start_mark.line + 1}", {}, set())


def shorten(text: str, limit: int = 200) -> str:
    """``text`` cut to ``limit`` characters, saying how many were cut: values quoted in errors stay readable."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"
