"""How every ``mmoe fit`` writes its checkpoints: whole or not at all, its last step always among them, and in its
own run folder after a resume.

* :class:`AtomicCheckpointIO`: each checkpoint is written to a temporary file in its own folder, flushed to disk and
  renamed over the old one (:func:`mmoe.atomic.atomic_write`), so a process killed mid-save leaves the previous
  checkpoint whole, on any filesystem. Lightning's own writer goes through a temporary file in ``$TMPDIR`` and, when
  that is another filesystem than the checkpoint's, copies it over the old file in place.
* :class:`LastStepCheckpoint`: a ``ModelCheckpoint(save_last=...)`` saves ``last.ckpt`` only every
  ``every_n_train_steps``; at the end of training this saves it at the final step when the newest one is older. On a
  resume from a checkpoint of the callback's own folder, that folder's ``last.ckpt`` is the run's (Lightning, seeing
  another folder recorded in a moved or copied checkpoint, would write ``last-v1.ckpt`` beside a stale one).

:func:`checkpoint_saving_arguments` adds both to a trainer's arguments; :class:`mmoe.config.cli.MMoECLI` calls it for
every trainer it builds, ``mmoe.config.launch.run_lightning``'s included.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

from mmoe.atomic import atomic_write, remove_stale_temporaries
from mmoe.runtime.lightning_internals import save_last_checkpoint

#: A temporary checkpoint file untouched for this long belongs to a killed writer and is removed at the next save in
#: its folder; a younger one may be another process's save in progress.
STALE_AFTER_S = 60.0


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``torch.save`` checkpoint IO, writing local files whole or not at all (see the module docstring);
    a URL (``s3://...``) goes to Lightning's writer. Before each save, the temporary files killed saves left in the
    checkpoint's folder are removed (:func:`remove_killed_saves`); a save interrupted by an exception (a signal's
    handler raising one included) removes its own at once.

    Attributes:
        saved_steps: the global step of each file this process has written whole (its absolute path), as
            :func:`saved_step` tells it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.saved_steps: dict[str, int | None] = {}

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or "://" in str(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        remove_killed_saves(Path(path).parent)
        atomic_write(path, lambda temporary: save_synced(checkpoint, temporary))
        self.saved_steps[os.path.abspath(path)] = checkpoint.get("global_step")


def saved_step(trainer: L.Trainer, path: str | os.PathLike) -> int | None:
    """The global step of the checkpoint ``trainer`` last wrote to ``path`` through :class:`AtomicCheckpointIO`,
    without reading the file; None when it wrote none there (or through another checkpoint IO)."""
    steps = getattr(trainer.strategy.checkpoint_io, "saved_steps", {})
    return steps.get(os.path.abspath(path))


def remove_killed_saves(folder: Path) -> None:
    """Removes the temporary files that killed saves of any checkpoint left in ``folder`` (:data:`STALE_AFTER_S`):
    ``.epoch=0-step=10.ckpt.x1y2z3w4`` is ``epoch=0-step=10.ckpt``'s, a name a later save may never use again."""
    extension = ModelCheckpoint.FILE_EXTENSION
    for name in {temporary.name[1:].rsplit(".", 1)[0] for temporary in folder.glob(f".*{extension}.*")}:
        remove_stale_temporaries(folder / name, STALE_AFTER_S)


def save_synced(checkpoint: dict[str, Any], path: Path) -> None:
    """``torch.save`` to ``path``, flushed to the disk before it is renamed over the checkpoint (a rename can reach
    the disk before the data does)."""
    with open(path, "wb") as file:
        torch.save(checkpoint, file)
        file.flush()
        os.fsync(file.fileno())


class LastStepCheckpoint(L.Callback):
    """Saves the last checkpoint of each ``ModelCheckpoint(save_last=...)`` at the final step of training when its
    newest save is older, and keeps ``last.ckpt`` in the callback's folder on a resume from that folder (see the
    module docstring). With ``save_last="link"`` the last checkpoint stays a link to the newest top-k file, as
    Lightning makes it."""

    def __init__(self) -> None:
        self.start_step = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start_step = trainer.global_step  # a resumed run's step: nothing of its own is saved yet
        resumed = Path(trainer.ckpt_path).resolve() if trainer.ckpt_path else None
        for callback in last_saving_callbacks(trainer):
            if resumed is not None and callback.dirpath and resumed.parent == Path(callback.dirpath).resolve():
                # The name the callback gives its last checkpoint is taken as its own: it is written over, not
                # beside (Lightning restores last_model_path only when the checkpoint recorded this very folder).
                callback.last_model_path = callback.format_checkpoint_name({}, callback.CHECKPOINT_NAME_LAST)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.fast_dev_run or trainer.global_step <= self.start_step:
            return
        for callback in last_saving_callbacks(trainer):
            save_last_checkpoint(callback, trainer)


def last_saving_callbacks(trainer: L.Trainer) -> list[ModelCheckpoint]:
    """The trainer's ``ModelCheckpoint`` callbacks that keep a last checkpoint (``save_last``)."""
    return [
        callback
        for callback in trainer.checkpoint_callbacks
        if isinstance(callback, ModelCheckpoint) and callback.save_last
    ]


def checkpoint_saving_arguments(trainer: Mapping[str, Any]) -> dict[str, Any]:
    """``plugins`` and ``callbacks`` of the instantiated trainer arguments ``trainer`` with :class:`AtomicCheckpointIO`
    and :class:`LastStepCheckpoint` added. A checkpoint IO the arguments already give (a plugin, or a strategy
    object's own) is kept instead of ours."""
    plugins = as_list(trainer.get("plugins"))
    strategy = trainer.get("strategy")
    own_io = any(isinstance(plugin, CheckpointIO) for plugin in plugins)
    if not own_io and getattr(strategy, "_checkpoint_io", None) is None:
        plugins.append(AtomicCheckpointIO())
    return {"plugins": plugins, "callbacks": [*as_list(trainer.get("callbacks")), LastStepCheckpoint()]}


def as_list(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
