"""Runs a test body on several CPU processes joined in one gloo process group (the multi-process tests of expert
parallelism, FSDP, the retrieval gather and the global balance loss)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp


def _in_group(rank: int, init_file: str, world: int, body: Callable, args: tuple) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        body(rank, *args)
    finally:
        dist.destroy_process_group()
    # A passed body leaves without the interpreter's finalization: a device mesh (FSDP2, DTensor) keeps its gloo group
    # and worker threads alive past destroy_process_group, and C++ static destructors meeting those threads at exit
    # can abort the process ("terminate called without an active exception", SIGABRT) after every assertion passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_gloo(body: Callable, world: int, tmp_path: Path, *args) -> None:
    """``body(rank, *args)`` on ``world`` spawned processes of one gloo group (``body`` must be a module-level
    function: it is pickled into each process); a failure in any process fails the caller."""
    mp.spawn(_in_group, args=(str(tmp_path / "gloo_init"), world, body, args), nprocs=world, join=True)
