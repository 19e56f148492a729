"""The private parts of Lightning and of its config parser, jsonargparse, that mmoe relies on, each behind a public
name here.

Neither library promises anything about its ``_``-prefixed names: an upgrade may rename or reshape any of them. mmoe
reaches them only here, and ``tests/tasks/test_lightning_internals.py`` checks each against the installed versions
(present, callable with the arguments given here, still called by Lightning where mmoe overrides it), so an upgrade
that changes one fails that test, naming the API and the version.

* :class:`HookedLightningCLI`: LightningCLI's private steps (the subcommand parsers, the merge of a checkpoint's
  hyper-parameters, the seed, the run of a subcommand and its arguments) as methods with public names, and the
  parser of the named subcommand alone built.
* :data:`SignalConnector`, :func:`replace_signal_connector`: the trainer's handler of termination signals.
* :class:`KeepingExperimentWriter`, :func:`csv_logger_experiment`: a ``CSVLogger`` whose writer keeps
  ``metrics.csv``.
* :func:`save_last_checkpoint`: a ``ModelCheckpoint``'s last checkpoint saved now.
* :func:`parse_config`: a jsonargparse parse, its final validation optional.
* :func:`config_file_being_read`: the config file jsonargparse is reading.
* :func:`config_before_file`: what jsonargparse parsed before the ``--config`` file it is reading.
* :func:`leaf_spec_deprecation_ignored`: Lightning's own use of a deprecated torch class, kept off the console
  while a run's trainer runs.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
from jsonargparse import ArgumentParser, Namespace
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

#: Lightning's handler of SIGTERM (and SIGUSR1 for SLURM) during a run: installs its handlers when the run starts and
#: puts the earlier ones back at its end (``register_signal_handlers``, ``teardown``); one per trainer.
SignalConnector = _SignalConnector


class HookedLightningCLI(LightningCLI):
    """LightningCLI with its private steps turned into public methods a subclass overrides; each does what
    LightningCLI does unless overridden.

    LightningCLI builds a parser for every subcommand (fit, validate, test, predict), each with the trainer's, the
    model's and the data's arguments, whichever one the arguments name. Here, when the first argument names a
    subcommand, only that one's parser is built (the other three cost about 15% of a pipeline stage's parse:
    ``benchmarks/config_parse.py``); otherwise (``--help`` alone, a misspelt name) all of them are, so the help and
    the error list every subcommand."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        arguments = kwargs.get("args")
        self.named_subcommand = named_subcommand(
            sys.argv[1:] if arguments is None else arguments, self.every_subcommand()
        )
        super().__init__(*args, **kwargs)

    @staticmethod
    def every_subcommand() -> dict[str, set[str]]:
        """Every subcommand and the trainer method's arguments it does not take from the config."""
        return LightningCLI.subcommands()

    def subcommands(self) -> dict[str, set[str]]:  # LightningCLI's is static; it calls it on the instance
        every = self.every_subcommand()
        if self.named_subcommand is None:
            return every
        return {self.named_subcommand: every[self.named_subcommand]}

    def _prepare_subcommand_parser(self, klass: type, subcommand: str, **kwargs: Any) -> LightningArgumentParser:
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        self.add_subcommand_arguments(parser, subcommand)
        return parser

    def add_subcommand_arguments(self, parser: LightningArgumentParser, subcommand: str) -> None:
        """Adds arguments of ``subcommand`` alone to its ``parser`` (none here)."""

    @property
    def subcommand_parsers(self) -> dict[str, LightningArgumentParser]:
        """The parser of each subcommand, by name."""
        return self._subcommand_parsers

    def _parse_ckpt_path(self) -> None:
        self.merge_checkpoint_hyperparameters()

    def merge_checkpoint_hyperparameters(self) -> None:
        """Sets the model's arguments to the hyper-parameters saved in ``--ckpt_path``'s checkpoint, over the config
        (run once the arguments are parsed)."""
        super()._parse_ckpt_path()

    def _set_seed(self) -> None:
        self.set_seed()

    def set_seed(self) -> None:
        """Seeds every generator from ``seed_everything`` (and records the seed drawn for ``true``)."""
        super()._set_seed()

    def _run_subcommand(self, subcommand: str) -> None:
        self.run_subcommand(subcommand)

    def run_subcommand(self, subcommand: str) -> None:
        """Runs ``subcommand`` on the trainer, with its ``before_`` and ``after_`` methods."""
        super()._run_subcommand(subcommand)

    def _prepare_subcommand_kwargs(self, subcommand: str) -> dict[str, Any]:
        return self.subcommand_kwargs(subcommand, super()._prepare_subcommand_kwargs(subcommand))

    def subcommand_kwargs(self, subcommand: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments of the trainer's ``subcommand`` method, given LightningCLI's ``kwargs``."""
        return kwargs

    def subcommand_value(self, config: Namespace, key: str, default: Any = None) -> Any:
        """``key`` of ``config``, looked up in the running subcommand's section when it has one."""
        return self._get(config, key, default)


def named_subcommand(arguments: Any, subcommands: dict[str, set[str]]) -> str | None:
    """The subcommand a command line (a list of arguments) starts with; None for any other arguments (a parsed
    config, options before the subcommand, none)."""
    if isinstance(arguments, list | tuple) and arguments and arguments[0] in subcommands:
        return arguments[0]
    return None


def replace_signal_connector(trainer: L.Trainer, connector: SignalConnector) -> None:
    """Makes ``connector`` the one ``trainer`` installs at the start of a run and tears down at its end."""
    trainer._signal_connector = connector


class KeepingExperimentWriter(ExperimentWriter):
    """Lightning's CSV writer, less its check at creation that deletes a ``metrics.csv`` already in the folder."""

    def _check_log_dir_exists(self) -> None:
        pass


def csv_logger_experiment(logger: CSVLogger, writer: Callable[[str], ExperimentWriter]) -> ExperimentWriter:
    """``logger``'s writer (``CSVLogger.experiment``), made by ``writer(log_dir)`` on first use."""
    if logger._experiment is None:
        logger._fs.makedirs(logger.root_dir, exist_ok=True)
        logger._experiment = writer(logger.log_dir)
    return logger._experiment


def save_last_checkpoint(callback: ModelCheckpoint, trainer: L.Trainer) -> None:
    """Saves ``callback``'s last checkpoint now unless it saved one at this step, with its own naming, its record of
    the last file and its loggers' notifications (``ModelCheckpoint`` has no public way to)."""
    if callback._last_global_step_saved < trainer.global_step:
        callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))


