"""Independent jobs run in worker processes: the synthetic corpus's splits, generated and converted two or more at once.

The workers leave Ctrl-C to the main process (which then ends them: a Ctrl-C stops the whole run at once, with one
traceback, not one per worker) and end when the main process is gone, even when it was killed outright, instead of
waiting for jobs that will never come.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from mmoe.data.workers import STOP_SIGNALS

T = TypeVar("T")

#: How often a worker looks whether its main process is still there, in seconds.
PARENT_CHECK_SECONDS = 0.5


def run_in_processes(jobs: Sequence[Callable[[], T]], workers: int) -> list[T]:
    """Each job's result, in the order of ``jobs``: in this process, one after the other, when ``workers`` <= 1 (or
    there is one job), else in ``min(workers, len(jobs))`` worker processes, each taking the next job as it frees up.

    A job must pickle (a module-level function, or a ``functools.partial`` of one), and so must its result. The
    exception of the first job to fail is raised here as soon as it fails, and the workers are ended, jobs still
    running included.
    """
    if workers <= 1 or len(jobs) <= 1:
        return [job() for job in jobs]
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # a worker starts with them blocked
    try:
        pool = multiprocessing.get_context().Pool(
            min(workers, len(jobs)), initializer=_worker_started, initargs=(os.getpid(),)
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    results: list = [None] * len(jobs)
    with pool:  # leaving it ends the workers, on success, on a job's error and on Ctrl-C alike
        for index, result in pool.imap_unordered(_run, enumerate(jobs)):  # an error comes as soon as it happens
            results[index] = result
    return results


def _run(indexed_job: tuple[int, Callable[[], T]]) -> tuple[int, T]:
    index, job = indexed_job
    return index, job()


def _worker_started(parent: int) -> None:
    if "torch" in sys.modules:  # one thread per worker, as in a DataLoader's: the workers already fill the cores
        sys.modules["torch"].set_num_threads(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    threading.Thread(target=_end_without_parent, args=(parent,), daemon=True).start()


def _end_without_parent(parent: int) -> None:
    """Ends this worker once ``parent`` is no longer its parent (it died, and the worker was handed to another)."""
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_SECONDS)
    os._exit(1)
