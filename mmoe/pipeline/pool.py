"""Processes that run a pipeline's jobs at once: :class:`WorkerPool`, a fixed set of spawned worker processes, each
handed the next job that is ready (its jobs before it done) as it frees up, the job with the costliest chain of
jobs still to follow first.

Handing out jobs as processes free up, one stage at a time, packs them closer than fixed lanes: the demo's
fine-tunings are one long captioning beside three shorter tasks, and with fixed lanes of whole fine-tunings (fit and
evaluation) one lane ends half a minute after the other; as jobs, the evaluations of the short tasks fill the other
process once their fits are done. Which process runs a job changes nothing it computes: every stage seeds its own run,
and every process has the same torch threads, so a resumed run trains as the first did.

The processes start before they are needed (:func:`WorkerPool.__enter__`), so that importing torch and Lightning in
them overlaps the stages the main process still runs (a pre-training, whose two threads leave part of the second core
idle on a 2-core CPU)."""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from mmoe.host_memory import keep_freed_memory
from mmoe.pipeline.stages import PipelineError
from mmoe.process_exit import freeze_at_exit


@dataclass(frozen=True)
class Job:
    """One job of a pool: the name its function receives, what it costs (in any unit shared by the pool's jobs, e.g.
    optimiser steps) and the names of the jobs it waits for (a name that is not among the pool's jobs is done)."""

    name: str
    cost: float
    after: tuple[str, ...] = ()


def chain_costs(jobs: Sequence[Job]) -> dict[str, float]:
    """Each job's cost plus that of the costliest chain of jobs waiting on it (its "bottom level" in list scheduling,
    Graham 1969; Hu 1961): the order in which ready jobs are handed out."""
    waiting: dict[str, list[str]] = {job.name: [] for job in jobs}
    for job in jobs:
        for name in job.after:
            if name in waiting:
                waiting[name].append(job.name)
    costs = {job.name: job.cost for job in jobs}
    chains: dict[str, float] = {}

    def chain(name: str) -> float:
        if name not in chains:
            chains[name] = costs[name] + max((chain(later) for later in waiting[name]), default=0.0)
        return chains[name]

    return {job.name: chain(job.name) for job in jobs}


def check_jobs(jobs: Sequence[Job]) -> None:
    """ValueError for two jobs of one name or a job that waits, through others, on itself."""
    names = [job.name for job in jobs]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"jobs of one name: {repeated}")
    waits_for = {job.name: [name for name in job.after if name in names] for job in jobs}
    done: set[str] = set()
    while len(done) < len(names):
        ready = [name for name in names if name not in done and all(before in done for before in waits_for[name])]
        if not ready:
            raise ValueError(f"jobs that wait on each other: {sorted(set(names) - done)}")
        done.update(ready)


