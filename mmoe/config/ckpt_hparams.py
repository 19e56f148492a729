"""What ``mmoe fit | predict --ckpt_path`` does with a checkpoint's saved hyper-parameters and the config's values:
which differ, which the command line named, which data values agree with the model's, and which error is the user's.
"""

from __future__ import annotations

import importlib
import inspect
import json
import traceback
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from jsonargparse import Namespace

#: Where mmoe's code lives: errors raised there are mmoe's own messages (:func:`input_error`).
PACKAGE = Path(__file__).resolve().parents[1]


def stored_by_design(name: str, saved: Any, given: Any) -> bool:
    """Whether a checkpoint's value of model argument ``name`` differs from the config's by design: ``backbone:
    null`` in a config means "the checkpoint's architecture", and a fine-tuning checkpoint stores no ``pretrained``
    file (its own weights replace it)."""
    return (name == "backbone" and given is None) or (name == "pretrained" and saved is None)


def is_file_name(ckpt_path: str) -> bool:
    """Whether a ``--ckpt_path`` names a local file, not one of Lightning's keywords or a URL."""
    keyword = ckpt_path in ("best", "last", "hpc") or ckpt_path.lower().split(":", 1)[0] == "registry"
    return not keyword and "://" not in ckpt_path


def init_parameters(class_path: str | None) -> Mapping[str, inspect.Parameter]:
    """The ``__init__`` parameters of the class at ``class_path``, those its ``**kwargs`` pass on to its base classes
    included (a class's own parameter first); empty when it cannot be imported."""
    module, _, name = (class_path or "").rpartition(".")
    try:
        klass = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return {}
    parameters: dict[str, inspect.Parameter] = {}
    for base in inspect.getmro(klass) if inspect.isclass(klass) else ():
        if "__init__" not in vars(base):
            continue
        try:
            signature = inspect.signature(base.__init__)
        except (ValueError, TypeError):
            break
        own = {key: value for key, value in signature.parameters.items() if key != "self"}
        for key, parameter in own.items():
            if parameter.kind not in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL):
                parameters.setdefault(key, parameter)
        if not any(parameter.kind == parameter.VAR_KEYWORD for parameter in own.values()):
            break
    return parameters


def differences(saved: Any, given: Any, key: str) -> Iterator[tuple[str, Any, Any]]:
    """(key, saved, given) for each value that differs between ``saved`` and ``given``; dicts compared per key."""
    saved, given = as_checkpoint_value(saved), as_checkpoint_value(given)
    if isinstance(saved, dict) and isinstance(given, dict):
        for name in [*saved, *(name for name in given if name not in saved)]:
            yield from differences(saved.get(name), given.get(name), f"{key}.{name}")
    elif saved != given:
        yield key, saved, given


def as_checkpoint_value(value: Any) -> Any:
    """``value`` with Namespaces as dicts and tuples as lists, as a checkpoint holds them."""
    if isinstance(value, Namespace):
        value = value.as_dict()
    if isinstance(value, dict):
        return {name: as_checkpoint_value(item) for name, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [as_checkpoint_value(item) for item in value]
    return value


def show(value: Any) -> str:
    return json.dumps(value, default=str)


def same_value(given: Any, linked: Any) -> bool:
    """Whether a data value given in a config agrees with the model's: equal, or both name files with the same
    bytes (a vocabulary at another path)."""
    if given == linked:
        return True
    if isinstance(given, str) and isinstance(linked, str):
        first, second = Path(given), Path(linked)
        return first.is_file() and second.is_file() and first.read_bytes() == second.read_bytes()
    return False


def input_error(error: BaseException | None) -> BaseException | None:
    """The innermost error about the input that mmoe's own code raised (a ``ValueError`` or ``FileNotFoundError``,
    e.g. a config's validation) under the errors jsonargparse wraps around it while instantiating; None if none."""
    found = None
    while error is not None:
        frames = traceback.extract_tb(error.__traceback__)
        raised_by_mmoe = bool(frames) and Path(frames[-1].filename).is_relative_to(PACKAGE)
        if raised_by_mmoe and isinstance(error, (FileNotFoundError, ValueError)):
            found = error
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    return found


def command_line_model_arguments(args) -> set[str]:
    """Model arguments set by ``--model.<key>`` or ``--model.init_args.<key>`` options in ``args``, as dotted keys
    below ``init_args`` (``num_beams``, ``optimizer.learning_rate``); none for a dict or Namespace from code."""
    if not isinstance(args, (list, tuple)):
        return set()
    keys = set()
    for token in args:
        if isinstance(token, str) and token.startswith("--model."):
            key = token[len("--model.") :].split("=", 1)[0]
            keys.add(key.removeprefix("init_args."))
    return keys


def named_in(key: str, keys: set[str]) -> bool:
    """Whether the dotted ``key`` or a key containing it is in ``keys``."""
    return any(key == name or key.startswith(name + ".") for name in keys)


def without_keys(values: dict[str, Any], keys: set[str]) -> dict[str, Any]:
    """``values`` less every dotted key of ``keys`` (nested dicts copied, not changed)."""
    kept = {}
    for name, value in values.items():
        if name in keys:
            continue
        inner = {key.split(".", 1)[1] for key in keys if key.startswith(name + ".")}
        kept[name] = without_keys(value, inner) if inner and isinstance(value, dict) else value
    return kept
