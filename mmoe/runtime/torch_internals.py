"""The private parts of torch that mmoe's training relies on, each behind a public name here.

torch promises nothing about its ``_``-prefixed names. mmoe's tasks reach them only here, and
``tests/tasks/test_lightning_internals.py`` checks each against the installed torch, naming the API and the version
when an upgrade changes one.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel


def tensor_version(tensor: torch.Tensor) -> int:
    """The count of in-place changes to ``tensor``'s data (``Tensor._version``, autograd's version counter): it moves
    on with every in-place tensor operation (``mul_``, ``div_``, ``copy_``, a gradient accumulated into), but not with
    a ``torch.distributed`` collective writing into it."""
    return tensor._version


def keep_ddp_off(module: torch.nn.Module, names: list[str]) -> None:
    """Makes a ``DistributedDataParallel`` wrapped around ``module`` later neither broadcast nor all-reduce the
    parameters and buffers ``names`` (as ``module.named_parameters`` names them)."""
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)
