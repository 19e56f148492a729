"""DataLoader workers that leave termination signals to the main process.

``timeout``, SLURM, ``kill -- -PGID`` and Ctrl-C signal the whole process group, DataLoader workers included. A worker
killed by SIGTERM makes the main process fail with ``DataLoader worker (pid N) is killed by signal`` before it can
stop cleanly; a worker that ignores the signal keeps serving batches until the main process, which handles the
signal, shuts it down (or, if the main process dies, until the worker sees its parent gone and exits).

A worker starts with those signals blocked (:func:`started_with_stop_signals_blocked` blocks them in the main process
while it forks the workers), so a signal to the group in the moment between a worker's start and its
``worker_init_fn`` cannot end it either; the main process gets a signal that came meanwhile once it unblocks them.

A SIGTERM from the worker's own parent is obeyed: that is how the parent ends a worker that did not stop when asked
(torch's loader shutdown, ``multiprocessing``'s exit handler); a worker ignoring it would leave the parent waiting
for it forever.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator

#: What a scheduler or a user sends to ask a job to stop (Ctrl-C, ``kill``, ``timeout``, SLURM's pre-emption warning,
#: the hang-up a shell sends its jobs when its terminal or SSH session closes).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


class IgnoringStopSignals:
    """A DataLoader ``worker_init_fn`` that makes the worker ignore :data:`STOP_SIGNALS` but a SIGTERM its parent
    sends, then runs ``init`` (the loader's own ``worker_init_fn``, if any). A class rather than a closure so that it
    pickles for the ``spawn`` start method."""

    def __init__(self, init: Callable[[int], None] | None = None) -> None:
        self.init = init

    def __call__(self, worker_id: int) -> None:
        others = {stop_signal for stop_signal in STOP_SIGNALS if stop_signal != signal.SIGTERM}
        for stop_signal in others:
            signal.signal(stop_signal, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, others)  # one that came since the fork is ignored now
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


def started_with_stop_signals_blocked(start: Callable[[], Iterator]) -> Iterator:
    """``start()`` (a DataLoader's ``__iter__``, which forks its workers) with :data:`STOP_SIGNALS` blocked in this
    thread, so each worker begins with them blocked until :class:`IgnoringStopSignals` has set it up; the mask is
    restored after, and a stop signal that arrived meanwhile is then delivered to this process's handler."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        return start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
