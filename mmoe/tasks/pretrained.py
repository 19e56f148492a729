"""The task model of a folder written by ``mmoe export`` (:func:`from_pretrained`), rebuilt from the task catalog
(:mod:`mmoe.tasks.catalog`); the folder itself is written by :mod:`mmoe.commands.export`.

A task model's ``config.json`` names its task (``class_path``, ``name``), the text length its data had
(``max_text_length``, for ``mmoe infer``) and its init arguments as the checkpoint's hyper-parameters hold them, less
the backbone (stored once, as the folder's ``backbone``) and the ``pretrained`` file (the folder's weights replace it).
The files those arguments name (:attr:`FineTuningTask.file_arguments`: the VQA answer list, the captioning output
vocabulary, the SentencePiece model) lie in ``files/``, named relative to the folder, so a folder can be moved or
shared whole. Nothing from the folder is run: the class comes from the catalog.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch

from mmoe.io import one_line
from mmoe.model.pretrained import (
    FILES_FOLDER,
    WEIGHTS_FILE,
    PretrainedFolderError,
    backbone_config,
    in_float_dtype,
    load_weights,
    read_folder_config,
    read_weights,
    shared_float_dtype,
    unknown_to_this_mmoe,
)
from mmoe.tasks.catalog import FINETUNING_TASKS, class_path, task_of_class_path
from mmoe.tasks.finetuning import FineTuningTask


def from_pretrained(
    folder: str | Path,
    replaced: dict[str, Any] | None = None,
    dtype: torch.dtype | None = None,
    expected: type[FineTuningTask] | None = None,
) -> FineTuningTask:
    """The fine-tuned task model of a folder written by ``mmoe export`` (not ``--backbone-only``), in eval mode, its
    values as saved, every floating-point tensor in ``dtype`` (None: the folder's, which a ``bf16-true`` run's export
    keeps: :func:`mmoe.model.pretrained.shared_float_dtype`); ``replaced``: init arguments given over the folder's
    (``mmoe infer``'s options); ``expected``: the task the folder must hold (None: any).

    Raises:
        PretrainedFolderError: a backbone folder, a task this mmoe's catalog does not have, another task than
            ``expected`` (both classes named, before the arguments are read), a missing or unreadable file, arguments
            this mmoe's task does not take (a folder of another mmoe version), arguments or weights that do not fit
            the task; one line naming the file.
    """
    folder = Path(folder)
    config = read_folder_config(folder)
    task_entry = config.get("task")
    if not task_entry:
        raise PretrainedFolderError(
            f"{folder} holds a backbone only (exported with --backbone-only): load it with mmoe.model.from_pretrained"
        )
    saved = task_entry.get("class_path") if isinstance(task_entry, dict) else None
    task = task_of_class_path(str(saved))
    if task is None or not isinstance(task_entry.get("init_args"), dict):
        known = ", ".join(class_path(task) for task in FINETUNING_TASKS.values())
        raise PretrainedFolderError(
            f"{folder / 'config.json'}: task class_path {saved!r} is not a fine-tuning task of this mmoe, or it has "
            f"no init_args (expected one of {known})"
        )
    if expected is not None and task is not expected:
        raise PretrainedFolderError(
            f"{folder / 'config.json'}: task class_path {saved!r} is a {task.name} task, not a {expected.name} task "
            f"(expected {class_path(expected)!r})"
        )
    arguments = dict(task_entry["init_args"])
    unknown = [f"task.init_args.{name}" for name in unknown_arguments(task, arguments)]
    if unknown:
        raise PretrainedFolderError(f"{folder / 'config.json'}: {unknown_to_this_mmoe(unknown)}")
    for name in task.file_arguments:
        if arguments.get(name) is not None:
            arguments[name] = str(folder_file(folder, name, arguments[name]))
    arguments |= {name: value for name, value in (replaced or {}).items() if name in arguments}
    arguments |= {"backbone": backbone_config(folder, config), "pretrained": None}
    weights = read_weights(folder)
    dtype = dtype or shared_float_dtype(weights)
    try:
        model = task(**arguments)
        message = f"{folder / WEIGHTS_FILE} does not fit its {task.name} task"
        load_weights(model, in_float_dtype(weights, dtype), message, assign=True)
    except (FileNotFoundError, TypeError, ValueError) as error:
        raise PretrainedFolderError(f"{folder}: {one_line(error)}") from None
    return model.to(dtype).eval()  # the buffers a folder does not hold (not persistent) too


def unknown_arguments(task: type[FineTuningTask], arguments: dict[str, Any]) -> list[str]:
    """The names in ``arguments`` that ``task``'s ``__init__`` does not take, through the ``**kwargs`` it passes on to
    its base classes (what a checkpoint or folder of another mmoe version may hold)."""
    taken: set[str] = set()
    for cls in task.__mro__:
        init = cls.__dict__.get("__init__")
        if init is None:
            continue
        parameters = inspect.signature(init).parameters.values()
        taken |= {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            return [name for name in arguments if name not in taken - {"self"}]
    return []


def text_length(folder: str | Path) -> int | None:
    """The text length the task of an exported folder was trained with (its data's ``max_text_length``), if known."""
    task = read_folder_config(Path(folder)).get("task")
    return task.get("max_text_length") if isinstance(task, dict) else None


def folder_file(folder: Path, argument: str, name: object) -> Path:
    """The file a task folder's ``config.json`` names for ``argument``: one inside the folder, never elsewhere."""
    path = (folder / str(name)).resolve()
    if not path.is_relative_to(folder.resolve()):
        raise PretrainedFolderError(
            f"{folder / 'config.json'}: {argument} {name!r} lies outside the folder (expected a path inside it, as "
            f"mmoe export writes: {FILES_FOLDER}/...)"
        )
    return path
