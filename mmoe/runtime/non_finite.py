"""A diverging run stops at its first non-finite step, before the update, with the step and its losses named.

Every ``mmoe fit`` gets a :class:`NonFiniteGuard` (``--non_finite.*`` options; :class:`mmoe.config.cli.MMoECLI` adds
it). After the backward pass and before the optimiser step it checks the step's loss (``torch.isfinite``, kept on the
device) and the gradients' total 2-norm (``torch.nn.utils.get_total_norm``: NaN or infinite when an entry is, or when
the squares overflow, which only a diverging step's gradients do; the norm Lightning's norm clipping then reuses, see
:mod:`mmoe.runtime.gradient_norm`), with one host sync per step; with several processes the verdict is any process's. A
non-finite step:

* ``action: stop`` (the default): the weights are not updated, :class:`NonFiniteTraining` ends the run, and the
  command prints one line naming the step and the losses the task logged (``train/loss``, ``train/task_loss``,
  ``train/balance_loss``, ``train/z_loss``, ...) and exits with :data:`DIVERGED_EXIT`. No checkpoint is written at
  that step: the last one saved holds finite weights.
* ``action: skip``: the gradients are dropped (set to None, so AdamW updates nothing, its moments and step count
  included), the step is counted (``train/skipped_nonfinite_steps``, printed at the end of training) and training
  goes on; the learning-rate schedule still advances (and X-MoE's expert-embedding norm restore runs, a no-op up to
  rounding). ``max_consecutive_skips`` non-finite steps in a row stop the run as ``stop`` does. The counts are saved
  in checkpoints, so a resumed run goes on counting.

Under fp16 mixed precision the gradient scaler already skips steps with overflowing gradients (and lowers its
scale): there only the loss is checked.

With loss-free balancing (``MoEPlan.bias_update_rate``) the routers' selection biases are checked too, after each
optimiser step has moved them (:meth:`mmoe.runtime.selection_bias.SelectionLoads.non_finite`) and before that step's
checkpoint is saved: a NaN or infinite bias stops the run (whatever the ``action``: the biases are already moved)
with one line naming the MoE layers, and :data:`DIVERGED_EXIT`. The loss stays finite while the biases overflow.
"""

from __future__ import annotations

import sys
from typing import Any, Literal

import lightning as L
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.plugins.precision import MixedPrecision

from mmoe.io import report_error
from mmoe.runtime.backbone_training import BackboneTraining
from mmoe.runtime.gradient_norm import local_total_norm, optimizer_gradients

#: Exit code of a run stopped by a non-finite loss or gradient: not 1 (a crash), 2 (bad input) or a signal's 128 + n,
#: so a script can tell a diverged run (resume from the last checkpoint with other settings) from the others.
DIVERGED_EXIT = 3

#: What a stopped run did, as its error line says.
STOPPED = (
    "training stopped before the update, and no checkpoint is written at this step (the last one saved, if any, holds "
    "finite weights)"
)

#: The skipped steps named at the end of training (the first ones; the count is always whole).
NAMED_STEPS = 10


class NonFiniteTraining(ArithmeticError):
    """A training step whose loss or gradients are not finite; its message names the step and the losses."""


def gradient_norm(optimizer: torch.optim.Optimizer, module: L.LightningModule) -> torch.Tensor:
    """The total 2-norm of ``optimizer``'s gradients on their device (no sync); each process's own shards of sharded
    gradients. The 2-norm: on CPU much faster than the largest entry (order infinity) and as telling."""
    if isinstance(module, BackboneTraining):
        return module.gradient_norm(optimizer)  # measured once for the clipping too
    return local_total_norm(optimizer_gradients(optimizer))


def describe_losses(losses: dict[str, torch.Tensor]) -> str:
    """``train/loss nan, train/task_loss nan, train/balance_loss 0.0123`` (4 significant digits; the total first)."""
    names = sorted(losses, key=lambda name: not name.endswith("/loss"))
    return ", ".join(f"{name} {float(losses[name]):.4g}" for name in names)


def report_divergence(command: str, error: NonFiniteTraining) -> int:
    """Prints ``mmoe <command>: error: <what happened>`` on stderr (one line, first process only) and returns
    :data:`DIVERGED_EXIT`."""
    if rank_zero_only.rank == 0:
        report_error(command, error)
    return DIVERGED_EXIT


