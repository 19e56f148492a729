"""A quick end to the ``mmoe`` command's processes: the objects alive at exit are frozen (:func:`gc.freeze`) before the
interpreter shuts down.

CPython's shutdown (``Py_FinalizeEx``) runs the cyclic garbage collector over every tracked object, several times,
while it clears the modules. With torch, Lightning and what they import loaded, that is some 455,000 objects and about
1 CPU-second per process, spent freeing memory the kernel takes back at exit anyway. Objects frozen into the
permanent generation are skipped by those passes. Measured by ``benchmarks/process_exit.py`` (``docs/benchmarks.md``).

What still happens at exit: every ``atexit`` handler (multiprocessing ending its daemonic children, the
``weakref.finalize`` callbacks that remove temporary directories), the flush of ``sys.stdout`` and ``sys.stderr``, and
module teardown, which frees everything reference counting frees. What no longer happens: ``__del__`` of objects that
only a reference cycle keeps alive at exit. mmoe closes its files and loggers itself (Lightning's ``logger.finalize``)
and writes its results whole (:mod:`mmoe.atomic`), so nothing of a run waits on that collection.

``MMOE_FREEZE_AT_EXIT=0`` leaves the interpreter's shutdown as it is.
"""

from __future__ import annotations

import atexit
import gc
import os

_registered: list[bool] = []


def freeze_at_exit(environment: dict[str, str] | None = None) -> bool:
    """Registers :func:`gc.freeze` to run at this process's exit, once however often it is called (module docstring);
    whether it is registered."""
    environment = os.environ if environment is None else environment
    if not _registered and environment.get("MMOE_FREEZE_AT_EXIT", "1") != "0":
        atexit.register(gc.freeze)
        _registered.append(True)
    return freezes_at_exit()


def freezes_at_exit() -> bool:
    """Whether :func:`freeze_at_exit` registered the freeze in this process."""
    return bool(_registered)
