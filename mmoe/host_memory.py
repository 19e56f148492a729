"""Freed host memory kept for reuse: glibc's allocator told not to hand large blocks back to the kernel.

glibc serves an allocation above its mmap threshold (at most 32 MB, moving with what is freed) with a fresh ``mmap``
and unmaps it when freed, and it hands the free top of its heap back to the kernel beyond the trim threshold. A CPU
training step allocates and frees the same large tensors every step (a gradient of the text embedding, 49,410 x 192
at the demo's size, is 38 MB; activations of several MB), so every step touched its buffers' pages anew: the kernel
zeroes each page on its first touch, a minor page fault for every 4 kB. :func:`keep_freed_memory` raises both
thresholds (``mallopt(M_MMAP_THRESHOLD)``, ``mallopt(M_TRIM_THRESHOLD)``), so those blocks come from the heap and stay
in it for the next step. The ``mmoe`` command calls it before it runs a subcommand, and so does each process of
:class:`mmoe.pipeline.pool.WorkerPool`.

Measured by ``benchmarks/host_memory.py`` (``docs/benchmarks.md``): training steps of the demo's captioning task with
and without it. The weights are the same bit for bit (the allocator decides only where tensors live); the price is
that up to :data:`TRIM_THRESHOLD` of freed memory stays with the process.

It does nothing where the allocator is not glibc's, where a ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``
environment variable or a ``glibc.malloc`` tunable already sets them, or with ``MMOE_KEEP_FREED_MEMORY=0``.
"""

from __future__ import annotations

import ctypes
import os

#: Allocations up to this size come from the heap (glibc's default moves between 128 kB and 32 MB).
MMAP_THRESHOLD = 512 * 2**20
#: Free memory at the top of the heap kept up to this size (glibc's default: 128 kB, moving with the mmap threshold).
TRIM_THRESHOLD = 1024 * 2**20

#: glibc's ``mallopt`` parameters (``malloc.h``).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

#: Where a user sets the allocator's thresholds themselves (then mmoe leaves them).
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (AttributeError, ValueError, OSError):  # not a POSIX system, or not glibc's confstr name
        return False


def keep_freed_memory(environment: dict[str, str] | None = None) -> bool:
    """Raises glibc's mmap and trim thresholds for this process (module docstring); whether it did."""
    environment = os.environ if environment is None else environment
    if environment.get("MMOE_KEEP_FREED_MEMORY", "1") == "0" or any(name in environment for name in USER_SETTINGS):
        return False
    if "glibc.malloc" in environment.get("GLIBC_TUNABLES", "") or not glibc():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # Setting either stops glibc moving the mmap threshold, so both are set: a raised trim threshold alone would
    # leave every allocation above 128 kB to mmap.
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