class NonFiniteGuard(L.Callback):
    """Stops training at the first step with a non-finite loss or gradient, or skips such steps (module docstring).

    Args:
        action: ``stop`` ends the run at a non-finite step (exit code 3, nothing saved at that step); ``skip`` drops
            the step's update, counts it and goes on.
        max_consecutive_skips: with ``skip``, this many non-finite steps in a row stop the run.
    """

    def __init__(self, action: Literal["stop", "skip"] = "stop", max_consecutive_skips: int = 10) -> None:
        if action not in ("stop", "skip"):
            raise ValueError(f"non_finite.action must be 'stop' or 'skip', got {action!r}")
        if max_consecutive_skips < 1:
            raise ValueError(f"non_finite.max_consecutive_skips must be >= 1, got {max_consecutive_skips!r}")
        self.action = action
        self.max_consecutive_skips = max_consecutive_skips
        #: Steps skipped so far (this run and the runs it resumes), and the first :data:`NAMED_STEPS` of them.
        self.skipped = 0
        self.first_skipped: list[int] = []
        self.consecutive_skips = 0
        #: Whether every loss since the last optimiser step was finite (a device tensor; None before the first).
        self._losses_finite: torch.Tensor | None = None
        #: The ``global_step`` whose selection biases were last checked (once per optimiser step).
        self._biases_checked_at: int | None = None

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        finite = torch.isfinite(loss.detach()).all()
        self._losses_finite = finite if self._losses_finite is None else self._losses_finite & finite

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        losses_finite = torch.tensor(True) if self._losses_finite is None else self._losses_finite
        self._losses_finite = None
        scaler = trainer.precision_plugin.scaler if isinstance(trainer.precision_plugin, MixedPrecision) else None
        # The scaler skips steps with overflowing fp16 gradients itself.
        norm = torch.tensor(0.0) if scaler is not None else gradient_norm(optimizer, pl_module)
        finite = torch.stack([losses_finite.to(norm.device), torch.isfinite(norm)])
        loss_finite, grads_finite = finite.tolist()  # one sync
        if not trainer.strategy.reduce_boolean_decision(not (loss_finite and grads_finite), all=False):
            self.consecutive_skips = 0
            return
        step = trainer.global_step
        what = "loss" if not loss_finite else "gradients" if not grads_finite else "loss or gradients (another process)"
        losses = describe_losses(pl_module.latest_train_losses) if isinstance(pl_module, BackboneTraining) else ""
        found = f"non-finite {what} at step {step}" + (f" ({losses})" if losses else "")
        if self.action == "stop":
            raise NonFiniteTraining(
                f"{found}: {STOPPED}; lower the learning rate, or pass --non_finite.action skip to skip such steps"
            )
        self.consecutive_skips += 1
        if self.consecutive_skips >= self.max_consecutive_skips:
            raise NonFiniteTraining(
                f"{found}: {self.consecutive_skips} non-finite steps in a row "
                f"(--non_finite.max_consecutive_skips {self.max_consecutive_skips}): {STOPPED}"
            )
        optimizer.zero_grad(set_to_none=True)
        self.skipped += 1
        if len(self.first_skipped) < NAMED_STEPS:
            self.first_skipped.append(step)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics({"train/skipped_nonfinite_steps": float(self.skipped)}, step=step)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Stops the run when an optimiser step left a router's selection bias non-finite; runs before the
        checkpoint callbacks (Lightning calls them last), so that step is never saved."""
        loads = pl_module.selection_loads if isinstance(pl_module, BackboneTraining) else None
        if loads is None or trainer.global_step == self._biases_checked_at:
            return  # no biases, or no optimiser step since the last check (gradient accumulation)
        self._biases_checked_at = trainer.global_step
        broken = loads.non_finite()
        if broken:
            layers = ", ".join(f"MoE layer {index} ({modality})" for index, modality in broken)
            raise NonFiniteTraining(
                f"non-finite router selection biases after step {trainer.global_step - 1} in {layers} (loss-free "
                "balancing): training stopped, and no checkpoint is written at this step (the last one saved, if any, "
                "holds finite biases); lower model.backbone.moe.bias_update_rate"
            )

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.action != "skip" or not trainer.is_global_zero:
            return
        named = ", ".join(map(str, self.first_skipped)) + (", ..." if self.skipped > len(self.first_skipped) else "")
        steps = f" (step{'s' if self.skipped > 1 else ''} {named})" if self.skipped else ""
        print(
            f"mmoe fit: {self.skipped} training steps skipped for a non-finite loss or gradients{steps}",
            file=sys.stderr,
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "skipped": self.skipped,
            "first_skipped": list(self.first_skipped),
            "consecutive_skips": self.consecutive_skips,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped = int(state_dict["skipped"])
        self.first_skipped = list(state_dict["first_skipped"])
        self.consecutive_skips = int(state_dict["consecutive_skips"])
