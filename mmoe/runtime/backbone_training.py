"""What a run's callbacks read from the task they train, as a protocol.

The runtime sits below the tasks (``ARCHITECTURE.md``), so :class:`mmoe.runtime.non_finite.NonFiniteGuard` and
:class:`mmoe.runtime.throughput.Throughput` know a task by what it offers, not by its class:
:class:`mmoe.tasks.base.BackboneTask` is one; a LightningModule without these members is trained all the same, with no
token counts and no losses named.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from mmoe.model import MultiwayTransformer
from mmoe.runtime.selection_bias import SelectionLoads


@runtime_checkable
class BackboneTraining(Protocol):
    """A task that trains a multiway backbone (``isinstance`` checks that each member is there)."""

    #: The backbone trained, whose tokens :class:`mmoe.runtime.throughput.Throughput` counts.
    backbone: MultiwayTransformer
    #: The losses of the last training step by logged name (``train/loss`` first among them).
    latest_train_losses: dict[str, torch.Tensor]
    #: The routers' per-step expert loads under loss-free balancing, None without it.
    selection_loads: SelectionLoads | None

    def gradient_norm(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """The total 2-norm of ``optimizer``'s gradients, measured once per step."""
        ...
