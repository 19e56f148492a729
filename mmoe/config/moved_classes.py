"""Class paths that configs written before the run machinery left :mod:`mmoe.tasks` still name.

The callbacks, logger and checkpoint writer of a run lived in ``mmoe.tasks`` beside the LightningModules
(``mmoe.tasks.routing_callback.RoutingStatsCallback``, ``mmoe.tasks.snapshots.BackboneSnapshots``, ...) and now live
in :mod:`mmoe.runtime`. A config file of that time (a run folder's ``config.yaml``, a user's own) names the old module;
:func:`current_class_paths` reads it as the module the class is in now, so that such a file runs unchanged. Only the
modules below are renamed, and only at the start of a string, so no other value of a config changes.
"""

from __future__ import annotations

from typing import Any

#: Module of a class that a config may name, as configs wrote it then -> where the class is now.
MOVED_MODULES = {
    f"mmoe.tasks.{name}": f"mmoe.runtime.{name}"
    for name in (
        "checkpoint_saving",
        "non_finite",
        "preemption",
        "routing_callback",
        "run_logs",
        "snapshots",
        "throughput",
    )
}


def current_class_path(path: str) -> str:
    """``path`` with a moved module replaced by its module now (any other string unchanged)."""
    module, dot, name = path.rpartition(".")
    return f"{MOVED_MODULES[module]}{dot}{name}" if dot and module in MOVED_MODULES else path


def current_class_paths(value: Any) -> Any:
    """A config's parsed ``value`` with every string that names a class of a moved module renamed
    (:func:`current_class_path`), through nested mappings and lists; everything else as it was."""
    if isinstance(value, str):
        return current_class_path(value)
    if isinstance(value, dict):
        return {key: current_class_paths(item) for key, item in value.items()}
    if isinstance(value, list):
        return [current_class_paths(item) for item in value]
    return value
