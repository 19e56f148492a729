"""DataLoader workers that leave termination signals to the main process.

``timeout``, SLURM, ``kill -- -PGID`` and Ctrl-C signal the whole process group, DataLoader workers included. A worker
killed by SIGTERM makes the main process fail with ``DataLoader worker (pid N) is killed by signal`` before it can
stop cleanly; a worker that ignores the signal keeps serving batches until the main process, which handles the
signal, shuts it down (or, if the main process dies, until the worker sees its parent gone and exits).
"""

from __future__ import annotations

import signal
from collections.abc import Callable

#: What a scheduler or a user sends to ask a job to stop (Ctrl-C, ``kill``, ``timeout``, SLURM's pre-emption warning).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


class IgnoringStopSignals:
    """A DataLoader ``worker_init_fn`` that makes the worker ignore :data:`STOP_SIGNALS`, then runs ``init`` (the
    loader's own ``worker_init_fn``, if any). A class rather than a closure so that it pickles for the ``spawn``
    start method."""

    def __init__(self, init: Callable[[int], None] | None = None) -> None:
        self.init = init

    def __call__(self, worker_id: int) -> None:
        for stop_signal in STOP_SIGNALS:
            signal.signal(stop_signal, signal.SIG_IGN)
        if self.init is not None:
            self.init(worker_id)


def ignoring_stop_signals(init: Callable[[int], None] | None) -> IgnoringStopSignals:
    """``init`` wrapped in :class:`IgnoringStopSignals`, once (a loader rebuilt from another's arguments, as Lightning
    does for ``predict``, passes the wrapped one again)."""
    return init if isinstance(init, IgnoringStopSignals) else IgnoringStopSignals(init)
