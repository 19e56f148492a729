"""The private Lightning, jsonargparse and torch APIs mmoe reaches (:mod:`mmoe.runtime.lightning_internals`,
:mod:`mmoe.runtime.torch_internals`), checked against the installed versions: each still exists, takes the arguments
mmoe passes and, where mmoe overrides it, is still called by Lightning. An upgrade that changes one fails here with
the API and the version named."""

from __future__ import annotations

import contextvars
import inspect
import signal
import warnings
from collections.abc import Callable
from typing import Any

import jsonargparse
import lightning as L
import pytest
import torch
import yaml
from jsonargparse import Namespace
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities import combined_loader
from torch.nn.parallel import DistributedDataParallel

from mmoe.runtime.lightning_internals import (
    HookedLightningCLI,
    KeepingExperimentWriter,
    SignalConnector,
    config_before_file,
    config_file_being_read,
    csv_logger_experiment,
    leaf_spec_deprecation_ignored,
    named_subcommand,
    parse_config,
    replace_signal_connector,
    save_last_checkpoint,
)
from mmoe.runtime.torch_internals import keep_ddp_off, tensor_version

VERSIONS = {"lightning": L.__version__, "jsonargparse": jsonargparse.__version__, "torch": torch.__version__}


def changed(api: str, library: str, problem: str) -> None:
    pytest.fail(
        f"{api} changed in {library} {VERSIONS[library]}: {problem} (mmoe reaches it in mmoe.tasks.*_internals)"
    )


def require_callable(owner: Any, name: str, library: str, *args: Any, **kwargs: Any) -> None:
    """``owner.name`` is callable with ``args`` and ``kwargs`` (``self`` included for a method of a class)."""
    api = f"{getattr(owner, '__qualname__', owner.__name__)}.{name}"
    function = inspect.getattr_static(owner, name, None)
    function = function.__func__ if isinstance(function, staticmethod | classmethod) else function
    if not callable(function):
        changed(api, library, "it is gone or no longer callable")
    try:
        signature = inspect.signature(function)
    except ValueError:
        return  # a builtin without a signature: its test calls it instead
    try:
        signature.bind(*args, **kwargs)
    except TypeError as error:
        changed(api, library, f"it no longer takes the arguments mmoe passes ({error})")


def require_called(owner: type, name: str, library: str, caller: Callable) -> None:
    """Lightning's ``caller`` still calls the method ``name`` that mmoe overrides."""
    if f"self.{name}(" not in inspect.getsource(caller):
        changed(f"{owner.__qualname__}.{name}", library, f"{caller.__qualname__} no longer calls it")


@pytest.mark.parametrize(
    ("name", "arguments", "caller"),
    [
        ("_prepare_subcommand_parser", (None, L.Trainer, "fit"), LightningCLI._add_subcommands),
        ("_prepare_subcommand_kwargs", (None, "fit"), LightningCLI._run_subcommand),
        ("_parse_ckpt_path", (None,), LightningCLI.__init__),
        ("_set_seed", (None,), LightningCLI.__init__),
        ("_run_subcommand", (None, "fit"), LightningCLI.__init__),
    ],
)
def test_the_lightning_cli_steps_mmoe_overrides_are_still_called_with_its_arguments(name, arguments, caller):
    require_callable(LightningCLI, name, "lightning", *arguments)
    require_called(LightningCLI, name, "lightning", caller)
    assert name in vars(HookedLightningCLI)  # overridden, and so turned into a public hook


def test_the_lightning_cli_lookups_mmoe_reads_are_still_there():
    require_callable(LightningCLI, "_get", "lightning", None, Namespace(), "trainer", None)
    if "self._subcommand_parsers[subcommand] = " not in inspect.getsource(LightningCLI._add_subcommands):
        changed("LightningCLI._subcommand_parsers", "lightning", "_add_subcommands no longer fills it")


def test_the_lookup_of_a_value_reads_the_running_subcommands_section():
    cli = HookedLightningCLI.__new__(HookedLightningCLI)
    cli.subcommand = "fit"
    config = Namespace(fit=Namespace(trainer=Namespace(max_steps=3)), trainer="top level")
    assert cli.subcommand_value(config, "trainer").max_steps == 3
    assert cli.subcommand_value(config, "seed_everything", 7) == 7
    cli.subcommand = None
    assert cli.subcommand_value(config, "trainer") == "top level"


@pytest.mark.parametrize(
    "caller",
    [LightningCLI._setup_parser_kwargs, LightningCLI._add_subcommands, LightningCLI._prepare_subcommand_parser],
)
def test_lightning_still_asks_the_cli_instance_for_its_subcommands(caller):
    require_called(LightningCLI, "subcommands", "lightning", caller)


