"""The private parts of torch that mmoe's training relies on, each behind a public name here.

torch promises nothing about its ``_``-prefixed names. mmoe's tasks reach them only here, and
``tests/tasks/test_lightning_internals.py`` checks each against the installed torch, naming the API and the version
when an upgrade changes one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn.parallel import DistributedDataParallel


def vector_norms(tensors: list[torch.Tensor], order: float = 2.0) -> Sequence[torch.Tensor]:
    """The ``order``-norm of each of ``tensors``, one fused kernel per device and dtype (``torch._foreach_norm``)."""
    return torch._foreach_norm(tensors, order)


def keep_ddp_off(module: torch.nn.Module, names: list[str]) -> None:
    """Makes a ``DistributedDataParallel`` wrapped around ``module`` later neither broadcast nor all-reduce the
    parameters and buffers ``names`` (as ``module.named_parameters`` names them)."""
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)
