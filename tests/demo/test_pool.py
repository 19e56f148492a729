"""The pipeline kit's pool of processes (:mod:`mmoe.pipeline.pool`): the order it hands jobs out in, that a job waits
for the jobs it names, that each process is set up as the ``mmoe`` command is, and that a failed job, or a process
that dies, is named after the running jobs ended."""

from __future__ import annotations

import functools
import json
import os

import pytest

from mmoe.pipeline.pool import Job, WorkerPool, chain_costs, check_jobs
from mmoe.pipeline.stages import PipelineError
from tests.demo import pool_marks


def test_chain_costs_add_the_costliest_chain_of_jobs_that_wait():
    jobs = [Job("fit", 300), Job("fit/eval", 1, ("fit",)), Job("figures", 1, ("fit",)), Job("long", 500)]
    jobs += [Job("short", 100), Job("short/eval", 1, ("short",)), Job("after-eval", 7, ("short/eval", "elsewhere"))]
    assert chain_costs(jobs) == {
        "fit": 301,
        "fit/eval": 1,
        "figures": 1,
        "long": 500,
        "short": 108,
        "short/eval": 8,
        "after-eval": 7,
    }


def test_jobs_of_one_name_or_waiting_on_each_other_are_refused():
    with pytest.raises(ValueError, match=r"jobs of one name: \['a'\]"):
        check_jobs([Job("a", 1), Job("b", 1), Job("a", 2)])
    with pytest.raises(ValueError, match=r"jobs that wait on each other: \['b', 'c'\]"):
        check_jobs([Job("a", 1), Job("b", 1, ("c",)), Job("c", 1, ("b", "a"))])
    check_jobs([Job("a", 1, ("done-before",)), Job("b", 1, ("a",))])
    with WorkerPool(1, preload=()) as pool, pytest.raises(ValueError, match="wait on each other"):
        pool.run([Job("a", 1, ("a",))], print)


def test_jobs_run_in_processes_set_up_as_the_command_after_the_jobs_they_wait_for(tmp_path, capfd):
    marks = tmp_path / "marks"
    marks.mkdir()
    job = functools.partial(pool_marks.mark_job, marks)
    jobs = [Job("a", 1), Job("slow", 5), Job("after-slow", 1, ("slow",)), Job("after-a", 2, ("a",))]
    with WorkerPool(2, preload=()) as pool:
        pool.run(jobs, job)
        seen = {path.name: json.loads(path.read_text()) for path in marks.iterdir()}
        assert set(seen) == {"a", "slow", "after-slow", "after-a"}
        # a job starts once those it waits for are done
        assert "slow" in seen["after-slow"]["written_before"] and "a" in seen["after-a"]["written_before"]
        assert seen["after-slow"]["started"] >= seen["slow"]["ended"]
        # two processes ran them, neither of them this one, each with the threads of its share of the cores
        pids = {mark["pid"] for mark in seen.values()}
        assert len(pids) == 2 and os.getpid() not in pids
        share = max(1, (os.cpu_count() or 1) // 2)
        assert all(mark["threads"] == mark["omp"] == share for mark in seen.values()), seen
        # ... freed host memory kept for reuse (mmoe.host_memory): a 38 MB tensor allocated again is not faulted in
        # anew, 9,263 pages each time with glibc's defaults
        assert all(mark["faults"] < 5 * 9263 // 2 for mark in seen.values()), seen
        # ... its objects frozen at exit (mmoe.process_exit), its DataLoader workers forked from a fork server
        assert all(mark["freezes_at_exit"] for mark in seen.values()), seen
        assert all(mark["start_method"] == "forkserver" for mark in seen.values()), seen

        # a job that fails: its message printed, no job after it starts, and the pool's processes live on
        with pytest.raises(PipelineError, match=r"stage b failed; the messages above name the stage"):
            pool.run([Job("b", 2), Job("c", 1, ("b",))], job)
        assert "mmoe: error: job b failed" in capfd.readouterr().err
        assert not (marks / "c").exists()
        pool.run([Job("c", 1)], job)
        assert json.loads((marks / "c").read_text())["pid"] in pids

        # a process that dies mid-job is named with its exit status, after the job beside it ended
        with pytest.raises(PipelineError, match=r"stage dies \(exit status 3\) failed"):
            pool.run([Job("dies", 2), Job("slow-too", 1)], job)
        assert (marks / "slow-too").exists()
    with pytest.raises(RuntimeError, match="outside its 'with' block"):
        pool.run([Job("a", 1)], job)
