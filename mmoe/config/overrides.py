"""Options laid over a parsed config in the same parse (``mmoe.config.launch.run_lightning``'s ``overrides``): nested
as in a config file, the model and data parts under the parsed config's class paths, and the model arguments they set,
which count as named on the command line."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

from jsonargparse import Namespace

#: Options laid over a parsed config, nested as in a config file, or a function of the parsed subcommand config that
#: gives them.
Overrides = Mapping[str, Any] | Callable[[Namespace], Mapping[str, Any]]


def model_argument_names(overrides: Mapping[str, Any]) -> set[str]:
    """The dotted model arguments below ``init_args`` that ``overrides`` set (``{"model": {"init_args":
    {"optimizer": {"learning_rate": 1}}}}`` -> ``{"optimizer.learning_rate"}``)."""
    return set(flat_keys((overrides.get("model") or {}).get("init_args") or {}))


def flat_keys(values: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys of the leaves of nested ``values`` (``{"optimizer": {"learning_rate": 1}}`` ->
    ``["optimizer.learning_rate"]``)."""
    keys = []
    for name, value in values.items():
        if isinstance(value, Mapping) and value:
            keys += flat_keys(value, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


def overrides_under_class_paths(overrides: Mapping[str, Any], config: Namespace) -> dict[str, Any]:
    """``overrides`` (nested as in a config file) with the ``model`` and ``data`` parts that name no ``class_path``
    given ``config``'s: a subclass's ``init_args`` merge over a parsed config's only under its own class path."""
    overrides = copy.deepcopy(dict(overrides))  # the parser turns nested dicts into Namespaces in place
    for name in ("model", "data"):
        if name in overrides and "class_path" not in overrides[name]:
            overrides[name] = {"class_path": config[name].class_path, **overrides[name]}
    return overrides


def overrides_for(overrides: Overrides | None, config: Namespace) -> dict[str, Any]:
    """The options ``overrides`` lay over ``config`` (one subcommand's, parsed), under its class paths: the function's
    result where ``overrides`` is one; {} for none."""
    options = overrides(config) if callable(overrides) else overrides
    return overrides_under_class_paths(options, config) if options else {}
