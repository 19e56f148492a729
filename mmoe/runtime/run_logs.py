"""CSV logs that continue across a resume: ``metrics.csv`` of an interrupted and resumed run holds the rows of the
run that was never interrupted.

Lightning's ``CSVLogger`` deletes an existing ``metrics.csv`` in its version folder when it starts, so a run resumed
into a fixed version (``version: 0``, as the demo's) loses the rows logged before the interruption.
:class:`ContinuingCSVLogger` keeps them: when training starts, :class:`ContinueCSVLogs` tells it the step the run
starts from (the checkpoint's, 0 for a run from scratch), and it keeps the rows of the steps before it and drops the
rows of the steps the run logs again. Outside training (``mmoe validate``, ``test``) the earlier rows are kept and
the new ones appended. A logger without a fixed ``version`` writes a new version folder per run, as Lightning's.
The earlier rows are read and rewritten on the local filesystem.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

import lightning as L
from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

from mmoe.atomic import atomic_write
from mmoe.runtime.lightning_internals import KeepingExperimentWriter, csv_logger_experiment

#: The class path the mmoe CLI and the demo give for a run folder's CSV logs.
CSV_LOGGER = "mmoe.runtime.run_logs.ContinuingCSVLogger"


def logged_step(row: dict[str, str]) -> int | None:
    """The ``step`` of a ``metrics.csv`` row (None when it has none)."""
    try:
        return int(float(row.get("step") or ""))
    except ValueError:
        return None


class ContinuingExperimentWriter(KeepingExperimentWriter):
    """Lightning's CSV writer that appends to an existing ``metrics.csv`` instead of deleting it; ``continue_from``
    says which of the earlier rows stay."""

    def __init__(self, log_dir: str) -> None:
        super().__init__(log_dir)
        header = self.read_rows()[0]
        self.metrics_keys = list(header)  # new rows are appended under the existing header (widened as needed)

    def read_rows(self) -> tuple[list[str], list[dict[str, str]]]:
        """The header and the rows of ``metrics.csv`` (nothing when there is no file)."""
        if not os.path.isfile(self.metrics_file_path):
            return [], []
        with open(self.metrics_file_path, newline="", encoding="utf-8") as file:
            reader = csv.DictReader(file)
            return list(reader.fieldnames or []), list(reader)

    def continue_from(self, step: int) -> None:
        """Keeps the rows of the steps before ``step`` and removes the rest (the file is rewritten whole or not at
        all); the rows logged from now on are appended."""
        header, rows = self.read_rows()
        kept = [row for row in rows if (logged_step(row) or 0) < step]
        if len(kept) == len(rows):
            return
        if not kept:
            Path(self.metrics_file_path).unlink()
            self.metrics_keys = []
            return

        def write(path: Path) -> None:
            with open(path, "w", newline="", encoding="utf-8") as file:
                writer = csv.DictWriter(file, fieldnames=header)
                writer.writeheader()
                writer.writerows(kept)

        atomic_write(self.metrics_file_path, write)


class ContinuingCSVLogger(CSVLogger):
    """Lightning's ``CSVLogger`` whose ``metrics.csv`` continues across a resume (see the module docstring); the
    arguments are Lightning's.

    Args:
        save_dir: the folder the logs go under.
        name: the experiment's folder in ``save_dir`` (None: none).
        version: the version folder in it (an int ``N`` gives ``version_N``, a string itself); None: the next free
            ``version_N``, so every run writes its own.
        prefix: put before every metric name.
        flush_logs_every_n_steps: logged steps between writes to ``metrics.csv``.
    """

    def __init__(
        self,
        save_dir: str | os.PathLike,
        name: str | None = "lightning_logs",
        version: int | str | None = None,
        prefix: str = "",
        flush_logs_every_n_steps: int = 100,
    ) -> None:
        super().__init__(save_dir, name, version, prefix, flush_logs_every_n_steps)

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        """The writer, created on first use on global rank 0 (a stand-in that does nothing on the other ranks)."""
        return csv_logger_experiment(self, ContinuingExperimentWriter)

    def continue_from(self, step: int) -> None:
        """Keeps the logged rows of the steps before ``step`` and drops the others (global rank 0 writes)."""
        experiment = self.experiment
        if isinstance(experiment, ContinuingExperimentWriter):
            experiment.continue_from(step)


class ContinueCSVLogs(L.Callback):
    """Tells every :class:`ContinuingCSVLogger` of the trainer the step its training starts from, once a resumed
    run's state is restored (``on_train_start``)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            if isinstance(logger, ContinuingCSVLogger):
                # Rows carry the optimizer step reached (``step``): those before it are the earlier run's.
                logger.continue_from(trainer.global_step)
