"""One optimiser step's total gradient norm, measured once: the non-finite check reads it and norm clipping reuses it.

Lightning's norm clipping (``trainer.gradient_clip_val``) calls ``torch.nn.utils.clip_grad_norm_``: a pass over every
gradient for their total 2-norm (``get_total_norm``), then a multiply of every gradient by
``min(1, max_norm / (norm + 1e-6))`` (``clip_grads_with_norm_``), a multiply by one on a step that needs no clipping.
:class:`mmoe.runtime.non_finite.NonFiniteGuard` measures the same norm just before, and syncs with the host once per
step anyway. :class:`MeasuredNorm` keeps that measurement with the identity and version of each gradient it read, so the
clipping (:meth:`mmoe.tasks.base.BackboneTask.configure_gradient_clipping`) can tell that nothing has touched the
gradients since, reuse the norm and skip the multiply by one: the same gradients, bit for bit, as Lightning's own
clipping, for one pass over the gradients instead of three on a step that is not clipped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

from mmoe.runtime.torch_internals import tensor_version

#: The norm's order: Lightning's and torch's default, and what the non-finite check needs.
ORDER = 2.0


@dataclasses.dataclass(frozen=True)
class MeasuredNorm:
    """The total 2-norm of ``grads`` (``torch.nn.utils.get_total_norm``, on their device) and what it was read from."""

    total: torch.Tensor
    #: (identity, in-place version) of each gradient read, in order.
    read: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, grads: list[torch.Tensor]) -> MeasuredNorm:
        total = torch.nn.utils.get_total_norm(grads, ORDER, error_if_nonfinite=False)
        return cls(total, fingerprint(grads))

    def is_of(self, grads: list[torch.Tensor]) -> bool:
        """Whether this is the norm of ``grads`` as they are now: the same tensors, in the same order, none changed by
        an in-place tensor operation since (a gradient scaled, accumulated into or dropped in between makes it stale;
        a collective writing into a gradient is not seen, so code that reduces gradients after the measurement
        changes them in place too, as :func:`mmoe.runtime.expert_parallel.average_expert_gradients` divides them)."""
        return fingerprint(grads) == self.read


def optimizer_gradients(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The gradients of ``optimizer``'s parameters, in its order (parameters without one left out)."""
    return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


def local_total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The total 2-norm of ``grads`` on their device, each sharded gradient by this process's own shards."""
    local = [grad.to_local() if isinstance(grad, DTensor) else grad for grad in grads]
    return torch.nn.utils.get_total_norm(local, ORDER, error_if_nonfinite=False)


def fingerprint(grads: list[torch.Tensor]) -> tuple[tuple[int, int], ...]:
    return tuple((id(grad), tensor_version(grad)) for grad in grads)


def clip_coefficient(max_norm: float, total: torch.Tensor) -> float:
    """``min(1, max_norm / (total + 1e-6))`` computed as ``clip_grads_with_norm_`` computes it (in ``total``'s dtype),
    on a host copy of ``total``."""
    return float(torch.clamp(max_norm / (total.detach().cpu() + 1e-6), max=1.0))


def clip_to_measured_norm(parameters: Iterable[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    """``torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)``, skipped when its coefficient is exactly
    one (it would multiply every gradient by one)."""
    if clip_coefficient(max_norm, total) != 1.0:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