class WorkerPool:
    """``workers`` spawned Python processes, each with ``os.cpu_count() // workers`` torch threads (at least 1; the same
    count whatever is left to run), freed host memory kept for reuse and its objects frozen at exit as the ``mmoe``
    command does, and its DataLoader workers forked from a fork server (:func:`start_data_workers_from_a_server`;
    a spawned process's default is spawn, under which every DataLoader worker would import torch again). Their output
    goes to this process's. One process pays the imports of torch and Lightning once for every job it runs.

    Use as a context manager: the processes start on entering and stop on leaving; :meth:`run` hands them jobs.
    """

    def __init__(self, workers: int, preload: Sequence[str] = ("mmoe.config.cli",)) -> None:
        self.workers = max(1, workers)
        self.preload = tuple(preload)
        self._processes: list[multiprocessing.process.BaseProcess] = []
        self._connections: list[Connection] = []

    def __enter__(self) -> WorkerPool:
        context = multiprocessing.get_context("spawn")
        threads = str(max(1, (os.cpu_count() or 1) // self.workers))
        with _thread_environment(threads):  # a spawned interpreter reads them when it imports torch
            for index in range(self.workers):
                ours, theirs = context.Pipe()
                process = context.Process(
                    target=_serve,
                    args=(theirs, self.preload, multiprocessing.get_start_method()),
                    name=f"mmoe-worker-{index}",
                )
                process.start()
                theirs.close()
                self._processes.append(process)
                self._connections.append(ours)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for connection in self._connections:
            with contextlib.suppress(OSError):  # a process that died has closed its end
                connection.send(None)
            connection.close()
        for process in self._processes:
            process.join(timeout=None if exc_info[0] is None else 10)
            if process.is_alive():
                process.terminate()
                process.join()
        self._processes, self._connections = [], []

    def run(self, jobs: Sequence[Job], run_job: Callable[[str], None]) -> None:
        """Runs ``run_job(job.name)`` for each of ``jobs`` in the pool's processes, each job once the jobs it waits for
        are done, the ready job with the costliest chain (:func:`chain_costs`; ties in the order given) to the next
        free process. ``run_job`` crosses to a process pickled (a ``functools.partial`` of a module-level function,
        with the typed run it closes over); it reports failure by raising PipelineError, whose message the process
        prints. After a failure no job starts; PipelineError naming the first job that failed once the running ones
        ended."""
        if not self._processes:
            raise RuntimeError("WorkerPool.run outside its 'with' block")
        check_jobs(jobs)
        order = {job.name: index for index, job in enumerate(jobs)}
        chains = chain_costs(jobs)
        pending = {job.name: job for job in jobs}
        running: dict[int, str] = {}
        done: set[str] = set()
        failed: list[str] = []
        while running or (pending and not failed):
            if not failed:
                self._hand_out(pending, running, done, chains, order, run_job)
            if not running:
                break
            failed += self._collect(running, done)
        if failed:
            raise PipelineError(f"stage {failed[0]} failed; the messages above name the stage")

    def _hand_out(
        self,
        pending: dict[str, Job],
        running: dict[int, str],
        done: set[str],
        chains: Mapping[str, float],
        order: Mapping[str, int],
        run_job: Callable[[str], None],
    ) -> None:
        for index, connection in enumerate(self._connections):
            if index in running:
                continue
            ready = [job for job in pending.values() if all(n in done or n not in order for n in job.after)]
            if not ready:
                return
            job = min(ready, key=lambda job: (-chains[job.name], order[job.name]))
            try:
                connection.send((run_job, job.name))
            except OSError as error:  # the process ended while it had no job (a kill)
                status = self._processes[index].exitcode
                raise PipelineError(f"stage {job.name} could not start: its process ended ({status})") from error
            running[index] = pending.pop(job.name).name

    def _collect(self, running: dict[int, str], done: set[str]) -> list[str]:
        """Waits for at least one running job to end; the names (with the process's exit status where it died) of
        those that failed."""
        busy = {self._connections[index]: index for index in running}
        sentinels = {self._processes[index].sentinel: index for index in running}
        failed = []
        for ready in wait([*busy, *sentinels]):
            index = busy[ready] if ready in busy else sentinels[ready]
            if index not in running:
                continue
            name = running.pop(index)
            try:
                error = self._connections[index].recv()
            except (EOFError, OSError):  # the process died: an uncaught exception (its traceback printed) or a kill
                self._processes[index].join()
                failed.append(f"{name} (exit status {self._processes[index].exitcode})")
                continue
            if error is None:
                done.add(name)
            else:
                failed.append(name)
        return failed


@contextlib.contextmanager
def _thread_environment(threads: str) -> Iterator[None]:
    """``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` set to ``threads`` in this process's environment while processes
    start (what a spawned process inherits), restored after."""
    names = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
    before = {name: os.environ.get(name) for name in names}
    os.environ.update(dict.fromkeys(names, threads))
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _serve(connection: Connection, preload: Sequence[str], start_method: str) -> None:
    """A pool process: starts its DataLoader workers' fork server (``start_method`` where there is none) and imports
    ``preload``, then runs each job it is sent, answering None when it is done or the
    message of its PipelineError (printed as ``mmoe: error: ...``), until it is sent None; any other exception ends
    the process with its traceback."""
    import importlib

    keep_freed_memory()
    freeze_at_exit()
    start_data_workers_from_a_server(start_method)
    for module in preload:
        importlib.import_module(module)
    while (message := _receive(connection)) is not None:
        run_job, name = message
        try:
            run_job(name)
        except PipelineError as error:
            print(f"mmoe: error: {error}", file=sys.stderr, flush=True)
            connection.send(str(error))
        else:
            connection.send(None)


#: What the fork server of a pool process imports before it forks DataLoader workers: the datasets they unpickle and
#: the BPE tables they read.
DATA_WORKER_PRELOAD = ("torch", "mmoe.data.datamodules", "mmoe.data.bpe_tables")


def start_data_workers_from_a_server(fallback: str) -> None:
    """DataLoader workers of this process forked from a fork server (``forkserver``, started now with
    :data:`DATA_WORKER_PRELOAD` imported), not from this process; ``fallback`` where there is none (Windows).

    A worker forked from this process shares its pages, so every page the training writes after each worker starts
    (one a training epoch, one a prediction) is copied or faulted in again, with the other core's TLB flushed each
    time. One NLVR2 fine-tuning of the demo on one thread, alone (150 steps, three epochs): 1.46 M minor page faults,
    105.1 user-s and 8.0 system-s with forked workers, 0.51 M, 94.0 and 3.9 from a fork server. Its worker then
    unpickles the dataset instead of inheriting it; the batches, and the scores, are the same. The server starts
    here, so that its imports overlap what the pool's parent still runs."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        multiprocessing.set_start_method(fallback, force=True)
        return
    multiprocessing.set_start_method("forkserver", force=True)
    multiprocessing.set_forkserver_preload(list(DATA_WORKER_PRELOAD))
    multiprocessing.forkserver.ensure_running()


def _receive(connection: Connection) -> tuple[Callable[[str], None], str] | None:
    try:
        return connection.recv()
    except EOFError:  # the pool's process is gone
        return None
