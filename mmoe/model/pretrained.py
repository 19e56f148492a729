"""Pretrained folders: a backbone's (or a whole task model's) weights in the safetensors format, with its config as
JSON, read back without running anything from the folder.

A folder written by ``mmoe export`` holds:

* ``model.safetensors``: every tensor of the state dict, dtype kept (safetensors stores raw bytes and a JSON header,
  no pickle: loading it cannot run code);
* ``config.json``: ``{"format": "mmoe-pretrained", "backbone": <the MultiwayConfig as a dict>, "task": null}``; a
  task model's folder names its task instead (``{"class_path", "name", "init_args"}``, read by
  :func:`mmoe.tasks.pretrained.from_pretrained`) and keeps the backbone's weights under ``backbone.``;
* ``files/``: a task model's own files (answer list, output vocabulary, SentencePiece model), where it has them.

:func:`from_pretrained` returns the :class:`MultiwayTransformer` of either kind of folder. A folder is written whole or
not at all (:func:`write_folder`: filled beside its place, then renamed into it).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from mmoe.atomic import current_umask
from mmoe.io import one_line, read_json, write_json
from mmoe.model.backbone import MultiwayTransformer
from mmoe.model.config import MultiwayConfig, config_from_dict, config_to_dict
from mmoe.safe_load import require_finite_weights

FOLDER_FORMAT = "mmoe-pretrained"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
#: Where a task model's folder keeps the files its arguments name.
FILES_FOLDER = "files"
#: The prefix of the backbone's weights in a task model's folder (the task's ``backbone`` attribute).
TASK_BACKBONE_PREFIX = "backbone."
#: What a folder must be, as errors name it.
PRETRAINED_FOLDER = f"a folder written by mmoe export ({CONFIG_FILE} and {WEIGHTS_FILE})"


class PretrainedFolderError(ValueError):
    """A folder that is not a readable pretrained folder; the message names the file and what was expected."""


def save_pretrained(backbone: MultiwayTransformer, folder: str | Path) -> Path:
    """Writes ``backbone`` as a pretrained folder (whole or not at all); returns the folder."""
    config = {"format": FOLDER_FORMAT, "backbone": config_to_dict(backbone.config), "task": None}
    return write_folder(folder, config, backbone.state_dict())


def from_pretrained(folder: str | Path) -> MultiwayTransformer:
    """The backbone of a pretrained folder (of a backbone or of a task model), every tensor as saved (dtype kept).

    Raises:
        PretrainedFolderError: a missing or unreadable file, a config this mmoe cannot build, weights that do not fit
            it or hold NaN/Inf; one line naming the file.
    """
    config, weights = read_backbone(folder)
    backbone = MultiwayTransformer(config)
    try:
        load_weights(backbone, weights, f"{Path(folder) / WEIGHTS_FILE} does not fit its {CONFIG_FILE}", assign=True)
    except ValueError as error:
        raise PretrainedFolderError(str(error)) from None
    return backbone


def read_backbone(folder: str | Path) -> tuple[MultiwayConfig, dict[str, torch.Tensor]]:
    """The backbone config and weights of a pretrained folder (of a backbone or of a task model), not yet built:
    what ``model.init_args.pretrained`` and the other readers of backbone files take from a folder."""
    folder = Path(folder)
    config = read_folder_config(folder)
    weights = read_weights(folder, TASK_BACKBONE_PREFIX if config.get("task") else "")
    return backbone_config(folder, config), weights


def read_folder_config(folder: Path) -> dict[str, Any]:
    """The ``config.json`` of a pretrained folder, checked to be one."""
    if not folder.is_dir():
        raise PretrainedFolderError(
            f"{folder} {'is not a folder' if folder.exists() else 'does not exist'} (expected {PRETRAINED_FOLDER})"
        )
    path = folder / CONFIG_FILE
    config = read_json(path, error=PretrainedFolderError, written_by=f"expected {PRETRAINED_FOLDER}")
    if (
        not isinstance(config, dict)
        or config.get("format") != FOLDER_FORMAT
        or not isinstance(config.get("backbone"), dict)
    ):
        raise PretrainedFolderError(
            f'{path} is not the config of a pretrained folder (expected "format": "{FOLDER_FORMAT}" and a '
            '"backbone" object, as mmoe export writes)'
        )
    return config


def backbone_config(folder: Path, config: dict[str, Any]) -> MultiwayConfig:
    """The :class:`MultiwayConfig` of a folder's ``config.json``; an unknown field or a bad value names the file."""
    try:
        return config_from_dict(config["backbone"])
    except (TypeError, ValueError) as error:
        raise PretrainedFolderError(
            f"{folder / CONFIG_FILE}: its backbone config cannot be built by this mmoe: {error}"
        ) from None


