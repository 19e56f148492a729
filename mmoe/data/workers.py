"""DataLoader workers that leave termination signals to the main process.

``timeout``, SLURM, ``kill -- -PGID`` and Ctrl-C signal the whole process group, DataLoader workers included. A worker
killed by SIGTERM makes the main process fail with ``DataLoader worker (pid N) is killed by signal`` before it can
stop cleanly; a worker that ignores the signal keeps serving batches until the main process, which handles the
signal, shuts it down (or, if the main process dies, until the worker sees its parent gone and exits).

A SIGTERM from the worker's own parent is obeyed: that is how the parent ends a worker that did not stop when asked
(torch's loader shutdown, ``multiprocessing``'s exit handler); a worker ignoring it would leave the parent waiting
for it forever.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

#: What a scheduler or a user sends to ask a job to stop (Ctrl-C, ``kill``, ``timeout``, SLURM's pre-emption warning).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


class IgnoringStopSignals:
    """A DataLoader ``worker_init_fn`` that makes the worker ignore :data:`STOP_SIGNALS` but a SIGTERM its parent
    sends, then runs ``init`` (the loader's own ``worker_init_fn``, if any). A class rather than a closure so that it
    pickles for the ``spawn`` start method."""

    def __init__(self, init: Callable[[int], None] | None = None) -> None:
        self.init = init

    def __call__(self, worker_id: int) -> None:
        for stop_signal in STOP_SIGNALS:
            if stop_signal != signal.SIGTERM:
                signal.signal(stop_signal, signal.SIG_IGN)
        # SIGTERM stays blocked and is taken by a thread that can see who sent it (a handler cannot).
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        threading.Thread(target=end_on_parents_sigterm, args=(os.getppid(),), daemon=True).start()
        if self.init is not None:
            self.init(worker_id)


def end_on_parents_sigterm(parent: int) -> None:
    """Waits for SIGTERMs (blocked in every thread of the worker) and ends the worker on the one ``parent`` sends;
    those from anyone else (a signal to the process group) are dropped."""
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
            os._exit(128 + signal.SIGTERM)


def ignoring_stop_signals(init: Callable[[int], None] | None) -> IgnoringStopSignals:
    """``init`` wrapped in :class:`IgnoringStopSignals`, once (a loader rebuilt from another's arguments, as Lightning
    does for ``predict``, passes the wrapped one again)."""
    return init if isinstance(init, IgnoringStopSignals) else IgnoringStopSignals(init)
