"""A real ``mmoe fit`` that SIGKILLs itself when it reaches a chosen training step, used by the resume tests
(tests/tasks/test_resume_exact.py, through tests/tasks/resumable_fit.py).

Usage: python tests/scripts/fit_killed_at_step.py STEP FIT_ARGUMENTS...

The process sends itself SIGKILL at the start of training step ``STEP``: every checkpoint of the earlier steps is
on disk (Lightning saves them synchronously, at the end of their step) and none of the later ones. The kill is the
same a user meets (no handler, no flush, no clean-up); only its moment is chosen by the run instead of by a test
polling the checkpoint, which a loaded machine can make miss its window.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import lightning.pytorch as pl

from mmoe.config.cli import MMoECLI, cli_arguments
from mmoe.process_exit import freeze_at_exit


class KillAtStep(pl.Callback):
    """Sends this process SIGKILL when training step ``step`` starts."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class KilledAtStepCLI(MMoECLI):
    """``mmoe fit``'s CLI with :class:`KillAtStep` added to the trainer's callbacks (a config may name only mmoe's and
    Lightning's classes, so the test's callback cannot be given there)."""

    def __init__(self, step: int, **kwargs: Any) -> None:
        self.kill_at_step = step
        super().__init__(**kwargs)

    def instantiate_trainer(self, **kwargs: Any) -> pl.Trainer:
        trainer = super().instantiate_trainer(**kwargs)
        trainer.callbacks.append(KillAtStep(self.kill_at_step))
        return trainer


if __name__ == "__main__":
    freeze_at_exit()  # as the mmoe command does: each rank's shutdown skips the objects alive at exit
    step, sys.argv = int(sys.argv[1]), [sys.argv[0], *sys.argv[2:]]
    KilledAtStepCLI(step, **cli_arguments())
