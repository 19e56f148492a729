"""Pretrained folders: a backbone's (or a whole task model's) weights in the safetensors format, with its config as
JSON, read back without running anything from the folder.

A folder written by ``mmoe export`` holds:

* ``model.safetensors``: every tensor of the state dict, dtype kept (safetensors stores raw bytes and a JSON header,
  no pickle: loading it cannot run code);
* ``config.json``: ``{"format": "mmoe-pretrained", "backbone": <the MultiwayConfig as a dict>, "task": null}``; a
  task model's folder names its task instead (``{"class_path", "name", "init_args"}``, read by
  :func:`mmoe.tasks.pretrained.from_pretrained`) and keeps the backbone's weights under ``backbone.``; both record
  the ``mmoe_version`` that wrote them (read by nothing: a field unknown to this mmoe is what refuses a folder);
* ``files/``: a task model's own files (answer list, output vocabulary, SentencePiece model), where it has them.

:func:`from_pretrained` returns the :class:`MultiwayTransformer` of either kind of folder, in the dtype its weights
share (a ``bf16-true`` run's folder gives a bfloat16 backbone; weights of mixed precisions are read in float32), or in
the ``dtype`` asked for. A folder is written whole or not at all (:func:`write_folder`: filled beside its place, then
renamed into it); the staging folder a killed write left is removed by a later write to the same place
(:func:`remove_stale_staging`).
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from mmoe import __version__
from mmoe.atomic import current_umask
from mmoe.io import json_excerpt, one_line, read_json, write_json
from mmoe.model.backbone import MultiwayTransformer
from mmoe.model.config import MoEPlan, MultiwayConfig, config_from_dict, config_to_dict
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
#: Seconds a staging folder must have stood unchanged, its lock free, before another write removes it as stale.
STALE_STAGING_S = 60.0


class PretrainedFolderError(ValueError):
    """A folder that is not a readable pretrained folder; the message names the file and what was expected."""


def save_pretrained(backbone: MultiwayTransformer, folder: str | Path) -> Path:
    """Writes ``backbone`` as a pretrained folder (whole or not at all); returns the folder."""
    config = {"format": FOLDER_FORMAT, "backbone": config_to_dict(backbone.config), "task": None}
    return write_folder(folder, config, backbone.state_dict())


def from_pretrained(folder: str | Path, dtype: torch.dtype | None = None) -> MultiwayTransformer:
    """The backbone of a pretrained folder (of a backbone or of a task model), its values as saved, every
    floating-point tensor in ``dtype`` (None: the folder's, :func:`shared_float_dtype`).

    Raises:
        PretrainedFolderError: a missing or unreadable file, a config this mmoe cannot build, weights that do not fit
            it (an integer tensor where it has a floating-point one, or the reverse) or hold NaN/Inf; one line naming
            the file.
    """
    config, weights = read_backbone(folder)
    backbone = MultiwayTransformer(config)
    dtype = dtype or shared_float_dtype(weights)
    try:
        load_weights(
            backbone,
            in_float_dtype(weights, dtype),
            f"{Path(folder) / WEIGHTS_FILE} does not fit its {CONFIG_FILE}",
            assign=True,
        )
    except ValueError as error:
        raise PretrainedFolderError(str(error)) from None
    return backbone.to(dtype)  # the buffers a folder does not hold (not persistent) too


def shared_float_dtype(weights: dict[str, torch.Tensor]) -> torch.dtype:
    """The dtype every floating-point tensor of ``weights`` has (a ``bf16-true`` run's are all bfloat16); float32
    when they mix precisions (a tensor stored in another one reads as the rest of the model) or there are none."""
    dtypes = {tensor.dtype for tensor in weights.values() if tensor.is_floating_point()}
    return dtypes.pop() if len(dtypes) == 1 else torch.float32


def in_float_dtype(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``weights`` with every floating-point tensor in ``dtype`` (one already in it kept, not copied); the others as
    they are, for :func:`load_weights` to refuse where the model has a floating-point tensor."""
    return {name: tensor.to(dtype) if tensor.is_floating_point() else tensor for name, tensor in weights.items()}


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
    unknown = [f"backbone.{name}" for name in unknown_backbone_fields(config["backbone"])]
    if unknown:
        raise PretrainedFolderError(f"{folder / CONFIG_FILE}: {unknown_to_this_mmoe(unknown)}")
    try:
        return config_from_dict(config["backbone"])
    except (TypeError, ValueError) as error:
        raise PretrainedFolderError(
            f"{folder / CONFIG_FILE}: its backbone config cannot be built by this mmoe: {error}"
        ) from None


def unknown_backbone_fields(fields: dict[str, Any]) -> list[str]:
    """The fields of a saved backbone config (``MultiwayConfig`` as a dict, its ``moe`` a dict too) that this mmoe's
    :class:`MultiwayConfig` and :class:`MoEPlan` do not have, dotted (``moe.router_jitter``)."""

    def unknown(values: dict[str, Any], config: type, prefix: str = "") -> list[str]:
        known = {field.name for field in dataclasses.fields(config) if field.init}
        return [f"{prefix}{name}" for name in values if name not in known]

    moe = fields.get("moe")
    return unknown(fields, MultiwayConfig) + (unknown(moe, MoEPlan, "moe.") if isinstance(moe, dict) else [])


def unknown_to_this_mmoe(names: list[str], what: str = "field") -> str:
    """The end of an error naming ``names``, fields or arguments a file holds that this mmoe does not know."""
    shown = ", ".join(json_excerpt(str(name), 60) for name in names[:5])
    more = f" and {len(names) - 5} more" if len(names) > 5 else ""
    named = f"{what}s {shown}{more} are" if len(names) > 1 else f"{what} {shown} is"
    return f"{named} unknown to this mmoe (written by another mmoe version)"


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
    tensors); a ``ValueError`` starting with ``message`` names the first weight whose shape differs (both shapes) or
    whose kind differs (an integer tensor where the module has a floating-point one, or the reverse: both dtypes), or
    how many are missing and unexpected, in one line."""
    expected = module.state_dict()
    for key, value in weights.items():
        if key in expected and expected[key].shape != value.shape:
            raise ValueError(
                f"{message}: {key} has shape {tuple(value.shape)} there, {tuple(expected[key].shape)} here"
            )
        if key in expected and expected[key].is_floating_point() != value.is_floating_point():
            kind = "a floating-point" if expected[key].is_floating_point() else f"a {expected[key].dtype}"
            raise ValueError(
                f"{message}: {key} is {value.dtype} there, {expected[key].dtype} here (expected {kind} tensor)"
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
    config = config | {"mmoe_version": __version__}

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
    between the two renames leaves no ``folder``, and the old one beside it as ``.<name>.*.old``). The staging folder
    is locked while it is written (:func:`remove_stale_staging`, run first, removes only those no live write holds)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(folder)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    old, lock = staging.with_name(f"{staging.name}.old"), None
    try:
        lock = lock_folder(staging)
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
    finally:
        if lock is not None:
            os.close(lock)
    shutil.rmtree(old, ignore_errors=True)
    return folder


def lock_folder(folder: Path) -> int:
    """An open descriptor of ``folder`` holding its lock (exclusive) until it is closed, as a write in progress holds
    its staging folder's. On a file system without locks it holds none, and :func:`unlocked` then never finds one
    free: such staging folders are never taken for stale."""
    descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        pass
    return descriptor


def remove_stale_staging(folder: Path, older_than_s: float = STALE_STAGING_S) -> list[Path]:
    """Removes what a killed :func:`replace_folder` of ``folder`` left beside it: its staging folders
    (``.<name>.XXXXXXXX``) and the old folders it moved aside (``.<name>.XXXXXXXX.old``, only while ``folder``
    exists: until then one may be the only copy). Only real folders of that name (a link or a file is never touched
    or followed), none a live write holds locked, none changed in the last ``older_than_s`` seconds. Returns them."""
    pattern = re.compile(re.escape(f".{folder.name}.") + r"[a-z0-9_]{8}(\.old)?")
    removed = []
    for candidate in sorted(folder.parent.iterdir()):
        if not pattern.fullmatch(candidate.name) or not is_real_folder(candidate):
            continue
        staging = candidate.with_name(candidate.name.removesuffix(".old"))
        if candidate != staging and not folder.exists():
            continue
        if quiet_for(candidate, older_than_s) and (not is_real_folder(staging) or unlocked(staging)):
            shutil.rmtree(candidate, ignore_errors=True)  # removes links inside, never follows them
            removed.append(candidate)
    return removed


def is_real_folder(path: Path) -> bool:
    """Whether ``path`` is a folder itself, not a link to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def unlocked(staging: Path) -> bool:
    """Whether no live :func:`replace_folder` holds ``staging`` locked (every one holds its own until it ends; a
    killed process's lock is gone with it)."""
    try:
        descriptor = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:  # a link, or gone
        return False
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held by a live write (or no locks here: not provably free)
        return False
    finally:
        os.close(descriptor)
    return True


def quiet_for(folder: Path, seconds: float) -> bool:
    """Whether nothing in ``folder`` (itself, its files and sub-folders; links not followed) changed in the last
    ``seconds``: a write in progress keeps touching its files."""
    try:
        newest = os.lstat(folder).st_mtime
    except OSError:  # removed meanwhile
        return False
    for parent, folders, files in os.walk(folder):
        for name in folders + files:
            try:
                newest = max(newest, os.lstat(os.path.join(parent, name)).st_mtime)
            except OSError:
                continue
    return time.time() - newest > seconds


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
