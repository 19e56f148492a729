"""A lane for :func:`mmoe.pipeline.stages.run_parallel` in tests: a module of its own, light to import, since each
spawned lane process imports it to unpickle the lane."""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
from pathlib import Path

import torch

from mmoe.pipeline.stages import PipelineError
from mmoe.process_exit import freezes_at_exit


def mark_lane(folder: Path, lane: tuple[str, ...]) -> None:
    """A lane for :func:`run_parallel`: fails for a lane holding ``b``, else writes its process id, torch thread
    count, the minor page faults of allocating a 38 MB tensor five times over, whether the process freezes its
    objects at exit and how it starts processes (its DataLoader workers) to ``folder/<lane>``."""
    if "b" in lane:
        raise PipelineError(f"lane {' '.join(lane)} failed")
    for _ in range(2):  # warm-up
        torch.zeros(49410, 192)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        torch.zeros(49410, 192)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    state = {"pid": os.getpid(), "threads": torch.get_num_threads(), "omp": int(os.environ["OMP_NUM_THREADS"]),
             "faults": faults, "freezes_at_exit": freezes_at_exit(),
             "start_method": multiprocessing.get_start_method()}  # fmt: skip
    (folder / "-".join(lane)).write_text(json.dumps(state))
