"""``mmoe fit | validate | test | predict`` through LightningCLI (:class:`MMoECLI`)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import lightning as L
from jsonargparse import Namespace
from jsonargparse.typing import import_object
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from mmoe.config.ckpt_hparams import (
    command_line_model_arguments,
    differences,
    init_parameters,
    input_error,
    is_file_name,
    named_in,
    same_value,
    show,
    stored_by_design,
    without_keys,
)
from mmoe.config.overrides import Overrides, model_argument_names, overrides_for
from mmoe.config.safety import install_config_safety, parse_errors_in_one_line
from mmoe.config.trainer_values import non_finite_trainer_field
from mmoe.io import one_line, report_error
from mmoe.runtime.checkpoint_saving import checkpoint_saving_arguments
from mmoe.runtime.layout import RunLayout, blocked_run_path
from mmoe.runtime.lightning_internals import HookedLightningCLI, leaf_spec_deprecation_ignored, parse_config
from mmoe.runtime.non_finite import NonFiniteGuard, NonFiniteTraining, report_divergence
from mmoe.runtime.optimizer import nest_optimizer_arguments
from mmoe.runtime.preemption import with_preemption
from mmoe.runtime.resume import LAST, checkpoint_folders, read_checkpoint
from mmoe.runtime.routing_callback import RoutingStatsCallback
from mmoe.runtime.run_lock import RunFolderLocks, quiet_fresh_folder_warning
from mmoe.runtime.run_logs import CSV_LOGGER, ContinueCSVLogs
from mmoe.runtime.throughput import Throughput
from mmoe.safe_load import require_finite_weights

#: The TensorBoard logger of a run folder (:func:`fill_run_folder`; TensorBoard's event files continue by themselves).
TENSORBOARD_LOGGER = "lightning.pytorch.loggers.TensorBoardLogger"

#: What ``--ckpt_path`` must be, as its errors name it.
TASK_CHECKPOINT = "a Lightning checkpoint of an mmoe task, written by mmoe fit"


def backbone_image_size(backbone) -> int:
    return backbone.config.image_size


def backbone_patch_size(backbone) -> int:
    return backbone.config.patch_size


def answer_vocab(hparams) -> str | None:
    return hparams.get("answer_vocab")


def classes(hparams) -> str | None:
    return hparams.get("classes")


def text_tokenizer(hparams) -> str | None:
    return hparams.get("text_tokenizer")


@dataclasses.dataclass(frozen=True)
class DataLink:
    """A data argument set from the instantiated model: ``value(getattr(model, attribute))``, which is the model's
    argument ``model_argument``."""

    attribute: str
    model_argument: str
    value: Callable[[Any], Any]


#: Data arguments that follow the model: its backbone's image and patch size (a ``pretrained`` backbone's come from
#: its checkpoint), the VQA answer vocabulary and the classification classes. A DataModule without the argument is
#: left alone.
DATA_LINKS = {
    "image_size": DataLink("backbone", "model.init_args.backbone.image_size", backbone_image_size),
    "patch_size": DataLink("backbone", "model.init_args.backbone.patch_size", backbone_patch_size),
    "answer_vocab": DataLink("hparams", "model.init_args.answer_vocab", answer_vocab),
    "classes": DataLink("hparams", "model.init_args.classes", classes),
    "text_tokenizer": DataLink("hparams", "model.init_args.text_tokenizer", text_tokenizer),
}


class MMoECLI(HookedLightningCLI):
    """LightningCLI over any mmoe task (``model.class_path``) and DataModule (``data.class_path``).

    Every knob is a typed ``__init__`` argument, so ``mmoe fit --help`` and ``--print_config`` explain the run, and
    an unknown key in a config is an error.

    Settings the model and the data both need are given once, to the model, and linked to the data
    (:data:`DATA_LINKS`); a data value given anyway must agree with the model's.

    With ``--ckpt_path`` the checkpoint must be one of the config's task (``model.class_path``), and LightningCLI sets
    the model's arguments to the hyper-parameters saved in the checkpoint, over the config file; here a model argument
    named on the command line (``--model.init_args.num_beams 5``, ``--model.init_args.optimizer.learning_rate 1e-5``:
    that value only, the rest of the checkpoint's optimiser stays) keeps its value, so decoding and output options can
    change between training and prediction. Each value that differs between the checkpoint and the config is named on
    stderr with the one used. Checkpoints are loaded with ``weights_only=True``: no code runs from them; those written
    before the ``optimizer`` argument (flat ``learning_rate``, ``betas``, ...) are read with those values moved into it.

    The run folder is ``trainer.default_root_dir``, stated once: what a config leaves out is put in it
    (:func:`fill_run_folder`: without ``trainer.logger``, TensorBoard and CSV logs; the ``ModelCheckpoint`` and
    ``RoutingStatsCallback`` of ``trainer.callbacks`` without a folder write there). A folder a config gives is kept.

    Bad input (an invalid config value, an unreadable checkpoint, a checkpoint of another task) ends with one line on
    stderr and exit code 2.

    ``mmoe predict`` that wrote predictions for fewer samples than the predicted split's manifests hold (corrupt or
    lost samples, ``trainer.limit_predict_batches``) says so in one line and exits with code 2, unless
    ``--allow_partial_predictions true``; the predictions file is written either way.
    """

    def __init__(self, *args: Any, overrides: Overrides | None = None, **kwargs: Any) -> None:
        """LightningCLI's arguments; ``overrides``: options laid over the parsed ``args`` in the same parse
        (:mod:`mmoe.config.overrides`: nested as in a config file, ``{"trainer": {"max_steps": 10}}``, or a function
        of the parsed subcommand config that gives them); the model arguments they set count as named on the command
        line. With ``overrides`` (even empty) the run counts as launched from Python: a preempted run's resume hint
        names ``ckpt_path``, not a command line."""
        self.overrides = overrides
        install_config_safety()
        self.run_folder_locks = RunFolderLocks()
        try:
            super().__init__(*args, **kwargs)
        finally:
            self.run_folder_locks.release()

    @staticmethod
    def every_subcommand() -> dict[str, set[str]]:
        # No ``--weights_only`` option: checkpoints are always loaded with weights_only=True.
        return {name: skip | {"weights_only"} for name, skip in LightningCLI.subcommands().items()}

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # Callbacks of every run, set by their own config sections (``non_finite:``, ``throughput:``).
        parser.add_lightning_class_args(NonFiniteGuard, "non_finite")
        parser.add_lightning_class_args(Throughput, "throughput")
        for name, link in DATA_LINKS.items():
            source = f"model.{link.attribute}"
            parser.link_arguments(source, f"data.init_args.{name}", compute_fn=link.value, apply_on="instantiate")

    def add_subcommand_arguments(self, parser: LightningArgumentParser, subcommand: str) -> None:
        if subcommand == "predict":
            parser.add_argument(
                "--allow_partial_predictions",
                type=bool,
                default=False,
                help="Exit 0 when fewer samples were predicted than the split holds (the shortfall is still reported)",
            )

    def after_predict(self) -> None:
        """Fails the command when fewer samples were predicted than the split holds (see the class docstring)."""
        shortfall = partial_predictions(self.model, self.datamodule)
        if shortfall is None:
            return
        if not self.config["predict"].get("allow_partial_predictions"):
            self.fail(f"{shortfall} (pass --allow_partial_predictions true to accept them)")
        if rank_zero_only.rank == 0:
            print(f"mmoe predict: {shortfall} (accepted: --allow_partial_predictions)", file=sys.stderr)

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        from_python = self.overrides is not None or not (args is None or isinstance(args, list | tuple))
        self.argv = None if from_python else sys.argv[1:] if args is None else args
        self.command_line_model_arguments = command_line_model_arguments(sys.argv[1:] if args is None else args)
        with parse_errors_in_one_line(
            [parser, *self.subcommand_parsers.values()], sys.argv[1:] if args is None else args
        ):
            # LightningCLI's parse, less its warning when ``args`` comes with a command line of the process's own:
            # mmoe gives ``args`` from Python by design (the demo and pipeline run inside ``mmoe demo``'s process).
            # Options laid over the files are checked with them in the second parse: the first leaves the check out.
            laid_over = callable(self.overrides) or bool(self.overrides)
            self.config = parse_config(parser, args, validate=not laid_over)
            subcommand = self.config["subcommand"]
            overrides = overrides_for(self.overrides, self.config[subcommand])
            if laid_over:
                self.command_line_model_arguments |= model_argument_names(overrides)
                self.config = parser.parse_object({subcommand: overrides}, self.config)

    def fail(self, message: str) -> NoReturn:
        """Ends the command with ``message`` in one line on stderr and exit code 2."""
        raise SystemExit(report_error(self.config.get("subcommand") or "fit", message))

    def subcommand_kwargs(self, subcommand: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        return kwargs | {"weights_only": True}

    def run_subcommand(self, subcommand: str) -> None:
        """LightningCLI's, with mmoe's errors about the input (a missing shard, a schedule without a length) and
        weights that do not fit the model reported in one line."""
        try:
            self.run_folder_locks.hold(subcommand, self.subcommand_value(self.config, "trainer"), self.trainer_defaults)
            for callback in self.trainer.checkpoint_callbacks:
                quiet_fresh_folder_warning(callback)
            with leaf_spec_deprecation_ignored():  # around the trainer's threads too: see its thread-safety note
                super().run_subcommand(subcommand)
        except (FileNotFoundError, ValueError) as error:
            cause = input_error(error)
            if cause is None:
                raise
            self.fail(one_line(cause))
        except RuntimeError as error:
            if not str(error).startswith("Error(s) in loading state_dict"):
                raise
            ckpt_path = self.config[subcommand].get("ckpt_path")
            self.fail(f"--ckpt_path {ckpt_path} does not fit the model the config builds: {one_line(error)}")
        except NonFiniteTraining as error:
            raise SystemExit(report_divergence(subcommand, error)) from None

    def merge_checkpoint_hyperparameters(self) -> None:
        """LightningCLI's merge of the checkpoint's hyper-parameters into the config, less the arguments named on the
        command line, once the checkpoint is known to be a readable one of the config's task; ``last`` is first resolved
        to the run's latest checkpoint file (:func:`mmoe.runtime.resume.read_checkpoint`)."""
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if not ckpt_path or (ckpt_path != LAST and not is_file_name(str(ckpt_path))):
            return
        folders = checkpoint_folders(self.config[subcommand].get("trainer"), self.trainer_defaults.get("callbacks"))
        try:
            ckpt_path, state = read_checkpoint(str(ckpt_path), folders, subcommand, TASK_CHECKPOINT)
            require_finite_weights(state, ckpt_path, "--ckpt_path")
        except (FileNotFoundError, ValueError) as error:
            self.fail(str(error))
        self.config[subcommand].ckpt_path = ckpt_path  # ``last`` as the file it is, for Lightning too
        hparams = nest_optimizer_arguments(dict(state.get("hyper_parameters") or {}))
        del state  # the weights: Lightning loads the file again to restore them
        hparams.pop("_instantiator", None)
        model = self.config[subcommand].get("model")
        saved_class = hparams.get("_class_path")
        if isinstance(model, Namespace) and saved_class and model.get("class_path") not in (None, saved_class):
            self.fail(
                f"--ckpt_path {ckpt_path} is a checkpoint of {saved_class}, but the config's model.class_path is "
                f"{model.class_path}: give the config of the task the checkpoint was trained for"
            )
        if isinstance(model, Namespace) and isinstance(model.get("init_args"), Namespace):
            self.report_differences(str(ckpt_path), hparams, model.init_args.as_dict())
        hparams = without_keys(hparams, self.command_line_model_arguments)
        if "_class_path" in hparams:
            hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
        if not hparams:
            return
        try:
            self.config = self.parser.parse_object({subcommand: {"model": hparams}}, self.config)
        except SystemExit:
            print(f"mmoe {subcommand}: the hyper-parameters saved in {ckpt_path} do not parse (above)", file=sys.stderr)
            raise

    def report_differences(self, ckpt_path: str, saved: dict, given: dict) -> None:
        """One stderr line per model value that differs between the checkpoint and the config, naming the one used:
        the checkpoint's, or the command line's for arguments named there."""
        if rank_zero_only.rank != 0:
            return
        for name, value in saved.items():
            if name.startswith("_") or name not in given or stored_by_design(name, value, given[name]):
                continue
            for key, ours, theirs in differences(value, given[name], f"model.init_args.{name}"):
                if key.endswith(".moe.frozen") and saved.get("frozen_routing"):
                    continue  # frozen_routing stores the architecture it built, with frozen MoE layers
                if named_in(key.removeprefix("model.init_args."), self.command_line_model_arguments):
                    choice = f"command line {show(theirs)} used over checkpoint {show(ours)}"
                else:
                    choice = f"checkpoint {show(ours)} used over config {show(theirs)}"
                print(f"mmoe {self.config['subcommand']}: --ckpt_path {ckpt_path}: {key}: {choice}", file=sys.stderr)

    def before_instantiate_classes(self) -> None:
        trainer = self.subcommand_value(self.config, "trainer")
        if isinstance(trainer, Namespace):
            problem = non_finite_trainer_field(trainer) or blocked_run_path(trainer.get("default_root_dir"))
            if problem is not None:
                self.fail(problem)
            fill_run_folder(trainer)

    def instantiate_classes(self) -> None:
        """LightningCLI's, with an invalid value (a config's ``ValueError``, a missing file) reported in one line, the
        data values given for linked arguments checked against the model's, and the text tokenizer checked against
        the backbone's text embedding (a BEiT-3 backbone with open_clip's ids is refused)."""
        given = self.given_linked_values()
        try:
            super().instantiate_classes()
        except (FileNotFoundError, ValueError) as error:
            cause = input_error(error)
            if cause is None:
                raise
            self.fail(one_line(cause))
        for name, value in given.items():
            link = DATA_LINKS[name]
            if not hasattr(self.model, link.attribute):  # not an mmoe task: nothing was linked
                continue
            linked = link.value(getattr(self.model, link.attribute))
            if not same_value(value, linked):
                self.fail(
                    f"data.init_args.{name}={value} disagrees with {link.model_argument}={linked} (the data's {name} "
                    "follows the model's: leave it out of the data arguments)"
                )
        tokenizer = getattr(self.datamodule, "tokenizer", None)
        backbone = getattr(self.model, "backbone", None)
        if tokenizer is not None and backbone is not None:
            name = self.model.hparams.get("text_tokenizer") or "open_clip's BPE (model.init_args.text_tokenizer: null)"
            try:
                tokenizer.ids.check_embedding(backbone.config.vocab_size, f"the text tokenizer {name}")
            except ValueError as error:
                self.fail(str(error))

    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        """LightningCLI's, with checkpoints saved whole and at the last step (:func:`checkpoint_saving_arguments`), a
        resumed run's CSV logs continuing the earlier ones (``ContinueCSVLogs``), and which stops on a termination
        signal after the step in progress and saves it (:mod:`mmoe.runtime.preemption`)."""
        trainer_config = self.subcommand_value(self.config_init, "trainer", default={})
        kwargs = kwargs | checkpoint_saving_arguments({**trainer_config, **kwargs})
        trainer = super().instantiate_trainer(**kwargs)
        trainer.callbacks.append(ContinueCSVLogs())
        return with_preemption(trainer, self.argv)

    def given_linked_values(self) -> dict[str, Any]:
        """The values the config gives to linked data arguments (:data:`DATA_LINKS`), less those equal to the
        DataModule's defaults (which a config cannot be told apart from)."""
        data = self.subcommand_value(self.config, "data")
        if not isinstance(data, Namespace) or not isinstance(data.get("init_args"), Namespace):
            return {}
        parameters = init_parameters(data.get("class_path"))
        given = {}
        for name in DATA_LINKS:
            value = data.init_args.get(name)
            if name in parameters and value is not None and value != parameters[name].default:
                given[name] = value
        return given


