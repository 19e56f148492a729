"""Jobs in worker processes: results in order, a failing job's error, and workers that end with the main process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from functools import partial
from pathlib import Path

import pytest

from mmoe.data.processes import run_in_processes

REPO = Path(__file__).resolve().parents[2]


def test_results_come_in_order_from_other_processes():
    jobs = [partial(pow, value, 2) for value in range(7)]
    assert run_in_processes(jobs, 1) == run_in_processes(jobs, 3) == [value**2 for value in range(7)]
    pids = run_in_processes([os.getpid] * 4, 2)
    assert os.getpid() not in pids and len(set(pids)) <= 2
    assert run_in_processes([os.getpid], 2) == [os.getpid()]  # one job runs here
    assert run_in_processes([], 2) == []


def test_a_failing_job_raises_here_and_ends_the_running_ones():
    # The sleeps outlast any test run: returning at all means the running job was ended, not waited for (the bound
    # is only there to fail instead of hanging, and leaves a loaded machine ten times the room it needs).
    start = time.monotonic()
    with pytest.raises(ValueError, match="invalid literal"):
        run_in_processes([partial(time.sleep, 3600), partial(int, "not a number"), partial(time.sleep, 3600)], 2)
    assert time.monotonic() - start < 600


def child_process_pids(parent: int) -> set[int]:
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            pids.add(int(stat.parent.name))
    return pids


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# The command as a terminal's foreground job starts it: Ctrl-C handled. A test run started in the background by a
# non-interactive shell has SIGINT ignored, and a child would inherit that.
SLEEPING_JOBS = textwrap.dedent(
    """
    import signal, time
    from functools import partial
    from mmoe.data.processes import run_in_processes
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print("started", flush=True)
    run_in_processes([partial(time.sleep, 3600)] * 2, 2)  # outlasts every wait below
    """
)


def started_with_two_workers() -> tuple[subprocess.Popen, set[int]]:
    process = subprocess.Popen(
        [sys.executable, "-c", SLEEPING_JOBS], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    assert process.stdout.readline().strip() == "started"
    deadline = time.monotonic() + 300  # a bound for a loaded machine: the loop ends as soon as both have started
    while len(workers := child_process_pids(process.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(workers) == 2
    return process, workers


def wait_until_gone(pids: set[int], seconds: float = 120) -> set[int]:
    deadline = time.monotonic() + seconds
    while (left := {pid for pid in pids if alive(pid)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc")
def test_workers_end_when_the_main_process_is_killed():
    process, workers = started_with_two_workers()
    process.kill()
    process.wait(timeout=120)
    left = wait_until_gone(workers)
    for pid in left:  # do not leave them behind if the test fails
        os.kill(pid, signal.SIGKILL)
    assert not left


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc")
def test_ctrl_c_stops_the_main_process_with_one_traceback_and_ends_the_workers():
    process, workers = started_with_two_workers()
    os.killpg(process.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole process group
    _, stderr = process.communicate(timeout=120)
    assert process.returncode != 0
    assert stderr.count("KeyboardInterrupt") == 1, stderr
    assert not wait_until_gone(workers)
