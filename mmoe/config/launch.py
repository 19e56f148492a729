"""``mmoe fit / validate / test / predict`` started from Python: configs read by the CLI's own parser, options over
them as a dict nested as in a config file (:mod:`mmoe.config.run_spec` builds them from a typed spec), callbacks as
objects.

The demo, the claims study and the commands that read a config (``mmoe info``, ``mmoe upcycle``) go through here, so
a config means the same to them as to ``mmoe fit``: repeated config files merge in order, an unknown key is an error,
values are typed by the tasks' and DataModules' signatures.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import lightning as L
from jsonargparse import ArgumentError, Namespace

from mmoe.config.cli import MMoECLI, cli_arguments
from mmoe.config.overrides import Overrides, overrides_for
from mmoe.config.safety import config_error_line


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
    configs: Sequence[str | Path], overrides: Overrides | None = None, subcommand: str = "fit"
) -> Namespace:
    """What ``mmoe <subcommand> --config C1 --config C2 ...`` would run, with ``overrides`` (nested keys as in the
    config files, e.g. ``{"trainer": {"max_steps": 10}}``, or a function of the parsed files' subcommand config that
    gives them) applied over the files: the whole parsed config, with ``subcommand`` set.

    Raises:
        ValueError: a config that does not parse (the files and jsonargparse's reason, on one line).
    """
    argv = config_argv(configs, subcommand)
    # Without a data section too: a config read for its model (``mmoe upcycle``, ``mmoe info``) needs none.
    try:
        parsed = ParsedOnly(
            **cli_arguments(args=argv, save_config_callback=None, datamodule_class=None),
            parser_kwargs={"exit_on_error": False},
        )
    except ArgumentError as error:
        raise ValueError(f"{', '.join(map(str, configs))}: {config_error_line(error)}") from None
    overrides = overrides_for(overrides, parsed.config[subcommand])
    if not overrides:
        return parsed.config
    try:
        return parsed.parser.parse_object({subcommand: overrides}, parsed.config)
    except ArgumentError as error:
        raise ValueError(f"{', '.join(map(str, configs))} with {overrides}: {config_error_line(error)}") from None


def run_lightning(
    subcommand: str,
    configs: Sequence[str | Path],
    overrides: Overrides | None = None,
    callbacks: Sequence[L.Callback] = (),
) -> MMoECLI:
    """Runs ``mmoe <subcommand>`` in this process on ``configs`` with ``overrides`` (see :func:`read_config`;
    ``{"ckpt_path": ...}`` resumes or predicts from a checkpoint) and ``callbacks`` added to the trainer's. Model
    arguments in ``overrides`` count as given on the command line: with a checkpoint they keep their value over the
    checkpoint's saved one. The config is parsed once, by the CLI that runs it (a parse takes about half a second)."""
    return MMoECLI(
        **cli_arguments(args=config_argv(configs, subcommand), trainer_defaults={"callbacks": list(callbacks)}),
        overrides=overrides or {},
    )


def config_argv(configs: Sequence[str | Path], subcommand: str) -> list[str]:
    """``[subcommand, "--config", C1, "--config", C2, ...]``: the command line of ``configs`` merged in order."""
    argv = [subcommand]
    for config in configs:
        argv += ["--config", str(config)]
    return argv
