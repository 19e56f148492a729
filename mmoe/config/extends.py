"""A config file that extends another: ``extends: trainer/tiny.yaml`` at the top of a file lays the file's own
settings over those of the named file, so that configs share a part (the fine-tuning trainer every task of one size
uses) while a user still runs one file (``mmoe fit --config configs/finetune/vqav2_tiny.yaml``).

How the two are merged (:func:`merged`):

* mappings key by key: a setting of the extending file replaces the part's, a setting it does not give is the part's;
  a dotted key (``trainer.max_steps: 7``) is the setting it names inside its block;
* lists of classes (each item a mapping with a ``class_path``, as ``trainer.callbacks``) item by class: an item
  naming a class the part lists (by its full path or by the class name alone) merges into that item (the next such
  item for a second one of the class), any other is appended after the part's; a part's class cannot be taken out
  by the extending file;
* any other value, lists included, replaces the part's whole.

The part is named relative to the extending file's folder and read like the file itself (no key given twice, aliases
bounded); it may extend another part, at most :data:`MAX_EXTENDS_DEPTH` files deep, never itself. A part is a regular
file read without following a symbolic link, at most :data:`MAX_PART_BYTES` long; anything else is refused in one
line naming both files, never quoting the part's content.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from mmoe.config.yaml_reading import ConfigFileError, load_yaml_config, shorten

#: The top-level key that names the part a config file extends.
EXTENDS_KEY = "extends"

#: The most files one config may be made of through ``extends`` (the file itself included).
MAX_EXTENDS_DEPTH = 4

#: The largest part read; the shipped parts are about one kilobyte.
MAX_PART_BYTES = 1 << 20


def extended_config(value: dict, file: str, build: Callable[[str], Any] | None = None) -> dict:
    """``value``, the settings read from the config ``file``, laid over the part its ``extends`` key names (and that
    part over its own, and so on); ``value`` itself when it extends nothing.

    Args:
        value: the file's settings, its ``extends`` key included.
        file: the file's path, which the part's path is relative to.
        build: what turns a part's checked text into its settings (``yaml.safe_load`` unless given).

    Raises:
        ConfigFileError: the part is missing, a link, not a regular file, too large, not a mapping of settings, or
            the chain of parts is too deep or comes back to a file of its own.
    """
    chain = [os.path.abspath(file)]
    layers = [value]
    while EXTENDS_KEY in layers[-1]:
        named = layers[-1][EXTENDS_KEY]
        where = f"config {chain[-1]}: {EXTENDS_KEY} {shorten(str(named))!r}"
        if not isinstance(named, str) or not named:
            raise ConfigFileError(f"{where}: expected the path of a config file, relative to this file's folder")
        part = os.path.normpath(os.path.join(os.path.dirname(chain[-1]), named))
        if part in chain:
            raise ConfigFileError(f"{where}: the file comes back to itself ({' -> '.join(chain + [part])})")
        if len(chain) == MAX_EXTENDS_DEPTH:
            raise ConfigFileError(f"{where}: more than {MAX_EXTENDS_DEPTH} files deep")
        layers.append(read_part(part, where, build))
        chain.append(part)
    settings: dict = {}
    for layer in reversed(layers):
        settings = merged(settings, undotted({key: item for key, item in layer.items() if key != EXTENDS_KEY}))
    return settings


def read_config_file(path: str | Path) -> dict:
    """The settings of the config file at ``path`` with the parts it extends merged in, as ``mmoe fit --config``
    reads them (built by ``yaml.safe_load``; a config's own classes are not imported)."""
    where = f"config {os.path.abspath(path)}"
    value = read_part(os.path.abspath(path), where, None)
    return extended_config(value, str(path))


def read_part(path: str, where: str, build: Callable[[str], Any] | None) -> dict:
    """The settings of the part at ``path``, read without following a link (``where`` starts each error)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ConfigFileError(f"{where}: no file {path}") from None
    except OSError as error:
        reason = "a symbolic link (not followed)" if os.path.islink(path) else error.strerror
        raise ConfigFileError(f"{where}: {path} cannot be read: {reason}") from None
    with os.fdopen(descriptor, "rb") as handle:
        status = os.fstat(handle.fileno())
        if not stat.S_ISREG(status.st_mode):
            raise ConfigFileError(f"{where}: {path} is not a regular file")
        if status.st_size > MAX_PART_BYTES:
            raise ConfigFileError(f"{where}: {path} holds {status.st_size} bytes, more than {MAX_PART_BYTES}")
        data = handle.read(MAX_PART_BYTES + 1)
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise ConfigFileError(f"{where}: {path} is not UTF-8 text (its content is not shown)") from None
    try:
        value = load_yaml_config(text, path, build)
    except ConfigFileError:
        raise
    except yaml.YAMLError:
        raise ConfigFileError(f"{where}: {path} is not YAML (its content is not shown)") from None
    if not isinstance(value, dict):
        raise ConfigFileError(f"{where}: {path} holds no mapping of settings (its content is not shown)")
    return value


def merged(part: Any, settings: Any) -> Any:
    """``settings`` laid over ``part`` by the rules in the module docstring."""
    if isinstance(part, dict) and isinstance(settings, dict):
        result = dict(part)
        for key, value in settings.items():
            result[key] = merged(part[key], value) if key in part else value
        return result
    if is_class_list(part) and is_class_list(settings):
        result, taken = list(part), set()
        for item in settings:
            same = next((i for i, given in enumerate(part) if i not in taken and same_class(given, item)), None)
            if same is None:
                result.append(item)
            else:
                taken.add(same)
                result[same] = merged(result[same], item)
        return result
    return settings


def undotted(settings: Any) -> Any:
    """``settings`` with each dotted key (``trainer.max_steps``) written as the blocks it names."""
    if not isinstance(settings, dict):
        return settings
    result: dict = {}
    for key, value in settings.items():
        path = key.split(".") if isinstance(key, str) else [key]
        nested = undotted(value)
        for name in reversed(path[1:]):
            nested = {name: nested}
        result = merged(result, {path[0]: nested})
    return result


def is_class_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, dict) and "class_path" in item for item in value)


def same_class(first: dict, second: dict) -> bool:
    """Whether two items name one class, by full path or by the class name alone (``ModelCheckpoint``)."""
    a, b = str(first["class_path"]), str(second["class_path"])
    return a == b or a.endswith(f".{b}") or b.endswith(f".{a}")
