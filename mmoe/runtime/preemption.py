"""Stopping ``mmoe fit | validate | test | predict`` on a termination signal (SIGTERM from ``kill``, ``timeout`` or
SLURM, SIGINT from Ctrl-C, SIGHUP from a closed terminal or a dropped SSH session, SIGUSR1 from a scheduler's
pre-emption warning), without losing a trained step.

:class:`Preemption` replaces Lightning's own SIGTERM handling (which finishes the batch, saves nothing and exits 0
through ``SIGTERMException``) for the run: the handler only records the signal; the callback acts between steps.
``fit`` finishes the step in progress, saves it to the run's ``last.ckpt`` through ``trainer.save_checkpoint`` (so
the checkpoint IO plugins apply), lets the loop log it and exits before the next batch (a signal during a validation
inside ``fit`` is acted on after the validation and the next step: a checkpoint taken mid-validation would not resume
exactly); ``predict`` stops before its predictions file is written; ``validate``
and ``test`` stop before their metrics. Each ends with one line on stderr naming the signal and what was saved, and
exit code 128 + the signal's number (143 for SIGTERM, 130 for SIGINT, 129 for SIGHUP), as a shell reports a process
the signal killed.

A second signal is not waited on. During the save of the step in progress it ends the save at once: its temporary
file is removed (the previous ``last.ckpt`` stays whole), one line says the save was cut short and names the newest
checkpoint and its step, and the exit code is again 128 + the (second) signal's number. At any other moment it goes
to the handler from before the run; when that is the default one, which ends the process at once, a line naming the
newest checkpoint comes first.

A signal that is ignored when the run starts stays ignored, as the one who started it asked: SIGHUP under ``nohup``
(the run goes on when the terminal closes), SIGINT in a job a shell script started in the background (the Ctrl-C
meant for the script does not stop it), any signal a launcher set aside.

Distributed runs: the handler of global rank 0 decides. Every step, rank 0's received signal (or none) is broadcast,
so all ranks stop after the same step and save the checkpoint collectively (Lightning writes it from rank 0).
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn

from mmoe.runtime.checkpoint_saving import saved_step
from mmoe.runtime.layout import RunLayout
from mmoe.runtime.lightning_internals import SignalConnector, replace_signal_connector

#: The signals handled unless a run names others.
DEFAULT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1")


def signal_numbers(names: Sequence[str]) -> list[signal.Signals]:
    """The signals named by ``names`` (``"SIGTERM"`` or ``"TERM"``).

    Raises:
        ValueError: a name that is not a signal this system can handle (SIGKILL and SIGSTOP cannot be).
    """
    catchable = signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}
    numbers = []
    for name in names:
        full = name if name.upper().startswith("SIG") else f"SIG{name}"
        number = getattr(signal.Signals, full.upper(), None)
        if number not in catchable:
            raise ValueError(
                f"Preemption signals: {name!r} is not a signal that can be handled (expected a name such as SIGTERM, "
                "SIGINT, SIGUSR1; not SIGKILL or SIGSTOP)"
            )
        numbers.append(number)
    return numbers


class Preempted(SystemExit):
    """The command stopped on a signal; ``code`` is 128 + the signal's number. Its line is printed when raised."""


class SaveInterrupted(Preempted):
    """A second signal during the save of the step in progress, raised by its handler out of the save."""


