"""``mmoe fit | validate | test | predict`` through LightningCLI, and ``mmoe tokenizer fit``."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import lightning as L
import torch
import yaml
from jsonargparse import Namespace
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from mmoe.model import MoEPlan
from mmoe.safe_load import load_checkpoint_file
from mmoe.tasks.optimizer import nest_optimizer_arguments

#: Where mmoe's code lives: errors raised there are mmoe's own messages (:func:`input_error`).
PACKAGE = Path(__file__).resolve().parents[1]

#: What ``--ckpt_path`` must be, as its errors name it.
TASK_CHECKPOINT = "a Lightning checkpoint of an mmoe task, written by mmoe fit"


def backbone_image_size(backbone) -> int:
    return backbone.config.image_size


def backbone_patch_size(backbone) -> int:
    return backbone.config.patch_size


def answer_vocab(hparams) -> str | None:
    return hparams.get("answer_vocab")


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
#: its checkpoint) and the VQA answer vocabulary. A DataModule without the argument is left alone.
DATA_LINKS = {
    "image_size": DataLink("backbone", "model.init_args.backbone.image_size", backbone_image_size),
    "patch_size": DataLink("backbone", "model.init_args.backbone.patch_size", backbone_patch_size),
    "answer_vocab": DataLink("hparams", "model.init_args.answer_vocab", answer_vocab),
    "text_tokenizer": DataLink("hparams", "model.init_args.text_tokenizer", text_tokenizer),
}


class MMoECLI(LightningCLI):
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

    Bad input (an invalid config value, an unreadable checkpoint, a checkpoint of another task) ends with one line on
    stderr and exit code 2.

    ``mmoe predict`` that wrote predictions for fewer samples than the predicted split's manifests hold (corrupt or
    lost samples, ``trainer.limit_predict_batches``) says so in one line and exits with code 2, unless
    ``--allow_partial_predictions true``; the predictions file is written either way.
    """

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        # No ``--weights_only`` option: checkpoints are always loaded with weights_only=True.
        return {name: skip | {"weights_only"} for name, skip in LightningCLI.subcommands().items()}

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        for name, link in DATA_LINKS.items():
            source = f"model.{link.attribute}"
            parser.link_arguments(source, f"data.init_args.{name}", compute_fn=link.value, apply_on="instantiate")

    def _prepare_subcommand_parser(self, klass: type, subcommand: str, **kwargs: Any) -> LightningArgumentParser:
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        if subcommand == "predict":
            parser.add_argument(
                "--allow_partial_predictions",
                type=bool,
                default=False,
                help="Exit 0 when fewer samples were predicted than the split holds (the shortfall is still reported)",
            )
        return parser

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
        self.command_line_model_arguments = command_line_model_arguments(sys.argv[1:] if args is None else args)
        super().parse_arguments(parser, args)

    def fail(self, message: str) -> NoReturn:
        """Ends the command with ``message`` in one line on stderr and exit code 2."""
        command = " ".join(["mmoe", *filter(None, [self.config.get("subcommand")])])
        print(f"{command}: {message}", file=sys.stderr)
        raise SystemExit(2)

    def _prepare_subcommand_kwargs(self, subcommand: str) -> dict[str, Any]:
        return super()._prepare_subcommand_kwargs(subcommand) | {"weights_only": True}

    def _run_subcommand(self, subcommand: str) -> None:
        """LightningCLI's, with mmoe's errors about the input (a missing shard, a schedule without a length) and
        weights that do not fit the model reported in one line."""
        try:
            super()._run_subcommand(subcommand)
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

    def _parse_ckpt_path(self) -> None:
        """LightningCLI's merge of the checkpoint's hyper-parameters into the config, less the arguments named on the
        command line, once the checkpoint is known to be a readable one of the config's task."""
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if not ckpt_path or not is_file_name(str(ckpt_path)):
            return
        try:
            state = load_checkpoint_file(ckpt_path, "--ckpt_path", TASK_CHECKPOINT)
        except (FileNotFoundError, ValueError) as error:
            self.fail(str(error))
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

    def given_linked_values(self) -> dict[str, Any]:
        """The values the config gives to linked data arguments (:data:`DATA_LINKS`), less those equal to the
        DataModule's defaults (which a config cannot be told apart from)."""
        data = self._get(self.config, "data")
        if not isinstance(data, Namespace) or not isinstance(data.get("init_args"), Namespace):
            return {}
        parameters = init_parameters(data.get("class_path"))
        given = {}
        for name in DATA_LINKS:
            value = data.init_args.get(name)
            if name in parameters and value is not None and value != parameters[name].default:
                given[name] = value
        return given


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
    saved, given = plain(saved), plain(given)
    if isinstance(saved, dict) and isinstance(given, dict):
        for name in [*saved, *(name for name in given if name not in saved)]:
            yield from differences(saved.get(name), given.get(name), f"{key}.{name}")
    elif saved != given:
        yield key, saved, given


