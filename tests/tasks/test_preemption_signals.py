"""Signals a fit meets outside a scheduler's single SIGTERM, sent to a real process: SIGHUP (a terminal closed, an SSH
session dropped) stops it like SIGTERM, saving the step in progress; a second signal that ends the run at once, during
the save of that step or before it, says so in one line naming the newest checkpoint, and a cut save leaves no
temporary file beside it; a signal ignored when the fit starts (SIGHUP under ``nohup``) stays ignored."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import pytest
import yaml

from mmoe.config.launch import run_lightning
from tests.cli_fixtures import small_shards
from tests.tasks.resumable_fit import ENV, saved_step
from tests.tasks.test_launch import nlvr2_config

pytestmark = pytest.mark.slow

REPOSITORY = Path(__file__).resolve().parents[2]
#: ``mmoe fit`` as a user runs it; and a fit through ``run_lightning`` with this module's signalling callbacks.
MMOE_FIT = "import sys; from mmoe.cli import main; sys.exit(main(sys.argv[1:]))"
SIGNALLED_FIT = (
    "import sys; from tests.tasks.test_preemption_signals import signalled_fit; signalled_fit(*sys.argv[1:])"
)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return small_shards(tmp_path_factory.mktemp("preemption_signals"))


def fit_config(shards: Path, root: Path, steps: int) -> Path:
    """A tiny NLVR2 fit into ``root`` for ``steps`` steps, ``last.ckpt`` saved every 4 steps."""
    config = nlvr2_config(shards, root)
    checkpoint = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                  "init_args": {"save_last": True, "save_top_k": 0, "every_n_train_steps": 4}}  # fmt: skip
    config["trainer"].update(max_steps=steps, callbacks=[checkpoint])
    path = root.parent / "fit.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@contextlib.contextmanager
def fit_with_a_checkpoint(config: Path, last: Path, sighup: signal.Handlers) -> Iterator[subprocess.Popen]:
    """``mmoe fit --config config`` as a user runs it, started with SIGHUP's handler ``sighup`` (SIG_DFL: as a
    terminal's job, whatever pytest has; SIG_IGN: as under ``nohup``), yielded once it has saved ``last``; killed at
    the end if still running."""
    process = subprocess.Popen([sys.executable, "-c", MMOE_FIT, "fit", "--config", str(config)], cwd=config.parent,
                               env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGHUP, sighup))  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while not last.exists():  # training, with a checkpoint saved (renamed into place whole: a cheap poll)
            assert process.poll() is None, process.stderr.read()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        yield process
    finally:
        process.kill()
        process.wait()


def temporaries(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir() if path.name.startswith(".last.ckpt."))


class SignalWhenPickled:
    """Pickled as an empty dict, sending ``signum`` to this process meanwhile: a signal in the middle of writing the
    checkpoint it is part of."""

    def __init__(self, signum: int) -> None:
        self.signum = signum

    def __reduce__(self):
        signal.raise_signal(self.signum)
        return dict, ()


class SignalTwice(L.Callback):
    """Sends ``signum`` in the middle of step ``step``, and again ``when``: ``"in the save"`` (while the checkpoint
    of that step is written) or ``"at once"`` (right after the first, before the step ends)."""

    def __init__(self, signum: int, step: int, when: str) -> None:
        self.signum, self.step, self.when, self.armed = signum, step, when, False

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if trainer.global_step == self.step:
            signal.raise_signal(self.signum)
            self.armed = self.when == "in the save"
            if self.when == "at once":
                signal.raise_signal(self.signum)

    def state_dict(self) -> dict:
        return {"signal": SignalWhenPickled(self.signum)} if self.armed else {}


def signalled_fit(config: str, signum: str, step: str, when: str) -> None:
    """The fit of ``config`` with :class:`SignalTwice` (run in a child process: a signal may end it)."""
    run_lightning("fit", [config], callbacks=[SignalTwice(int(signum), int(step), when)])


def run_signalled_fit(config: Path, when: str) -> subprocess.CompletedProcess:
    arguments = [str(config), str(int(signal.SIGTERM)), "5", when]
    return subprocess.run([sys.executable, "-c", SIGNALLED_FIT, *arguments], cwd=REPOSITORY, capture_output=True,
                          text=True, timeout=600, env=ENV | {"PYTHONPATH": str(REPOSITORY)})  # fmt: skip


def test_a_second_sigterm_during_the_save_says_it_was_cut_short_and_leaves_no_temporary_file(shards, tmp_path):
    root = tmp_path / "run"
    done = run_signalled_fit(fit_config(shards, root, steps=12), "in the save")
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-3000:]
    last = root / "checkpoints" / "last.ckpt"
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "mmoe fit: stopped at once by a second SIGTERM during the save of global step 6, which was cut short (no "
        f"partial file left); the newest checkpoint is {last} (global step 4)"
    )
    assert saved_step(last) == 4
    assert temporaries(last.parent) == []


def test_a_second_sigterm_before_the_save_says_what_is_saved_and_ends_the_run_at_once(shards, tmp_path):
    root = tmp_path / "run"
    done = run_signalled_fit(fit_config(shards, root, steps=12), "at once")
    assert done.returncode == -signal.SIGTERM, done.stderr[-3000:]  # ended by the signal itself, as before the run
    last = root / "checkpoints" / "last.ckpt"
    assert done.stderr.strip().splitlines()[-1] == (
        "mmoe fit: stopped at once by a second SIGTERM before the step in progress was saved; the newest checkpoint "
        f"is {last} (global step 4)"
    )
    assert saved_step(last) == 4


def test_sighup_stops_a_fit_like_sigterm_saving_the_step_in_progress(shards, tmp_path):
    """As an SSH session dropped without tmux or nohup: the run stops, its steps saved, exit code 129."""
    root = tmp_path / "run"
    config = fit_config(shards, root, steps=10_000)
    last = root / "checkpoints" / "last.ckpt"
    with fit_with_a_checkpoint(config, last, signal.SIG_DFL) as process:
        process.send_signal(signal.SIGHUP)
        _, stderr = process.communicate(timeout=600)
    assert process.returncode == 128 + signal.SIGHUP == 129, stderr[-3000:]
    line = stderr.strip().splitlines()[-1]
    assert line.startswith("mmoe fit: stopped by SIGHUP after global step "), stderr[-3000:]
    step = int(line.split("global step ", 1)[1].split(",", 1)[0])
    assert line.startswith(f"mmoe fit: stopped by SIGHUP after global step {step}, saved to {last}; resume with: ")
    assert saved_step(last) == step
    assert not (root / ".mmoe-run.lock").exists() and os.listdir(root / "checkpoints") == ["last.ckpt"]


def test_a_fit_started_with_sighup_ignored_as_under_nohup_keeps_training_to_its_end(shards, tmp_path):
    """``nohup mmoe fit ... &``: the terminal closing (SIGHUP) does not stop the run. The fit is paused (SIGSTOP)
    while SIGHUP is sent, so that the signal surely comes before its last step."""
    root = tmp_path / "run"
    steps = 40
    config = fit_config(shards, root, steps=steps)
    last = root / "checkpoints" / "last.ckpt"
    with fit_with_a_checkpoint(config, last, signal.SIG_IGN) as process:
        process.send_signal(signal.SIGSTOP)
        _, status = os.waitpid(process.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status) and saved_step(last) < steps  # paused before its end
        process.send_signal(signal.SIGHUP)
        process.send_signal(signal.SIGCONT)
        _, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-3000:]
    assert "stopped by" not in stderr
    assert saved_step(last) == steps
