"""Freed host memory kept for reuse (:mod:`mmoe.host_memory`): a process that frees and allocates the same large
tensors again stops page-faulting them in anew, through the ``mmoe`` command too; a user's own allocator settings are
left alone (the decision, checked on its own). Page faults are counted by the kernel (``getrusage``), not timed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmoe.host_memory import glibc, keep_freed_memory

ROOT = Path(__file__).resolve().parents[1]

#: Allocates and frees a training step's large buffers 30 times (a 38 MB embedding gradient, 16 MB and 2 MB
#: activations), after ``setup``, and prints the minor page faults of the loop.
LOOP = """
import json, resource, sys, torch
{setup}
for _ in range(3):
    buffers = [torch.zeros(49410, 192), torch.ones(4096, 1024), torch.ones(1024, 512)]
    del buffers
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(30):
    buffers = [torch.zeros(49410, 192), torch.ones(4096, 1024), torch.ones(1024, 512)]
    del buffers
print(json.dumps({{"kept": kept, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}}))
"""

KEEP = "from mmoe.host_memory import keep_freed_memory\nkept = keep_freed_memory()"
#: The ``mmoe`` command, run in the process (a subcommand that needs no file).
COMMAND = (
    "from mmoe.cli import main\n"
    "assert main(['moe-info', '--moe.dim', '8', '--moe.ffn_dim', '16', '--moe.num_experts', '2']) == 0\n"
    "kept = None"
)


def loop_faults(setup: str, **environment: str) -> dict:
    inherited = {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_")}
    inherited.pop("MMOE_KEEP_FREED_MEMORY", None)
    env = inherited | environment | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", LOOP.format(setup=setup)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300, check=True)  # fmt: skip
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.skipif(not glibc(), reason="glibc's allocator only")
def test_large_buffers_freed_and_allocated_again_are_not_faulted_in_anew():
    default = loop_faults(KEEP, MMOE_KEEP_FREED_MEMORY="0")
    kept = loop_faults(KEEP)
    by_command = loop_faults(COMMAND, MMOE_KEEP_FREED_MEMORY="1")
    assert (default["kept"], kept["kept"]) == (False, True)
    pages = 30 * (49410 * 192 + 4096 * 1024 + 1024 * 512) * 4 // 4096
    assert default["faults"] > pages // 2  # each loop touches its buffers' pages anew
    assert kept["faults"] < pages // 10 and by_command["faults"] < pages // 10


def test_a_users_own_allocator_settings_are_left_alone():
    """Thresholds set by environment variables or glibc tunables, and an explicit opt-out, win."""
    assert not keep_freed_memory({"MMOE_KEEP_FREED_MEMORY": "0"})
    assert not keep_freed_memory({"MALLOC_MMAP_THRESHOLD_": "1048576"})
    assert not keep_freed_memory({"MALLOC_TRIM_THRESHOLD_": "0"})
    assert not keep_freed_memory({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"})