def fill_run_folder(trainer: Namespace) -> None:
    """Puts what the parsed ``trainer`` config leaves out in its run folder, ``default_root_dir``
    (:class:`RunLayout`): without ``logger`` (null), a TensorBoard and a CSV logger there (``tensorboard/``, ``csv/``;
    the CSV one a :class:`mmoe.runtime.run_logs.ContinuingCSVLogger`, which keeps earlier rows); a ``ModelCheckpoint``
    of ``callbacks`` without ``dirpath`` writes to ``checkpoints/``, a ``RoutingStatsCallback`` without ``save_dir``
    ``routing_stats.json`` in the folder. Nothing changes without ``default_root_dir``, nor
    what the config gives (``logger: false`` logs nothing); callbacks given as objects are left alone."""
    root = trainer.get("default_root_dir")
    if root is None:
        return
    layout = RunLayout(Path(root))
    if trainer.get("logger") is None:
        trainer.logger = []
        for class_path, logs in ((TENSORBOARD_LOGGER, layout.tensorboard_logs), (CSV_LOGGER, layout.csv_logs)):
            init_args = Namespace(save_dir=str(layout.root), name=logs.name)
            trainer.logger.append(Namespace(class_path=class_path, init_args=init_args))
    for callback in trainer.get("callbacks") or []:
        if not isinstance(callback, Namespace) or not isinstance(callback.get("init_args"), Namespace):
            continue
        kind, init_args = import_object(callback.class_path), callback.init_args
        if issubclass(kind, ModelCheckpoint) and init_args.get("dirpath") is None:
            init_args.dirpath = str(layout.checkpoints)
        elif issubclass(kind, RoutingStatsCallback) and init_args.get("save_dir") is None:
            init_args.save_dir = str(layout.root)