def test_a_command_line_naming_a_subcommand_builds_that_subcommands_parser_alone():
    from mmoe.config.cli import MMoECLI, cli_arguments

    class ParserOnly(MMoECLI):
        def parse_arguments(self, parser, args) -> None:
            raise SystemExit(0)

    every = set(MMoECLI.every_subcommand())
    assert every == {"fit", "validate", "test", "predict"}
    for argv, built in ((["predict", "--print_config"], {"predict"}), (["--help"], every), (["fitt"], every)):
        cli = ParserOnly.__new__(ParserOnly)
        with pytest.raises(SystemExit):
            cli.__init__(**cli_arguments(args=argv), overrides={})
        assert set(cli.subcommand_parsers) == built
    assert named_subcommand({"fit": {}}, MMoECLI.every_subcommand()) is None  # a parsed config: every parser


def test_a_parse_may_leave_out_its_final_check():
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--steps", type=int, required=True)
    assert parse_config(parser, [], validate=False).steps is None
    with pytest.raises(jsonargparse.ArgumentError, match="steps"):
        parse_config(parser, [])
    assert parse_config(parser, {"steps": 3}, validate=False).steps == parse_config(parser, ["--steps", "3"]).steps


def test_the_signal_connector_is_still_the_trainers_and_replaceable():
    require_callable(SignalConnector, "__init__", "lightning", None, None)
    for name in ("register_signal_handlers", "teardown"):
        require_callable(SignalConnector, name, "lightning", None)
    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, accelerator="cpu")
    if not isinstance(getattr(trainer, "_signal_connector", None), SignalConnector):
        changed("Trainer._signal_connector", "lightning", "a trainer no longer holds a _SignalConnector there")
    for step in ("_signal_connector.register_signal_handlers()", "_signal_connector.teardown()"):
        if step not in inspect.getsource(L.Trainer):
            changed("Trainer._signal_connector", "lightning", f"the trainer no longer calls {step}")
    connector = SignalConnector(trainer)
    replace_signal_connector(trainer, connector)
    before = signal.getsignal(signal.SIGTERM)
    try:
        trainer._signal_connector.register_signal_handlers()
    finally:
        trainer._signal_connector.teardown()
    assert trainer._signal_connector is connector and signal.getsignal(signal.SIGTERM) == before


def test_the_csv_writer_deletes_earlier_rows_unless_kept(tmp_path):
    require_callable(ExperimentWriter, "_check_log_dir_exists", "lightning", None)
    for kept, writer in ((True, KeepingExperimentWriter), (False, ExperimentWriter)):
        folder = tmp_path / writer.__name__
        folder.mkdir()
        (folder / ExperimentWriter.NAME_METRICS_FILE).write_text("step,loss\n0,1.0\n")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Lightning's own warning that the rows will be deleted
            writer(str(folder))
        if (folder / ExperimentWriter.NAME_METRICS_FILE).is_file() != kept:
            changed("_ExperimentWriter._check_log_dir_exists", "lightning", "it no longer decides whether rows stay")


def test_the_csv_loggers_writer_is_made_on_first_use_by_the_writer_given(tmp_path):
    logger = CSVLogger(tmp_path, name="csv", version=0)
    if getattr(logger, "_experiment", False) is not None or not callable(getattr(logger, "_fs", None).makedirs):
        changed("CSVLogger._experiment / _fs", "lightning", "a new logger no longer holds them")
    writer = csv_logger_experiment(logger, KeepingExperimentWriter)
    assert isinstance(writer, KeepingExperimentWriter) and writer.log_dir == logger.log_dir
    assert csv_logger_experiment(logger, ExperimentWriter) is writer and logger.experiment is writer


def test_the_model_checkpoint_methods_saving_the_last_one_now_are_still_there():
    callback = ModelCheckpoint()
    if not isinstance(getattr(callback, "_last_global_step_saved", None), int):
        changed("ModelCheckpoint._last_global_step_saved", "lightning", "a new callback no longer holds a step there")
    require_callable(ModelCheckpoint, "_monitor_candidates", "lightning", callback, None)
    require_callable(ModelCheckpoint, "_save_last_checkpoint", "lightning", callback, None, {})


class StepFive:
    """A trainer at global step 5."""

    global_step = 5


class RecordingCheckpoint(ModelCheckpoint):
    def __init__(self, saved_step: int) -> None:
        super().__init__(save_last=True)
        self._last_global_step_saved = saved_step
        self.saved: list[dict] = []

    def _monitor_candidates(self, trainer) -> dict:
        return {"step": trainer.global_step}

    def _save_last_checkpoint(self, trainer, monitor_candidates) -> None:
        self.saved.append(monitor_candidates)