def plain(value: Any) -> Any:
    """``value`` with Namespaces as dicts and tuples as lists, as a checkpoint holds them."""
    if isinstance(value, Namespace):
        value = value.as_dict()
    if isinstance(value, dict):
        return {name: plain(item) for name, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    return value


def show(value: Any) -> str:
    return json.dumps(value, default=str)


def one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


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


def lightning_command(argv: Sequence[str]) -> int:
    MMoECLI(
        L.LightningModule,
        L.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        # From the console script argv is sys.argv[1:] itself; LightningCLI reads that when args is None.
        args=None if list(argv) == sys.argv[1:] else list(argv),
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
    )
    return 0


def tokenizer_command(argv: Sequence[str]) -> int:
    """``mmoe tokenizer fit --data SHARDS --out codebook.pt``: learn the visual codebook (MIM targets)."""
    parser = argparse.ArgumentParser(prog="mmoe tokenizer", description=tokenizer_command.__doc__)
    sub = parser.add_subparsers(dest="action", required=True)
    fit = sub.add_parser("fit", help="k-means visual codebook over patches of training images")
    fit.add_argument("--data", required=True, nargs="+", help="shard files, directories or brace patterns with images")
    fit.add_argument("--out", required=True, help="codebook file to write")
    fit.add_argument("--size", type=int, default=512, help="number of visual tokens K")
    fit.add_argument("--image-size", type=int, default=64, help="image side the backbone sees")
    fit.add_argument("--patch-size", type=int, default=16)
    fit.add_argument("--pool", type=int, default=4, help="patches are average-pooled to pool x pool")
    fit.add_argument("--max-patches", type=int, default=200_000)
    fit.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(list(argv))

    from mmoe.data.pipelines import eval_image_batches
    from mmoe.tasks.visual_codebook import fit_codebook

    try:
        batches = eval_image_batches(args.data, image_size=args.image_size, batch_size=64)
        codebook = fit_codebook(
            batches, args.size, args.patch_size, args.pool, max_patches=args.max_patches, seed=args.seed
        )
    except (FileNotFoundError, ValueError) as error:
        print(f"mmoe tokenizer fit: {error}", file=sys.stderr)
        return 2
    codebook.save(args.out)
    print(json.dumps({"codebook": args.out, "size": codebook.size, "patch_size": args.patch_size}))
    return 0


def upcycle_command(argv: Sequence[str]) -> int:
    """``mmoe upcycle --ckpt dense.pth --config moe.yaml --out init.pt``: a MoE backbone whose experts start as copies
    of a dense backbone's FFNs (sparse upcycling), for ``model.init_args.pretrained``."""
    parser = argparse.ArgumentParser(prog="mmoe upcycle", description=upcycle_command.__doc__)
    parser.add_argument(
        "--ckpt", required=True, help="dense backbone: a released BEiT-3 checkpoint or any mmoe backbone / checkpoint"
    )
    parser.add_argument("--config", required=True, help="an mmoe config whose model.init_args.backbone.moe is the plan")
    parser.add_argument("--out", required=True, help="backbone file to write (atomically)")
    parser.add_argument("--noise", type=float, default=0.0, help="expert noise, a share of each weight's std")
    parser.add_argument("--seed", type=int, default=0, help="seed of the noise and of the new routers")
    args = parser.parse_args(list(argv))

    from mmoe.model.upcycle import upcycle
    from mmoe.tasks.checkpoint import export_backbone, load_backbone

    try:
        plan = moe_plan_of(args.config)
        dense = load_backbone(args.ckpt)
        torch.manual_seed(args.seed)
        moe = upcycle(dense, plan, noise=args.noise, seed=args.seed)
    except (FileNotFoundError, ValueError) as error:
        print(f"mmoe upcycle: {one_line(error)}", file=sys.stderr)
        return 2
    export_backbone(moe, args.out)
    layers = sorted({slot.index for slot in moe.moe_layers()})
    print(
        json.dumps({"backbone": args.out, "moe_layers": layers, "parameters": sum(p.numel() for p in moe.parameters())})
    )
    return 0


def moe_plan_of(config: str | Path) -> MoEPlan:
    """The :class:`MoEPlan` at ``model.init_args.backbone.moe`` of an mmoe config file."""
    path = Path(config)
    if not path.is_file():
        raise FileNotFoundError(f"config {path} does not exist")
    try:
        document = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ValueError(f"config {path} is not YAML: {one_line(error)}") from None
    moe = document
    for key in ("model", "init_args", "backbone", "moe"):
        moe = moe.get(key) if isinstance(moe, dict) else None
    if not isinstance(moe, dict):
        raise ValueError(f"config {path} has no model.init_args.backbone.moe (the MoE plan to upcycle into)")
    try:
        return MoEPlan(**moe)
    except TypeError as error:
        raise ValueError(f"config {path}: model.init_args.backbone.moe: {error}") from None


def export_command(argv: Sequence[str]) -> int:
    """``mmoe export-backbone --ckpt task.ckpt --out backbone.pt``: the backbone of a task checkpoint, for fine-tuning
    (the fine-tuning configs' ``pretrained`` argument reads either file)."""
    parser = argparse.ArgumentParser(prog="mmoe export-backbone", description=export_command.__doc__)
    parser.add_argument(
        "--ckpt", required=True, help="Lightning checkpoint of an mmoe task (e.g. checkpoints/last.ckpt)"
    )
    parser.add_argument("--out", required=True, help="backbone file to write (atomically)")
    args = parser.parse_args(list(argv))

    from mmoe.tasks.checkpoint import export_backbone, load_backbone

    try:
        backbone = load_backbone(args.ckpt)
    except (FileNotFoundError, ValueError) as error:
        print(f"mmoe export-backbone: {error}", file=sys.stderr)
        return 2
    export_backbone(backbone, args.out)
    print(json.dumps({"backbone": args.out, "parameters": sum(p.numel() for p in backbone.parameters())}))
    return 0
