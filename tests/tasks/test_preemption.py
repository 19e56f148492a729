"""Stopping a run on a signal (:mod:`mmoe.runtime.preemption`), in this process through ``run_lightning`` (the demo's
and the claims study's way in): the step the signal interrupts is finished and saved, the exit code is 128 + the
signal's number, the handlers from before the run are back afterwards; DataLoader workers ignore stop signals; signal
names are checked."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from torch.utils.data import IterableDataset

from mmoe.config.launch import run_lightning
from mmoe.data.loader import EpochDataLoader
from mmoe.data.workers import STOP_SIGNALS, IgnoringStopSignals, started_with_stop_signals_blocked
from mmoe.runtime.layout import RunLayout
from mmoe.runtime.preemption import Preemption, resume_arguments, signal_numbers
from tests.cli_fixtures import run_mmoe, small_shards
from tests.tasks.test_launch import nlvr2_config


class SignalDuringStep(L.Callback):
    """Sends ``signum`` to this process in the middle of step ``step`` (between its loss and its backward pass)."""

    def __init__(self, signum: signal.Signals, step: int, times: int = 1) -> None:
        self.signum, self.step, self.times = signum, step, times

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if trainer.global_step == self.step:
            for _ in range(self.times):
                signal.raise_signal(self.signum)


class SignalBeforeTraining(L.Callback):
    def __init__(self, signum: signal.Signals) -> None:
        self.signum = signum

    def on_fit_start(self, trainer, pl_module) -> None:
        signal.raise_signal(self.signum)


@pytest.fixture(autouse=True)
def ctrl_c_handled():
    """SIGINT handled as in a terminal's foreground process, whatever this test run inherited: a run started in the
    background by a non-interactive shell (or ``nohup``) has it ignored, and :class:`Preemption` leaves an ignored
    signal ignored."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return small_shards(tmp_path_factory.mktemp("preemption"))


def nlvr2_run(shards, tmp_path, max_steps: int = 6) -> tuple[str, RunLayout]:
    layout = RunLayout(tmp_path / "run")
    config = nlvr2_config(shards, layout.root)
    config["trainer"].update(max_steps=max_steps, callbacks=[
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
         "init_args": {"save_last": True, "every_n_train_steps": 4}}])  # fmt: skip
    path = tmp_path / "nlvr2.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path), layout


def global_step(path) -> int:
    return torch.load(path, map_location="cpu", weights_only=True)["global_step"]


def test_a_signal_mid_step_saves_that_step_and_exits_with_128_plus_its_number(shards, tmp_path, capsys):
    config, layout = nlvr2_run(shards, tmp_path)
    before = signal.getsignal(signal.SIGUSR2)
    preemption = Preemption(signals=["SIGUSR2"])  # the caller's choice of signals is kept
    with pytest.raises(SystemExit) as stopped:
        run_lightning("fit", [config], callbacks=[preemption, SignalDuringStep(signal.SIGUSR2, step=1)])
    assert stopped.value.code == 128 + signal.SIGUSR2
    assert global_step(layout.last_checkpoint) == 2  # the interrupted step (global step 1 -> 2) was finished
    last = capsys.readouterr().err.strip().splitlines()[-1]
    saved = f"global step 2, saved to {layout.last_checkpoint}"
    assert last == f"mmoe fit: stopped by SIGUSR2 after {saved}; resume with ckpt_path='last'"
    assert signal.getsignal(signal.SIGUSR2) is before


def test_the_resumed_run_finishes_and_a_run_without_a_signal_is_untouched(shards, tmp_path, capsys):
    config, layout = nlvr2_run(shards, tmp_path, max_steps=4)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(SystemExit) as stopped:
        run_lightning("fit", [config], callbacks=[SignalDuringStep(signal.SIGINT, step=0)])
    assert stopped.value.code == 130
    assert global_step(layout.last_checkpoint) == 1
    assert signal.getsignal(signal.SIGINT) is before
    assert "mmoe fit: stopped by SIGINT after global step 1, saved to " in capsys.readouterr().err
    cli = run_lightning("fit", [config], {"ckpt_path": str(layout.last_checkpoint)})
    assert cli.trainer.global_step == 4 and global_step(layout.last_checkpoint) == 4
    assert sum(isinstance(callback, Preemption) for callback in cli.trainer.callbacks) == 1
    assert signal.getsignal(signal.SIGINT) is before
    assert "stopped by" not in capsys.readouterr().err