def test_the_last_checkpoint_is_saved_now_unless_saved_at_this_step():
    behind, current = RecordingCheckpoint(saved_step=3), RecordingCheckpoint(saved_step=5)
    save_last_checkpoint(behind, StepFive())
    save_last_checkpoint(current, StepFive())
    assert behind.saved == [{"step": 5}] and current.saved == []


def test_jsonargparse_still_keeps_the_stack_of_config_files_being_read(tmp_path):
    try:
        from jsonargparse._util import config_load_stack, load_config_path_context
    except ImportError as error:
        changed("jsonargparse._util.config_load_stack", "jsonargparse", f"it is gone ({error})")
    if not isinstance(config_load_stack, contextvars.ContextVar) or config_load_stack.get() != ():
        changed("jsonargparse._util.config_load_stack", "jsonargparse", "it is no longer an empty ContextVar at rest")
    assert config_file_being_read() == ""
    outer, inner = tmp_path / "outer.yaml", tmp_path / "inner.yaml"
    for file in (outer, inner):
        file.write_text("{}")
    read = [jsonargparse.Path(str(file), mode="fr") for file in (outer, inner)]
    with load_config_path_context(read[0]), load_config_path_context(read[1]):
        if config_file_being_read() != str(inner):
            changed("jsonargparse._util.config_load_stack", "jsonargparse", "its top is no longer the file read")


def test_jsonargparse_still_keeps_the_config_parsed_before_a_config_file(tmp_path):
    try:
        from jsonargparse._actions import previous_config
    except ImportError as error:
        changed("jsonargparse._actions.previous_config", "jsonargparse", f"it is gone ({error})")
    assert config_before_file() is None
    seen = []
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--config", action=jsonargparse.ActionConfigFile)
    parser.add_argument("--steps", type=int, default=0)
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first.write_text("steps: 3")
    second.write_text("{}")
    loader = jsonargparse.get_loader("yaml")

    def recording(text, *args):
        seen.append(config_before_file())
        return loader(text, *args)

    # set_loader replaces the loader's exceptions too: the ones mmoe's loader is installed with (config safety) are
    # put back with it, or every later parse in this process would let a config error escape unreported
    jsonargparse.set_loader("yaml", recording, exceptions=(yaml.YAMLError,))
    try:
        parser.parse_args(["--config", str(first), "--config", str(second)])
    finally:
        jsonargparse.set_loader("yaml", loader, exceptions=(yaml.YAMLError,))
    if not isinstance(previous_config, contextvars.ContextVar) or not any(
        isinstance(config, jsonargparse.Namespace) and config.get("steps") == 3 for config in seen
    ):
        changed("jsonargparse._actions.previous_config", "jsonargparse", "it no longer holds the earlier settings")


def test_the_version_counter_counts_in_place_changes():
    if not isinstance(getattr(torch.ones(1), "_version", None), int):
        changed("Tensor._version", "torch", "it is gone")
    tensor = torch.ones(3)
    start = tensor_version(tensor)
    tensor.mul_(1.0)
    after_mul = tensor_version(tensor)
    torch._foreach_mul_([tensor], 2.0)
    if not start < after_mul < tensor_version(tensor):
        changed("Tensor._version", "torch", "an in-place operation no longer moves it on")
    parameter = torch.nn.Parameter(torch.ones(2))
    (parameter * 2).sum().backward()
    grad, version = parameter.grad, tensor_version(parameter.grad)
    (parameter * 2).sum().backward()
    if parameter.grad is not grad or tensor_version(parameter.grad) == version:
        changed("Tensor._version", "torch", "a gradient accumulated into no longer moves it on")


def test_ddp_still_reads_the_parameters_kept_off_it():
    require_callable(DistributedDataParallel, "_set_params_and_buffers_to_ignore_for_model", "torch", None, [])
    if "module._ddp_params_and_buffers_to_ignore" not in inspect.getsource(DistributedDataParallel.__init__):
        changed(
            "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model", "torch", "DDP no longer reads it"
        )
    module = torch.nn.Linear(2, 2)
    keep_ddp_off(module, ["weight"])
    assert list(module._ddp_params_and_buffers_to_ignore) == ["weight"]


def test_lightnings_leaf_spec_deprecation_is_the_only_warning_kept_off_and_only_inside_the_block():
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with leaf_spec_deprecation_ignored():
            combined_loader._tree_flatten([[1, 2], "x"])  # builds LeafSpecs, as for every run's dataloaders
            warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated", FutureWarning, stacklevel=1)
        inside = [str(warning.message) for warning in shown]
        combined_loader._tree_flatten([[1, 2], "x"])
    assert inside == ["`isinstance(treespec, LeafSpec)` is deprecated"]
    assert len(shown) > 1 and all("LeafSpec" in str(warning.message) for warning in shown)  # after it: shown again
