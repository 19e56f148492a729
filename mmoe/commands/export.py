"""``mmoe export``: a checkpoint's backbone or whole fine-tuned task model as a pretrained folder (``model.safetensors``
and ``config.json``, :mod:`mmoe.model.pretrained`), which :func:`mmoe.tasks.from_pretrained` (the task model) and
:func:`mmoe.model.from_pretrained` (the backbone) load.

The folder's ``config.json`` is laid out as :mod:`mmoe.tasks.pretrained` describes: the files the task's arguments
name (:attr:`FineTuningTask.file_arguments`) are copied into ``files/`` and named relative to the folder.

SIGTERM or SIGINT stops ``mmoe export`` with one line and exit code 128 + the signal's number; the folder is then the
earlier one (or absent), never a part, and its staging folder is removed (:func:`stopping_on_signals`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from mmoe.io import one_line, report_error
from mmoe.model import MultiwayConfig, MultiwayTransformer
from mmoe.model.config import config_to_dict
from mmoe.model.pretrained import (
    FILES_FOLDER,
    FOLDER_FORMAT,
    check_destination,
    load_weights,
    save_pretrained,
    write_folder,
)
from mmoe.runtime.checkpoint import BACKBONE_FILES, pretrained_of
from mmoe.runtime.optimizer import nest_optimizer_arguments
from mmoe.safe_load import load_checkpoint_file, require_finite_weights
from mmoe.tasks.catalog import class_path, task_of_class_path
from mmoe.tasks.finetuning import FineTuningTask

#: The signals that stop ``mmoe export`` cleanly: ``kill``'s, ``timeout``'s and a scheduler's TERM, Ctrl-C's INT.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def export_task(state: dict, ckpt: Path, out: Path) -> dict[str, Any]:
    """Writes the fine-tuned task model of a loaded Lightning checkpoint ``state`` (of the file ``ckpt``) as the
    folder ``out``; returns what was written, for the command's summary line."""
    hyper_parameters, weights = state.get("hyper_parameters"), state.get("state_dict")
    saved = str(hyper_parameters.get("_class_path", "")) if isinstance(hyper_parameters, dict) else ""
    task = task_of_class_path(saved)
    if task is None or not isinstance(weights, dict):
        kind = f"a checkpoint of {saved}" if saved else "not a fine-tuning checkpoint"
        raise ValueError(
            f"checkpoint {ckpt} is {kind}, not of a fine-tuning task: pass --backbone-only to export its backbone"
        )
    weights = task.evaluated_weights(state)  # a classification fit's EMA where it kept one
    arguments = task_arguments(hyper_parameters, ckpt)
    files = task_files(task, arguments, ckpt)
    try:
        model = task(**(arguments | {"pretrained": None}))
        load_weights(model, weights, f"checkpoint {ckpt} does not fit its own {task.name} task")
    except (FileNotFoundError, TypeError, ValueError) as error:
        raise ValueError(f"checkpoint {ckpt}: {one_line(error)}") from None
    backbone = arguments.pop("backbone")
    arguments.pop("pretrained", None)
    arguments |= {name: relative for name, (relative, _) in files.items()}
    data = state.get("datamodule_hyper_parameters")
    length = data.get("max_text_length") if isinstance(data, dict) else None
    config = {
        "format": FOLDER_FORMAT,
        "backbone": backbone,
        "task": {"class_path": class_path(task), "name": task.name, "init_args": arguments, "max_text_length": length},
    }
    write_folder(out, config, weights, {relative: source for relative, source in files.values()})
    return {"task": task.name, "tensors": len(weights), "parameters": sum(p.numel() for p in model.parameters())}


def task_arguments(hyper_parameters: dict[str, Any], ckpt: Path) -> dict[str, Any]:
    """A task checkpoint's init arguments as JSON values: flat optimiser arguments nested, Lightning's own keys
    (``_class_path``, ``_instantiator``) left out, the backbone as a dict; a value JSON cannot hold is an error naming
    it."""
    arguments = {k: v for k, v in nest_optimizer_arguments(dict(hyper_parameters)).items() if not k.startswith("_")}
    if isinstance(arguments.get("backbone"), MultiwayConfig):
        arguments["backbone"] = config_to_dict(arguments["backbone"])
    for name, value in arguments.items():
        try:
            arguments[name] = json.loads(json.dumps(value))  # tuples become lists, as a config file gives them
        except (TypeError, ValueError):
            raise ValueError(
                f"checkpoint {ckpt}: model argument {name} is a {type(value).__name__}, which config.json cannot hold"
            ) from None
    return arguments


