"""A fine-tuned task rebuilt from its Lightning checkpoint alone, and its inputs read as its evaluation data was."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from mmoe.data.tokenizer import DEFAULT_MAX_TEXT_LENGTH, TextTokenizer
from mmoe.infer.images import ImageFileError, read_user_image
from mmoe.io import one_line
from mmoe.model.pretrained import unknown_backbone_fields, unknown_to_this_mmoe
from mmoe.runtime.checkpoint import config_from_dict
from mmoe.runtime.optimizer import nest_optimizer_arguments
from mmoe.safe_load import load_checkpoint_file, require_finite_weights
from mmoe.tasks.catalog import class_path, task_of_class_path
from mmoe.tasks.finetuning import FineTuningTask
from mmoe.tasks.pretrained import from_pretrained, text_length, unknown_arguments
from mmoe.tasks.pretraining import MaskedPretraining


class InferError(ValueError):
    """Bad input to ``mmoe infer``; the message names the file or option."""


@dataclasses.dataclass
class FineTuned:
    """A fine-tuned task ready for inference and how its inputs are prepared."""

    task: FineTuningTask
    tokenizer: TextTokenizer
    image_size: int
    device: torch.device

    def image(self, path: str | Path) -> torch.Tensor:
        """(3, S, S) as the checkpoint's evaluation data: decoded (any size and mode, upright as its EXIF orientation
        says), resized, cropped, normalised: the task's
        :meth:`~mmoe.tasks.finetuning.FineTuningTask.image_transform`."""
        try:
            image = read_user_image(path, self.image_size)
        except ImageFileError as error:
            raise InferError(str(error)) from None
        return self.task.image_transform()(image)

    def text(self, text: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(1, T) token ids and padding mask of ``text`` on the task's device."""
        ids, padding = self.tokenizer(text)
        return ids.to(self.device), padding.to(self.device)


def load_fine_tuned(
    path: str | Path, task: type[FineTuningTask], device: str = "cpu", replaced: dict[str, Any] | None = None
) -> FineTuned:
    """The ``task`` of a Lightning checkpoint of ``mmoe fit``, rebuilt from its saved arguments and weights, with the
    arguments of ``replaced`` (what ``mmoe infer``'s options replace, :meth:`mmoe.tasks.inference.InferSpec
    .task_arguments`: moved files, such as the VQA answer list, the captioning output vocabulary, the SentencePiece
    tokenizer; the caption beams). A folder written by ``mmoe export`` reads as well.
    Both run in float32, whatever the dtype of the weights (a ``bf16-true`` run's are bfloat16): a checkpoint's are
    copied into the float32 model, a folder's cast to it."""
    path = Path(path)
    if path.is_dir():
        return load_exported(path, task, device, replaced)
    state = load_checkpoint_file(path, "checkpoint")
    require_finite_weights(state, path)
    hyper_parameters, weights = state.get("hyper_parameters"), state.get("state_dict")
    if not isinstance(hyper_parameters, dict) or not isinstance(weights, dict) or "backbone" not in hyper_parameters:
        raise InferError(
            f"checkpoint {path} holds no fine-tuned task (a backbone export or a released BEiT-3 file?): "
            f"fine-tune it with `mmoe fit` first"
        )
    saved = str(hyper_parameters.get("_class_path", ""))
    if saved == class_path(MaskedPretraining):
        raise InferError(
            f"checkpoint {path} is a pre-training checkpoint: `mmoe infer` needs a fine-tuned VQA, NLVR2, "
            f"captioning or retrieval checkpoint"
        )
    if saved != class_path(task):
        found = task_of_class_path(saved)
        raise InferError(
            f"checkpoint {path} is a {found.name if found else saved or 'unknown task'} checkpoint, "
            f"not a {task.name} one"
        )
    arguments = {k: v for k, v in nest_optimizer_arguments(hyper_parameters).items() if not k.startswith("_")}
    unknown = unknown_arguments(task, arguments)
    if isinstance(arguments["backbone"], dict):
        unknown += [f"backbone.{name}" for name in unknown_backbone_fields(arguments["backbone"])]
    if unknown:
        raise InferError(f"checkpoint {path}: {unknown_to_this_mmoe(unknown, 'hyper-parameter')}")
    if isinstance(arguments["backbone"], dict):
        arguments["backbone"] = config_from_dict(arguments["backbone"])
    arguments["pretrained"] = None
    arguments |= {name: value for name, value in (replaced or {}).items() if name in arguments}
    try:
        model = task(**arguments)
        model.load_state_dict(task.evaluated_weights(state))
    except (FileNotFoundError, ValueError, RuntimeError) as error:
        named = [f"--{name.replace('_', '-')}" for name in task.file_arguments if arguments.get(name)]
        hint = f" (a moved file: {', '.join(named)} name its new path)" if isinstance(error, FileNotFoundError) else ""
        raise InferError(f"checkpoint {path}: {one_line(error)}{hint}") from None
    data = state.get("datamodule_hyper_parameters")
    return ready(model, data.get("max_text_length") if isinstance(data, dict) else None, device)


def load_exported(folder: Path, task: type[FineTuningTask], device: str, replaced: dict[str, Any] | None) -> FineTuned:
    """The ``task`` of a folder written by ``mmoe export`` (:func:`mmoe.tasks.pretrained.from_pretrained`) in float32,
    with the arguments of ``replaced``."""
    try:
        model = from_pretrained(folder, replaced, dtype=torch.float32, expected=task)
    except (FileNotFoundError, ValueError) as error:
        raise InferError(one_line(error)) from None
    return ready(model, text_length(folder), device)


def ready(model: FineTuningTask, length: int | None, device: str) -> FineTuned:
    """``model`` in eval mode on ``device``, with the tokenizer of its text (``length`` tokens; default when None)."""
    tokenizer = TextTokenizer(
        max_length=length or DEFAULT_MAX_TEXT_LENGTH, sentencepiece=model.hparams.get("text_tokenizer")
    )
    try:
        target = torch.device(device)
        model = model.eval().to(target)
    except RuntimeError as error:
        raise InferError(f"--device {device}: {one_line(error)}") from None
    return FineTuned(model, tokenizer, model.backbone.config.image_size, target)