def test_a_second_signal_goes_to_the_handler_from_before_the_run(shards, tmp_path):
    config, layout = nlvr2_run(shards, tmp_path)
    received = []
    before = signal.signal(signal.SIGUSR2, lambda number, frame: received.append(number))
    try:
        with pytest.raises(SystemExit) as stopped:
            run_lightning("fit", [config], callbacks=[Preemption(["SIGUSR2"]), SignalDuringStep(signal.SIGUSR2, 1, 2)])
    finally:
        signal.signal(signal.SIGUSR2, before)
    assert received == [signal.SIGUSR2]  # the second one (by default it would end the process at once)
    assert stopped.value.code == 140 and global_step(layout.last_checkpoint) == 2


def test_a_signal_before_the_first_step_saves_nothing(shards, tmp_path, capsys):
    config, layout = nlvr2_run(shards, tmp_path)
    with pytest.raises(SystemExit) as stopped:
        run_lightning("fit", [config], callbacks=[SignalBeforeTraining(signal.SIGINT)])
    assert stopped.value.code == 130
    assert not layout.last_checkpoint.exists()
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "mmoe fit: stopped by SIGINT before any step was trained: nothing saved"


class SignalAtSanityCheck(L.Callback):
    def on_sanity_check_start(self, trainer, pl_module) -> None:
        signal.raise_signal(signal.SIGUSR2)


def test_a_signal_in_the_sanity_check_stops_before_training(shards, tmp_path, capsys):
    config, layout = nlvr2_run(shards, tmp_path)
    options = {"trainer": {"limit_val_batches": 1, "num_sanity_val_steps": 1}}
    with pytest.raises(SystemExit) as stopped:
        run_lightning("fit", [config], options, [Preemption(["SIGUSR2"]), SignalAtSanityCheck()])
    assert stopped.value.code == 140 and not layout.last_checkpoint.exists()
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "mmoe fit: stopped by SIGUSR2 in the sanity check, before any step was trained: nothing saved"


class SignalDuringValidation(L.Callback):
    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        signal.raise_signal(signal.SIGUSR2)


def test_validate_stops_without_metrics(shards, tmp_path, capsys):
    config, _ = nlvr2_run(shards, tmp_path)
    with pytest.raises(SystemExit) as stopped:
        run_lightning("validate", [config], {"trainer": {"limit_val_batches": 2}},
                      callbacks=[Preemption(["SIGUSR2"]), SignalDuringValidation()])  # fmt: skip
    assert stopped.value.code == 140
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "mmoe validate: stopped by SIGUSR2 after 1 batch of validation: no metrics reported"


def test_without_a_checkpoint_callback_the_run_folder_holds_it_and_the_resume_names_it(shards, tmp_path, capsys):
    config, layout = nlvr2_run(shards, tmp_path)
    options = {"trainer": {"callbacks": [], "enable_checkpointing": False}}
    with pytest.raises(SystemExit):
        run_lightning("fit", [config], options, [Preemption(["SIGUSR2"]), SignalDuringStep(signal.SIGUSR2, step=0)])
    assert global_step(layout.last_checkpoint) == 1
    *before, last = capsys.readouterr().err.strip().splitlines()
    assert before[-1].startswith("mmoe fit: samples skipped: ")  # said at a signal too
    assert last.endswith(f"saved to {layout.last_checkpoint}; resume with ckpt_path='{layout.last_checkpoint}'")


class WorkerSignals(IterableDataset):
    """Yields, from a DataLoader worker, how that worker handles each stop signal: ignored, or (SIGTERM) blocked for
    the thread that takes it."""

    def __iter__(self):
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        yield {int(stop): signal.getsignal(stop) == signal.SIG_IGN or stop in blocked for stop in STOP_SIGNALS}


def test_loader_workers_ignore_stop_signals_and_run_the_loaders_own_init(tmp_path):
    marker = tmp_path / "init_ran"
    loader = EpochDataLoader(WorkerSignals(), batch_size=None, num_workers=1, worker_init_fn=TouchFile(marker))
    (ignored,) = list(loader)
    assert ignored == {int(stop): True for stop in STOP_SIGNALS}
    assert marker.exists()
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN  # this process still handles them


def worker_until_ended(ready) -> None:
    IgnoringStopSignals()(0)
    ready.set()
    time.sleep(60)


