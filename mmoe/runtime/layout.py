"""The folder of one training run: where its checkpoints, logs, routing statistics, predictions and scores lie.

Every name is written here once; the callbacks that write the files and the commands that read them (the demo, the
claims study) take their paths from a :class:`RunLayout`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from lightning.pytorch.callbacks import ModelCheckpoint

from mmoe.metrics.routing_stats import STATS_FILENAME

#: The latest checkpoint ``ModelCheckpoint(save_last=True)`` keeps.
LAST_CHECKPOINT = ModelCheckpoint.CHECKPOINT_NAME_LAST + ModelCheckpoint.FILE_EXTENSION
#: The official scores of a run's predictions (the demo's and the study's evaluation stages write it).
SCORES_FILE = "scores.json"
#: A backbone snapshot's file name: the optimiser step, six digits (so names sort as steps do).
_SNAPSHOT = re.compile(r"step(\d{6,})\.pt")


def snapshot_name(step: int) -> str:
    """The file name of the backbone snapshot at optimiser step ``step``."""
    return f"step{step:06d}.pt"


@dataclass(frozen=True)
class RunLayout:
    """The files of one run folder (its ``trainer.default_root_dir``).

    Attributes:
        root: the folder.
    """

    root: Path

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def last_checkpoint(self) -> Path:
        return self.checkpoints / LAST_CHECKPOINT

    @property
    def tensorboard_logs(self) -> Path:
        """The TensorBoard logger's folder (``save_dir`` = the root, ``name`` = ``tensorboard``)."""
        return self.root / "tensorboard"

    @property
    def csv_logs(self) -> Path:
        """The CSV logger's folder (``save_dir`` = the root, ``name`` = ``csv``)."""
        return self.root / "csv"

    @property
    def routing_stats(self) -> Path:
        """What :class:`mmoe.runtime.routing_callback.RoutingStatsCallback` with ``save_dir`` = the root writes."""
        return self.root / STATS_FILENAME

    @property
    def snapshots(self) -> Path:
        """The backbone snapshots of :class:`mmoe.runtime.snapshots.BackboneSnapshots`."""
        return self.root / "snapshots"

    def snapshot(self, step: int) -> Path:
        """The backbone snapshot at optimiser step ``step``."""
        return self.snapshots / snapshot_name(step)

    def saved_snapshots(self) -> dict[int, Path]:
        """The backbone snapshots in the folder, by step, in step order."""
        found = {}
        if self.snapshots.is_dir():
            for path in self.snapshots.iterdir():
                match = _SNAPSHOT.fullmatch(path.name)
                if match and path.is_file():
                    found[int(match.group(1))] = path
        return dict(sorted(found.items()))

    @property
    def scores(self) -> Path:
        return self.root / SCORES_FILE

    def predictions(self, name: str) -> Path:
        """The predictions file ``name`` (``mmoe predict``'s ``model.predictions_file``)."""
        return self.root / name


def blocked_run_path(root: str | os.PathLike | None) -> str | None:
    """The error line for the first path of the run folder ``root`` that stands in the way of what a run writes there
    (a file or a dangling link where it makes a folder, a folder where it writes its routing statistics); None when
    there is none, or no run folder. Checked before the loggers make their folders, which would fail on it with a
    ``FileExistsError`` traceback."""
    if root is None:
        return None
    layout = RunLayout(Path(root))
    folders = {
        layout.checkpoints: "checkpoints",
        layout.tensorboard_logs: "TensorBoard logs",
        layout.csv_logs: "CSV logs",
        layout.snapshots: "backbone snapshots",
    }
    aside = "move it aside, or give this run another trainer.default_root_dir"
    for path, what in folders.items():
        if os.path.lexists(path) and not path.is_dir():
            return f"run folder {layout.root}: {path} is a file, where mmoe makes the folder of its {what}: {aside}"
    if layout.routing_stats.is_dir():
        stats = layout.routing_stats
        return f"run folder {layout.root}: {stats} is a folder, where mmoe writes its routing statistics: {aside}"
    return None
