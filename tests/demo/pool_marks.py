"""A job for :class:`mmoe.pipeline.pool.WorkerPool` in tests: a module of its own, light to import, since each
spawned process imports it to unpickle the job."""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
import time
from pathlib import Path

import torch

from mmoe.pipeline.stages import PipelineError
from mmoe.process_exit import freezes_at_exit


def mark_job(folder: Path, name: str) -> None:
    """A job: fails for ``b``, exits the process for ``dies``, else writes its process id, torch thread count, the
    minor page faults of allocating a 38 MB tensor five times over, whether the process freezes its objects at exit,
    how it starts processes (its DataLoader workers), which jobs' files were written before it started and when it
    started and ended to ``folder/<name>``; ``slow`` takes a second."""
    if name == "b":
        raise PipelineError(f"job {name} failed")
    if name == "dies":
        os._exit(3)
    started, before_it = time.monotonic(), sorted(path.name for path in folder.iterdir())
    if name == "slow":
        time.sleep(1.0)
    for _ in range(2):  # warm-up
        torch.zeros(49410, 192)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        torch.zeros(49410, 192)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    state = {
        "pid": os.getpid(),
        "threads": torch.get_num_threads(),
        "omp": int(os.environ["OMP_NUM_THREADS"]),
        "faults": faults,
        "freezes_at_exit": freezes_at_exit(),
        "start_method": multiprocessing.get_start_method(),
        "written_before": before_it,
        "started": started,
        "ended": time.monotonic(),
    }
    (folder / name).write_text(json.dumps(state))