def task_files(task: type[FineTuningTask], arguments: dict[str, Any], ckpt: Path) -> dict[str, tuple[str, Path]]:
    """argument -> (its file's name in the folder, the file now) for each file the task's arguments name."""
    files = {}
    for name in task.file_arguments:
        if arguments.get(name) is None:
            continue
        source = Path(arguments[name])
        if not source.is_file():
            raise FileNotFoundError(
                f"checkpoint {ckpt}: model argument {name} names {source}, which does not exist (the folder holds a "
                "copy: restore the file where the checkpoint's run had it)"
            )
        files[name] = (f"{FILES_FOLDER}/{name}{''.join(source.suffixes)}", source)
    return files


def export_backbone_folder(state: dict, ckpt: Path, out: Path) -> dict[str, Any]:
    """Writes the backbone of a loaded checkpoint of any kind :func:`mmoe.runtime.checkpoint.read_pretrained` reads as
    the folder ``out``, every tensor in its stored dtype; returns what was written."""
    weights = pretrained_of(state, ckpt)
    backbone = MultiwayTransformer(weights.config)
    load_weights(backbone, weights.backbone, f"checkpoint {ckpt} does not match its own config", assign=True)
    save_pretrained(backbone, out)
    return {"task": None, "tensors": len(weights.backbone), "parameters": sum(p.numel() for p in backbone.parameters())}


def export_command(argv: Sequence[str]) -> int:
    """``mmoe export --ckpt CKPT --out FOLDER [--backbone-only]``: a checkpoint's fine-tuned task model (or, with
    ``--backbone-only``, its backbone) as a folder of ``model.safetensors`` and ``config.json``, loaded by
    ``mmoe.tasks.from_pretrained`` (task) or ``mmoe.model.from_pretrained`` (the backbone of either)."""
    parser = argparse.ArgumentParser(prog="mmoe export", description=export_command.__doc__)
    parser.add_argument(
        "--ckpt",
        required=True,
        help="Lightning checkpoint of an mmoe task; an exported backbone or a released BEiT-3 file gives its backbone",
    )
    parser.add_argument(
        "--out", required=True, help="folder to write (whole or not at all; an earlier export replaced)"
    )
    parser.add_argument("--backbone-only", action="store_true", help="write the backbone only, without the task head")
    args = parser.parse_args(list(argv))
    ckpt, out = Path(args.ckpt), Path(args.out)
    before = folder_identity(out)
    try:
        with stopping_on_signals():
            written = export_checkpoint(ckpt, out, args.backbone_only)
            print(json.dumps({"folder": str(out), **written}), flush=True)  # a stop meanwhile is still told
    except ExportStopped as stop:
        what = "was written whole" if folder_identity(out) not in (None, before) else "was not written"
        print(f"mmoe export: stopped by {stop.signal.name}: {out} {what}", file=sys.stderr, flush=True)
        return 128 + int(stop.signal)
    except (FileNotFoundError, ValueError) as error:
        return report_error("export", error)
    except OSError as error:
        where = f" ({error.filename})" if error.filename else ""
        return report_error("export", f"--out {out} cannot be written: {error.strerror or error}{where}")
    return 0


def export_checkpoint(ckpt: Path, out: Path, backbone_only: bool) -> dict[str, Any]:
    """The checkpoint ``ckpt`` read, checked and written as the folder ``out`` (its task model, or with
    ``backbone_only`` or a file without a task, its backbone); returns what was written."""
    check_destination(out)
    state = load_checkpoint_file(ckpt, "checkpoint", BACKBONE_FILES)
    require_finite_weights(state, ckpt)
    export = export_backbone_folder if backbone_only or "hyper_parameters" not in state else export_task
    with torch.no_grad():
        return export(state, ckpt, out)


class ExportStopped(BaseException):
    """A stop signal during ``mmoe export``, raised where the export was: it unwinds the write in progress, which
    removes its staging folder on the way (:func:`mmoe.model.pretrained.replace_folder`). Not an ``Exception``, so no
    handler of errors takes it for one."""

    def __init__(self, number: int) -> None:
        super().__init__(number)
        self.signal = signal.Signals(number)


@contextlib.contextmanager
def stopping_on_signals() -> Iterator[None]:
    """Within it, :data:`STOP_SIGNALS` raise :class:`ExportStopped` in the main thread (elsewhere, where Python
    cannot set handlers, they keep theirs); the handlers from before are put back at its end."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(number: int, frame: object) -> None:
        raise ExportStopped(number)

    previous = {number: signal.signal(number, stop) for number in STOP_SIGNALS}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def folder_identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of ``path``, None when absent: a new export's folder is a new one (renamed into place), so a
    change tells that the write was done."""
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_dev, found.st_ino
