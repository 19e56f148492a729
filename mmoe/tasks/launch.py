"""``mmoe fit / validate / test / predict`` started from Python: configs read by the CLI's own parser, options as a
typed dict, callbacks as objects.

The demo, the claims study and the commands that read a config (``mmoe info``, ``mmoe upcycle``) go through here, so
a config means the same to them as to ``mmoe fit``: repeated config files merge in order, an unknown key is an error,
values are typed by the tasks' and DataModules' signatures.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
from jsonargparse import ArgumentError, Namespace

from mmoe.tasks.cli import MMoECLI, cli_arguments
from mmoe.tasks.config_safety import config_error_line


class ParsedOnly(MMoECLI):
    """An ``mmoe`` Lightning subcommand parsed, with nothing instantiated (no file the config names is read) and
    nothing run."""

    def before_instantiate_classes(self) -> None:
        pass  # the run folder is filled in when the command runs, after any options over the files

    def instantiate_classes(self) -> None:
        pass

    def run_subcommand(self, subcommand: str) -> None:
        pass

    def set_seed(self) -> None:
        pass  # reading a config seeds nothing


def read_config(
    configs: Sequence[str | Path], overrides: Mapping[str, Any] | None = None, subcommand: str = "fit"
) -> Namespace:
    """What ``mmoe <subcommand> --config C1 --config C2 ...`` would run, with ``overrides`` (nested keys as in the
    config files, e.g. ``{"trainer": {"max_steps": 10}}``) applied over the files: the whole parsed config, with
    ``subcommand`` set.

    Raises:
        ValueError: a config that does not parse (the files and jsonargparse's reason, on one line).
    """
    argv = [subcommand]
    for config in configs:
        argv += ["--config", str(config)]
    with warnings.catch_warnings():  # LightningCLI warns that these arguments are not the process's own
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        # Without a data section too: a config read for its model (``mmoe upcycle``, ``mmoe info``) needs none.
        try:
            parsed = ParsedOnly(
                **cli_arguments(args=argv, save_config_callback=None, datamodule_class=None),
                parser_kwargs={"exit_on_error": False},
            )
        except ArgumentError as error:
            raise ValueError(f"{', '.join(map(str, configs))}: {config_error_line(error)}") from None
    if not overrides:
        return parsed.config
    overrides = copy.deepcopy(dict(overrides))  # the parser turns nested dicts into Namespaces in place
    for name in ("model", "data"):  # a subclass's init_args merge over the files' only under its own class_path
        if name in overrides and "class_path" not in overrides[name]:
            overrides[name] = {"class_path": parsed.config[subcommand][name].class_path, **overrides[name]}
    try:
        return parsed.parser.parse_object({subcommand: overrides}, parsed.config)
    except ArgumentError as error:
        raise ValueError(f"{', '.join(map(str, configs))} with {overrides}: {config_error_line(error)}") from None


def run_lightning(
    subcommand: str,
    configs: Sequence[str | Path],
    overrides: Mapping[str, Any] | None = None,
    callbacks: Sequence[L.Callback] = (),
) -> MMoECLI:
    """Runs ``mmoe <subcommand>`` in this process on ``configs`` with ``overrides`` (see :func:`read_config`;
    ``{"ckpt_path": ...}`` resumes or predicts from a checkpoint) and ``callbacks`` added to the trainer's. Model
    arguments in ``overrides`` count as given on the command line: with a checkpoint they keep their value over the
    checkpoint's saved one."""
    config = read_config(configs, overrides, subcommand)
    model = (overrides or {}).get("model") or {}
    named = set(flat_keys(model.get("init_args") or {}))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        return MMoECLI(
            **cli_arguments(args=config, trainer_defaults={"callbacks": list(callbacks)}),
            named_model_arguments=named,
        )


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
