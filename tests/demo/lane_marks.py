"""A lane for :func:`mmoe.pipeline.stages.run_parallel` in tests: a module of its own, light to import, since each
spawned lane process imports it to unpickle the lane."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from mmoe.pipeline.stages import PipelineError


def mark_lane(folder: Path, lane: tuple[str, ...]) -> None:
    """A lane for :func:`run_parallel`: fails for a lane holding ``b``, else writes its process id and torch thread
    count to ``folder/<lane>``."""
    if "b" in lane:
        raise PipelineError(f"lane {' '.join(lane)} failed")
    state = {"pid": os.getpid(), "threads": torch.get_num_threads(), "omp": int(os.environ["OMP_NUM_THREADS"])}
    (folder / "-".join(lane)).write_text(json.dumps(state))