def test_a_worker_drops_a_sigterm_from_others_and_ends_on_its_parents():
    """A group SIGTERM (sent by ``kill``, ``timeout``) leaves the worker to its parent; the parent's own SIGTERM
    (``multiprocessing``'s exit handler, torch's loader shutdown) ends it, so the parent never waits forever."""
    context = multiprocessing.get_context("fork")
    ready = context.Event()
    worker = context.Process(target=worker_until_ended, args=(ready,), daemon=True)
    worker.start()
    try:
        assert ready.wait(30)
        subprocess.run(["kill", "-TERM", str(worker.pid)], check=True)  # another process sends it
        worker.join(2)
        assert worker.is_alive()
        worker.terminate()  # the parent sends it
        worker.join(10)
        assert not worker.is_alive() and worker.exitcode == 128 + signal.SIGTERM
    finally:
        if worker.is_alive():
            worker.kill()


def report_blocked_signals(queue) -> None:
    queue.put(sorted(int(blocked) for blocked in signal.pthread_sigmask(signal.SIG_BLOCK, [])))


def test_workers_start_with_stop_signals_blocked_and_the_parent_gets_one_sent_meanwhile():
    """The moment between a worker's fork and its ``worker_init_fn``: a group signal then would end the worker with
    the default action (the main process then fails with "DataLoader worker exited unexpectedly"). Forked under
    :func:`started_with_stop_signals_blocked`, the worker starts with every stop signal blocked; the parent's mask is
    restored after, and a SIGUSR2 sent to the forking thread meanwhile reaches the parent's handler then."""
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    received = []
    previous = signal.signal(signal.SIGUSR2, lambda number, frame: received.append(number))
    mask_before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    try:

        def start():
            # Sent to this thread (a signal to the process may go to another thread, which has not blocked it) while
            # the workers start: held, not lost.
            signal.pthread_kill(threading.get_ident(), signal.SIGUSR2)
            assert received == []
            worker = context.Process(target=report_blocked_signals, args=(queue,))
            worker.start()
            return iter([worker])

        (worker,) = list(started_with_stop_signals_blocked(start))
        assert set(queue.get(timeout=30)) >= {int(stop) for stop in STOP_SIGNALS}
        worker.join(30)
        assert received == [signal.SIGUSR2]
        assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask_before
    finally:
        signal.signal(signal.SIGUSR2, previous)


class TouchFile:
    def __init__(self, path) -> None:
        self.path = path

    def __call__(self, worker_id: int) -> None:
        self.path.touch()


def test_signal_names_are_checked():
    assert signal_numbers(["SIGTERM", "INT", "sigusr1"]) == [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1]
    for bad in ("SIGKILL", "SIGTERMINATE", "9"):
        with pytest.raises(ValueError, match=f"Preemption signals: '{bad}' is not a signal that can be handled"):
            signal_numbers([bad])


def test_a_config_naming_a_bad_signal_fails_in_one_line(shards, tmp_path, capsys):
    config, _ = nlvr2_run(shards, tmp_path)
    values = yaml.safe_load(open(config))
    values["trainer"]["callbacks"].append(
        {"class_path": "mmoe.runtime.preemption.Preemption", "init_args": {"signals": ["SIGTERM", "SIGKILL"]}}
    )
    yaml.safe_dump(values, open(config, "w"))
    code, _, err = run_mmoe(["fit", "--config", config], capsys)
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        "mmoe fit: error: Preemption signals: 'SIGKILL' is not a signal that can be handled (expected a name such "
        "as SIGTERM, SIGINT, SIGUSR1; not SIGKILL or SIGSTOP)"
    )


def test_the_resume_command_replaces_the_checkpoint_argument():
    given = ["fit", "--config", "a.yaml", "--ckpt_path", "old.ckpt", "--ckpt_path=x", "--trainer.max_steps", "9"]
    assert resume_arguments(given, "last") == [
        "fit", "--config", "a.yaml", "--trainer.max_steps", "9", "--ckpt_path", "last"]  # fmt: skip


@pytest.mark.slow
def test_in_ddp_rank_zeros_signal_stops_both_ranks_after_the_same_step(synthetic_corpus, tmp_path):
    script = Path(__file__).resolve().parents[1] / "scripts" / "ddp_preempt.py"
    shards = synthetic_corpus / "shards" / "pretrain-pairs"
    done = subprocess.run([sys.executable, str(script), str(tmp_path), str(synthetic_corpus / "codebook.pt"),
                           str(shards)], capture_output=True, text=True, timeout=600,
                          env=os.environ | {"OMP_NUM_THREADS": "1"})  # fmt: skip
    assert done.returncode == 128 + signal.SIGUSR2, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert ranks == [{"step": 2, "code": 140}] * 2  # rank 1 got no signal, and stopped with rank 0
    assert global_step(tmp_path / "checkpoints" / "last.ckpt") == 2
    assert done.stderr.count("stopped by") == 1  # said once, by rank 0