def read_weights(folder: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a folder's ``model.safetensors`` whose names start with ``prefix`` (stripped), on the CPU;
    refused when any holds NaN or Inf."""
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise PretrainedFolderError(f"{path} does not exist (expected {PRETRAINED_FOLDER})")
    try:
        with safe_open(path, framework="pt", device="cpu") as weights:
            # Each tensor copied into torch's own memory: those safetensors hands out start at the file's offsets, not
            # on 64-byte boundaries, and the CPU matrix kernels take another path for such data, so the same weights
            # gave other last bits than the checkpoint they were exported from.
            tensors = {
                name[len(prefix) :]: weights.get_tensor(name).clone()
                for name in weights.keys()
                if name.startswith(prefix)
            }
    except (SafetensorError, OSError) as error:
        raise PretrainedFolderError(
            f"{path} could not be read: {one_line(error)} (expected a safetensors file written by mmoe "
            "export; truncated or corrupted?)"
        ) from None
    try:
        require_finite_weights(tensors, path, "weights")
    except ValueError as error:
        raise PretrainedFolderError(str(error)) from None
    return tensors


def load_weights(module: torch.nn.Module, weights: dict[str, torch.Tensor], message: str, assign: bool = False) -> None:
    """Loads ``weights`` into ``module`` (``assign``: as they are, dtype kept, instead of copied into the module's
    tensors); a ``ValueError`` starting with ``message`` names the first weight whose shape differs (both shapes), or
    how many are missing and unexpected, in one line."""
    expected = module.state_dict()
    for key, value in weights.items():
        if key in expected and expected[key].shape != value.shape:
            raise ValueError(
                f"{message}: {key} has shape {tuple(value.shape)} there, {tuple(expected[key].shape)} here"
            )
    missing = [key for key in expected if key not in weights]
    unexpected = [key for key in weights if key not in expected]
    if missing or unexpected:
        examples = ", ".join(
            f"{name} e.g. {keys[0]}" for name, keys in (("missing", missing), ("unexpected", unexpected)) if keys
        )
        raise ValueError(f"{message}: {len(missing)} weights missing, {len(unexpected)} unexpected ({examples})")
    module.load_state_dict(weights, assign=assign)


def write_folder(
    folder: str | Path,
    config: dict[str, Any],
    weights: dict[str, torch.Tensor],
    files: dict[str, Path] | None = None,
) -> Path:
    """Writes a pretrained folder whole or not at all: ``config`` as ``config.json``, ``weights`` as
    ``model.safetensors`` and each of ``files`` (name in the folder -> source file) copied in, all into a new folder
    beside ``folder``, then renamed into its place. An earlier pretrained folder there is replaced; any other existing
    file or non-empty folder is refused (:func:`check_destination`)."""
    folder = Path(folder)
    check_destination(folder)

    def fill(staging: Path) -> None:
        save_file(separate_storages(weights), staging / WEIGHTS_FILE, metadata={"format": "pt"})
        os.chmod(staging / WEIGHTS_FILE, 0o666 & ~current_umask())  # safetensors writes it private (0600)
        for name, source in (files or {}).items():
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, staging / name)
        write_json(staging / CONFIG_FILE, config)

    return replace_folder(folder, fill)


def check_destination(folder: Path) -> None:
    """Refuses to write a pretrained folder over a file, or over a non-empty folder that is not a pretrained folder
    of mmoe (it would be replaced whole: another model's folder with its own ``config.json`` is kept)."""
    if folder.exists() and not folder.is_dir():
        raise PretrainedFolderError(f"{folder} is a file (expected a new folder, or {PRETRAINED_FOLDER}, to replace)")
    if folder.is_dir() and any(folder.iterdir()) and not is_pretrained_folder(folder):
        raise PretrainedFolderError(
            f"{folder} is a folder with other files in it (expected a new folder, or {PRETRAINED_FOLDER}, to replace)"
        )


def is_pretrained_folder(folder: Path) -> bool:
    """Whether ``folder``'s ``config.json`` is the config of a pretrained folder of mmoe."""
    try:
        read_folder_config(folder)
    except PretrainedFolderError:
        return False
    return True


def replace_folder(folder: Path, fill: Callable[[Path], None]) -> Path:
    """``fill(staging)`` on a new folder beside ``folder``, then rename it to ``folder`` (the old one, if any, moved
    aside first and removed after): ``folder`` is the old whole folder or the new whole one, never a part (a kill
    between the two renames leaves no ``folder``, and the old one beside it as ``.<name>.*.old``)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    old = staging.with_name(f"{staging.name}.old")
    try:
        os.chmod(staging, 0o777 & ~current_umask())  # mkdtemp's folders are private; others are not
        fill(staging)
        if folder.exists():
            os.rename(folder, old)
        os.rename(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if old.exists() and not folder.exists():
            os.rename(old, folder)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return folder


def separate_storages(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` detached and contiguous, a tensor sharing its storage with an earlier one cloned: safetensors
    stores each tensor on its own."""
    seen: set[int] = set()
    separate = {}
    for name, tensor in weights.items():
        tensor = tensor.detach().contiguous()
        pointer = tensor.untyped_storage().data_ptr()
        separate[name] = tensor.clone() if pointer in seen else tensor
        seen.add(pointer)
    return separate