def parse_config(parser: ArgumentParser, args: Any, validate: bool = True) -> Namespace:
    """``args`` (a command line, or a config as a dict or a Namespace) parsed by ``parser``; ``validate=False`` leaves
    out the check of the whole config at the end (jsonargparse's private ``_skip_validation``), for a config that is
    parsed again with options laid over it and checked then: the check costs a third of a parse."""
    parse = parser.parse_object if isinstance(args, dict | Namespace) else parser.parse_args
    return parse(args) if validate else parse(args, _skip_validation=True)


def config_file_being_read() -> str:
    """The path of the config file jsonargparse is reading now, the innermost when one names another; "" outside
    one, or with a jsonargparse that keeps no record of it."""
    try:
        from jsonargparse._util import config_load_stack
    except ImportError:
        return ""
    stack = config_load_stack.get()
    return stack[-1][0] if stack else ""


def config_before_file() -> Namespace | None:
    """The config jsonargparse parsed before the ``--config`` file it is reading now (earlier ``--config`` files and
    options); None outside one, or with a jsonargparse that keeps no record of it."""
    try:
        from jsonargparse._actions import previous_config
    except ImportError:
        return None
    return previous_config.get()


@contextlib.contextmanager
def leaf_spec_deprecation_ignored() -> Iterator[None]:
    """Keeps torch's ``FutureWarning`` that ``LeafSpec`` is deprecated off the console while the block runs (a
    trainer's ``fit``, ``validate``, ``test`` or ``predict``): Lightning builds one for each dataloader of every run
    (its ``_tree_flatten`` in ``lightning.pytorch.utilities._pytree``), which nothing in mmoe calls or can avoid.

    ``warnings.catch_warnings`` is not thread-safe: a thread that changes the warning filters while the block runs has
    its change undone at the block's end, and the filter applies to every thread meanwhile (only to this message from
    that module)."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
            category=FutureWarning,
            module=r"lightning\.pytorch\.utilities\._pytree",
        )
        yield