class Preemption(L.Callback):
    """Stops the run on any of ``signals`` after the step in progress, saving it (see the module docstring).

    Added to every ``mmoe`` Lightning command by :class:`mmoe.config.cli.MMoECLI`; a config's ``trainer.callbacks``
    may list it to choose the signals (those it leaves out keep Lightning's and Python's handling; one ignored when
    the run starts, as SIGHUP under ``nohup``, stays ignored). A second signal ends a save in progress, or goes to
    the handler from before the run: by default, the process ends at once (see the module docstring).

    Args:
        signals: names of the signals that stop the run (``SIGTERM``, ``SIGINT``, ``SIGHUP``, ``SIGUSR1``,
            ``SIGUSR2``, ...).

    Attributes:
        command: the ``mmoe`` arguments of the running command (``["fit", "--config", ...]``), to print the resume
            command; None when the run was started from Python.
        received: the signal that stopped the run (on global rank 0, the one that decides), or None.
    """

    def __init__(self, signals: Sequence[str] = DEFAULT_SIGNALS) -> None:
        self.signals = signal_numbers(signals)
        self.command: list[str] | None = None
        self.received: signal.Signals | None = None
        self._before: dict[signal.Signals, Any] = {}
        self._trained_steps = 0
        self._saved_path: str | None = None
        self._saved_step = 0
        self._resume_from = "last"
        self._trainer: L.Trainer | None = None  # the fitting trainer, whose checkpoints a second signal names
        self._saving: Path | None = None  # the checkpoint being saved
        self._resumed: tuple[str, int] | None = None  # (absolute path, global step) of the checkpoint resumed

    # --- the handlers -------------------------------------------------------------------------------------------------

    def install(self) -> None:
        """Sets the handler for each of :attr:`signals`, keeping the handlers it replaces the first time; a signal
        ignored then stays ignored (see the module docstring)."""
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set signal handlers
        for number in self.signals:
            before = self._before.setdefault(number, signal.getsignal(number))
            signal.signal(number, signal.SIG_IGN if before == signal.SIG_IGN else self._record)

    def restore(self) -> None:
        """Puts back the handlers :meth:`install` replaced."""
        if threading.current_thread() is not threading.main_thread():
            return
        for number, handler in self._before.items():
            signal.signal(number, signal.SIG_DFL if handler is None else handler)

    def _record(self, number: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(number)
            return
        self.restore()  # a third signal goes to the handler from before the run
        if self._saving is not None:
            raise SaveInterrupted(128 + number)  # out of the save, which removes its temporary file; see _save
        if self._trainer is not None and self._before.get(number) in (signal.SIG_DFL, None):  # the process ends now
            last = self._last_checkpoint(self._trainer)
            saved = self._saved_path is not None
            when = f"after saving global step {self._saved_step}" if saved else "before the step in progress was saved"
            self._say_stopped_at_once(number, when, last, self._known_step(self._trainer, last))
        signal.raise_signal(number)

    # --- where the run stops ------------------------------------------------------------------------------------------

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.received, self._saved_path, self._trained_steps, self._before = None, None, 0, {}
        self._trainer = trainer if stage == "fit" else None
        replace_signal_connector(trainer, PreemptionSignalConnector(trainer, self))
        self.install()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._trainer = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        resumed = trainer.ckpt_path
        self._resumed = (os.path.abspath(resumed), trainer.global_step) if resumed else None

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Saves the step just trained when a signal came (the loop then logs it; the run stops before the next)."""
        last_batch = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        if (batch_idx + 1) % trainer.accumulate_grad_batches and not last_batch:
            return  # part of a step: it ends, and can be saved, with its optimiser update
        self._trained_steps += 1
        if self._saved_path is None and self._decided(trainer):
            self._save(trainer)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._saved_path is not None:
            self._stop(trainer, f"after {self._saved()}; {self._resume_hint()}")
        if self._trained_steps == 0 and self._decided(trainer):
            self._stop(trainer, "before any step was trained: nothing saved")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """A signal after the last step, or during the validation after it: the finished run is saved as well."""
        if self._saved_path is None and self._decided(trainer):
            self._save(trainer)
        if self._saved_path is not None:
            self._stop(trainer, f"after the last step, {self._saved()}")

    def on_validation_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int, *_: Any
    ) -> None:
        if trainer.sanity_checking and self._decided(trainer):
            self._stop(trainer, "in the sanity check, before any step was trained: nothing saved")
        if trainer.state.fn == TrainerFn.VALIDATING and self._decided(trainer):
            self._stop(trainer, f"after {batches(batch_idx + 1)} of validation: no metrics reported")

    def on_test_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int, *_: Any
    ) -> None:
        if self._decided(trainer):
            self._stop(trainer, f"after {batches(batch_idx + 1)} of test: no metrics reported")

    def on_predict_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int, *_: Any
    ) -> None:
        if self._decided(trainer):
            written = getattr(pl_module, "predictions_file", None)
            what = f"{written} was not written" if written else "no predictions were written"
            self._stop(trainer, f"after predicting {batches(batch_idx + 1)}: {what}")

    def on_predict_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._decided(trainer):
            written = getattr(pl_module, "predictions_file", None)
            what = f"{written} was written whole" if written else "nothing was written"
            self._stop(trainer, f"after the last batch: {what}")

    def _decided(self, trainer: L.Trainer) -> bool:
        """Whether the run stops: global rank 0's signal, the same on every rank."""
        if trainer.world_size > 1:
            number = trainer.strategy.broadcast(None if self.received is None else int(self.received), src=0)
            self.received = None if number is None else signal.Signals(number)
        return self.received is not None

    def _save(self, trainer: L.Trainer) -> None:
        """Saves the whole run (weights, optimiser, loops, data position) to ``last.ckpt`` (:meth:`_last_checkpoint`);
        a second signal meanwhile ends the save and the run at once (see the module docstring)."""
        path = self._last_checkpoint(trainer)
        callback = trainer.checkpoint_callback
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
            # Saved as the callback's own last checkpoint, so the resumed run's callback writes over it (a file it
            # did not write would be kept, and the next one named last-v1.ckpt).
            callback.last_model_path, self._resume_from = str(path), "last"
        else:
            self._resume_from = str(path)
        before = file_identity(path)
        self._saving = path
        try:
            trainer.save_checkpoint(path, weights_only=False)
        except SaveInterrupted as interrupted:
            number = int(interrupted.code) - 128
            if file_identity(path) != before:  # renamed into place before the signal came
                when = f"right after saving global step {trainer.global_step}"
                self._say_stopped_at_once(number, when, path, trainer.global_step)
            else:
                when = (
                    f"during the save of global step {trainer.global_step}, which was cut short (no partial file left)"
                )
                self._say_stopped_at_once(number, when, path, self._known_step(trainer, path))
            raise
        finally:
            self._saving = None
        self._saved_path, self._saved_step = str(path), trainer.global_step

    def _last_checkpoint(self, trainer: L.Trainer) -> Path:
        """``last.ckpt`` in the folder of the trainer's ``ModelCheckpoint``, the one ``--ckpt_path last`` resumes
        from; without one, in the run folder's ``checkpoints/`` (and the resume command names the file)."""
        callback = trainer.checkpoint_callback
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
            return Path(callback.dirpath) / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"
        return RunLayout(Path(trainer.default_root_dir)).last_checkpoint

    def _say_stopped_at_once(self, number: int, when: str, last: Path, step: int | None) -> None:
        """The line of a fit a second signal ends at once ``when``, naming the newest checkpoint, ``last``, and its
        ``step`` (None: unknown)."""
        trainer = self._trainer
        if trainer is None or not trainer.is_global_zero:
            return
        if not last.is_file():
            newest = f"no checkpoint was saved to {last}"
        else:
            newest = (
                f"the newest checkpoint is {last} ({'its step unknown' if step is None else f'global step {step}'})"
            )
        command = self.command[0] if self.command else "fit"
        name = signal.Signals(number).name
        print(f"mmoe {command}: stopped at once by a second {name} {when}; {newest}", file=sys.stderr, flush=True)

    def _known_step(self, trainer: L.Trainer, last: Path) -> int | None:
        """The global step of the checkpoint at ``last`` as this process knows it, without reading the file: of its
        own last save there, else of the checkpoint it resumed when that is the file; None when neither."""
        step = saved_step(trainer, last)
        if step is None and self._resumed is not None and self._resumed[0] == os.path.abspath(last):
            step = self._resumed[1]
        return step

    def _saved(self) -> str:
        return f"global step {self._saved_step}, saved to {self._saved_path}"

    def _stop(self, trainer: L.Trainer, what: str) -> None:
        command = self.command[0] if self.command else trainer.state.fn.value
        report_skips = getattr(trainer.datamodule, "report_skips", None)
        if callable(report_skips):
            report_skips(trainer.state.fn)
        if trainer.is_global_zero:
            print(f"mmoe {command}: stopped by {self.received.name} {what}", file=sys.stderr, flush=True)
        raise Preempted(128 + int(self.received))

    def _resume_hint(self) -> str:
        if self.command is None:
            return f"resume with ckpt_path={self._resume_from!r}"
        return f"resume with: mmoe {shlex.join(resume_arguments(self.command, self._resume_from))}"


class PreemptionSignalConnector(SignalConnector):
    """Lightning's signal connector with :class:`Preemption`'s handlers set over its own (Lightning would otherwise
    take SIGTERM again when the run starts), and the handlers from before the run put back at its end."""

    def __init__(self, trainer: L.Trainer, preemption: Preemption) -> None:
        super().__init__(trainer)
        self.preemption = preemption

    def register_signal_handlers(self) -> None:
        super().register_signal_handlers()
        self.preemption.install()

    def teardown(self) -> None:
        super().teardown()
        self.preemption.restore()


def file_identity(path: Path) -> tuple[int, int] | None:
    """(inode, modification time) of ``path``, which a save renamed into place changes; None when it is absent."""
    try:
        status = os.stat(path)
    except FileNotFoundError:
        return None
    return status.st_ino, status.st_mtime_ns


def batches(count: int) -> str:
    return f"{count} batch" if count == 1 else f"{count} batches"


def resume_arguments(command: Sequence[str], ckpt: str) -> list[str]:
    """``command`` (``mmoe`` arguments) with its ``--ckpt_path`` replaced by ``ckpt``."""
    arguments, skip = [], False
    for argument in command:
        if skip:
            skip = False
        elif argument == "--ckpt_path":
            skip = True
        elif not argument.startswith("--ckpt_path="):
            arguments.append(argument)
    return [*arguments, "--ckpt_path", ckpt]


def with_preemption(trainer: L.Trainer, command: Sequence[str] | None) -> L.Trainer:
    """``trainer`` with a :class:`Preemption` callback (a new one before the checkpoint callbacks, unless it has
    one) told the command it runs."""
    callbacks = trainer.callbacks
    preemption = next((callback for callback in callbacks if isinstance(callback, Preemption)), None)
    if preemption is None:
        preemption = Preemption()
        first_checkpoint = next((i for i, c in enumerate(callbacks) if isinstance(c, ModelCheckpoint)), len(callbacks))
        callbacks.insert(first_checkpoint, preemption)
    preemption.command = None if command is None else [str(argument) for argument in command]
    return trainer
