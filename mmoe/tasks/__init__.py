"""LightningModules for pre-training and fine-tuning, and the task catalog.

``mmoe.tasks.from_pretrained(folder)`` rebuilds the fine-tuned task model of a folder written by ``mmoe export``
(:mod:`mmoe.tasks.pretrained`).
"""

from typing import Any


def __getattr__(name: str) -> Any:
    # Imported when asked for: importing one task module need not import every task of the catalog.
    if name == "from_pretrained":
        from mmoe.tasks.pretrained import from_pretrained

        return from_pretrained
    raise AttributeError(f"module 'mmoe.tasks' has no attribute {name!r}")
