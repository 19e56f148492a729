"""Backbone snapshots through training: the exported backbone every ``every_n_steps`` steps, for analyses that follow
a run through time (X-MoE Fig. 2c representation collapse and Fig. 3a routing fluctuation through pre-training)."""

from __future__ import annotations

from pathlib import Path

import lightning as L

from mmoe.runtime.checkpoint import export_backbone
from mmoe.runtime.layout import snapshot_name


class BackboneSnapshots(L.Callback):
    """Saves ``pl_module.backbone`` as an exported backbone (``mmoe export-backbone``'s format, loadable by
    ``load_backbone``, ``mmoe viz`` / ``analyze``) at step 0 and every ``every_n_steps`` optimiser steps.

    Files are ``dirpath/`` :func:`~mmoe.runtime.layout.snapshot_name` ``(step)`` (``step000025.pt``), each written
    atomically; a resumed run writes the later ones.
    Only the backbone is kept (no optimiser state), so a snapshot is a fraction of a training checkpoint.

    Args:
        dirpath: folder of the snapshots.
        every_n_steps: steps between snapshots.
    """

    def __init__(self, dirpath: str | Path, every_n_steps: int) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.dirpath = Path(dirpath)
        self.every_n_steps = every_n_steps

    def path(self, step: int) -> Path:
        return self.dirpath / snapshot_name(step)

    def _save(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            self.dirpath.mkdir(parents=True, exist_ok=True)
            export_backbone(pl_module.backbone, self.path(trainer.global_step))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step == 0:
            self._save(trainer, pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step
        if step % self.every_n_steps == 0 and not self.path(step).exists():
            self._save(trainer, pl_module)