def partial_predictions(model: Any, datamodule: Any) -> str | None:
    """What is missing when ``model`` (after ``trainer.predict``) predicted fewer samples than ``datamodule``'s
    predicted split (``"test"``) holds by its manifests; None when it predicted them all, or when either count is
    unknown (a task without ``predicted_count``, shards without manifest counts)."""
    predicted = getattr(model, "predicted_count", None)
    split_size = getattr(datamodule, "split_size", None)
    expected = split_size("test") if callable(split_size) else None
    if predicted is None or expected is None or predicted >= expected:
        return None
    return (
        f"predictions were written for {predicted} of the {expected} samples the test split's manifests hold "
        f"({expected - predicted} missing; see 'samples skipped' above)"
    )


def cli_arguments(**kwargs: Any) -> dict[str, Any]:
    """The :class:`MMoECLI` arguments of every ``mmoe`` Lightning subcommand (any task, any DataModule), with
    ``kwargs`` over them."""
    return (
        dict(
            model_class=L.LightningModule,
            datamodule_class=L.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_kwargs={"overwrite": True},
            auto_configure_optimizers=False,
        )
        | kwargs
    )


def lightning_command(argv: Sequence[str]) -> int:
    # From the console script argv is sys.argv[1:] itself; LightningCLI reads that when args is None.
    MMoECLI(**cli_arguments(args=None if list(argv) == sys.argv[1:] else list(argv)))
    return 0
