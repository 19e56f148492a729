"""A real `mmoe fit` stopped by a signal to its process group (its DataLoader worker included): the step in progress
is trained, logged and saved to `last.ckpt`, one line on stderr names the signal, the step and the resume command, the
exit code is 128 + the signal's number, and the worker ends with it. That the resumed run continues exactly is
tests/tasks/test_resume_exact.py's."""

from __future__ import annotations

import os
import signal
import time

import pytest
import yaml

from tests.tasks.resumable_fit import (
    losses,
    resumable_config,
    saved_step_in,
    start_fit,
    stop_line,
    wait_for_checkpoint,
)

pytestmark = pytest.mark.slow


# SIGTERM from `timeout`, SLURM or `kill -- -PGID`; SIGINT from Ctrl-C in a terminal; SIGHUP from a shell whose SSH
# session dropped.
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=["SIGTERM", "SIGINT", "SIGHUP"])
def test_a_signal_to_the_process_group_stops_the_workers_without_a_traceback(stop, synthetic_corpus, tmp_path):
    config = resumable_config(synthetic_corpus, tmp_path, "first")
    assert yaml.safe_load(config.read_text())["data"]["init_args"]["num_workers"] == 1
    checkpoint = tmp_path / "checkpoints" / "last.ckpt"
    process = start_fit(config, tmp_path)
    wait_for_checkpoint(process, checkpoint, 10)
    os.killpg(process.pid, stop)  # the loader worker gets it too
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == 128 + stop
    assert "DataLoader worker" not in stderr and "KeyboardInterrupt" not in stderr
    step = saved_step_in(stop_line(stderr, stop.name), checkpoint)
    assert sorted(losses(tmp_path, "first")) == list(range(step))
    deadline = time.monotonic() + 300  # a bound for a loaded machine: the loop ends once the worker is gone
    while group_alive(process.pid):  # the worker is shut down with its main process
        assert time.monotonic() < deadline
        time.sleep(0.1)


def group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True
