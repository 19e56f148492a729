"""A resumed run whose optimiser settings differ from its checkpoint's (``--model.init_args.optimizer.<field>``
named on the command line with ``--ckpt_path``): the new settings train from the resumed step.

Lightning restores the checkpoint's AdamW and scheduler state over the optimiser the config built: each parameter
group's ``lr``, ``initial_lr``, ``weight_decay``, ``betas`` and ``eps``, and the schedule's base rates. Once restored,
:func:`apply_optimizer_config` puts the config's settings back. Each group's base rate is the new ``learning_rate``
times the group's multiplier (BEiT-3's layer decay, the head multiplier), and its rate at the resumed step is that
base rate times the warm-up cosine multiplier of the step under the config's ``warmup_steps``, ``total_steps`` and
``min_lr_ratio``: the schedule goes on from the step it reached, towards the new rates. AdamW's moments are kept.

AdamW's state is stored per group position, so settings that put parameters into other groups (layer decay turned on
or off, weight decay to or from 0, a head multiplier that meets a layer's) cannot change on a resume:
:func:`resume_changes` refuses them before the restore.

The schedule's length (``model.init_args.optimizer.total_steps``, else ``trainer.max_steps``) is kept in the
checkpoint (:data:`SCHEDULE_STEPS_KEY`). A resume whose length differs (a run extended by a larger ``max_steps``)
trains from the resumed step on the new schedule, its rate at that step included (the restored rate is the old
schedule's: 0 at its end), and says so in one line (:func:`report_schedule_change`).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only
from torch import nn

from mmoe.runtime.optimizer import OPTIMIZER_FIELDS, OptimizerConfig, nest_optimizer_arguments, parameter_groups

#: The checkpoint key holding the length of the schedule the run trained with.
SCHEDULE_STEPS_KEY = "mmoe_schedule_steps"

#: The settings that decide which parameters share an AdamW group (:func:`mmoe.runtime.optimizer.parameter_groups`).
GROUPING = ("weight_decay", "layer_decay", "head_lr_multiplier")


def saved_settings(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The optimiser settings a checkpoint's AdamW state was trained with (its ``optimizer`` hyper-parameters, flat
    ones of older checkpoints included); empty when it holds no optimiser state."""
    if not checkpoint.get("optimizer_states"):
        return {}
    saved = nest_optimizer_arguments(dict(checkpoint.get("hyper_parameters") or {})).get("optimizer")
    return dict(saved) if isinstance(saved, dict) else {}


def changed_settings(saved: dict[str, Any], config: OptimizerConfig) -> dict[str, tuple[Any, Any]]:
    """name -> (the checkpoint's value, the config's) of each saved optimiser setting the config changes.

    Raises:
        ValueError: the saved settings are no valid :class:`OptimizerConfig` values.
    """
    known = {name: value for name, value in saved.items() if name in OPTIMIZER_FIELDS}
    try:
        before = dataclasses.replace(config, **known).to_dict()
    except (TypeError, ValueError):
        raise ValueError("the checkpoint's optimizer hyper-parameters are not valid optimizer settings") from None
    given = config.to_dict()
    return {name: (before[name], given[name]) for name in known if before[name] != given[name]}


def show_changes(changes: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{name} {json.dumps(old)} -> {json.dumps(new)}" for name, (old, new) in changes.items())


def group_members(task: nn.Module, config: OptimizerConfig, head_prefixes: tuple[str, ...]) -> list[list[int]]:
    """The parameters (by ``id``) of each AdamW group ``config`` makes of the task, in the optimiser's order."""
    return [[id(parameter) for parameter in group["params"]] for group in parameter_groups(task, config, head_prefixes)]


def resume_changes(task: nn.Module, checkpoint: dict[str, Any], ckpt_path: str | None) -> dict[str, tuple[Any, Any]]:
    """The optimiser settings of the task's config (``task.optimizer_config``; groups by ``task.head_prefixes``) that
    differ from those the checkpoint's AdamW state was trained with, to apply once Lightning restored that state
    (:func:`apply_optimizer_config`).

    Raises:
        ValueError: the changes put parameters into other AdamW groups than the checkpoint's.
    """
    config, head_prefixes = task.optimizer_config, task.head_prefixes
    try:
        changes = changed_settings(saved_settings(checkpoint), config)
    except ValueError as error:
        raise ValueError(f"--ckpt_path {ckpt_path}: {error}") from None
    regrouping = {name: change for name, change in changes.items() if name in GROUPING}
    if regrouping:
        saved = dataclasses.replace(config, **{name: old for name, (old, _) in regrouping.items()})
        if group_members(task, saved, head_prefixes) != group_members(task, config, head_prefixes):
            raise ValueError(
                f"--ckpt_path {ckpt_path}: model.init_args.optimizer {show_changes(regrouping)} puts parameters "
                "into other AdamW groups than the checkpoint's, whose state is stored per group, so a resume cannot "
                "change it (layer decay on or off, weight decay to or from 0): resume with the checkpoint's values"
            )
    return changes


def apply_optimizer_config(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    groups: list[dict[str, Any]],
    config: OptimizerConfig,
) -> None:
    """Puts ``config``'s settings into a restored AdamW and its warm-up cosine schedule, AdamW's moments and the
    schedule's step kept: each group's base rate becomes ``config.learning_rate`` times its ``lr_scale`` and its rate
    the base rate times the schedule's multiplier at the step reached; weight decay, betas and eps follow ``config``.

    Args:
        optimizer: the AdamW of :func:`mmoe.runtime.optimizer.adamw_with_schedule`, its state restored.
        scheduler: its schedule, state restored (the multiplier is the config's: a checkpoint stores none).
        groups: :func:`mmoe.runtime.optimizer.parameter_groups` of ``config``, in the optimiser's order.
        config: the settings to train with.
    """
    base_rates = [config.learning_rate * group["lr_scale"] for group in groups]  # as adamw_with_schedule sets them
    rates = [
        base * multiplier(scheduler.last_epoch)
        for base, multiplier in zip(base_rates, scheduler.lr_lambdas, strict=True)
    ]
    for group, fresh, base, rate in zip(optimizer.param_groups, groups, base_rates, rates, strict=True):
        group.update(initial_lr=base, lr=rate, weight_decay=fresh["weight_decay"], betas=config.betas, eps=config.eps)
    scheduler.load_state_dict(scheduler.state_dict() | {"base_lrs": base_rates, "_last_lr": rates})


def report_changes(changes: dict[str, tuple[Any, Any]], step: int) -> None:
    """One stderr line (rank 0) naming the optimiser settings a resume changed and the step they apply from."""
    if rank_zero_only.rank == 0:
        print(
            f"mmoe fit: resumed with optimizer settings other than the checkpoint's, from global step {step} on: "
            f"{show_changes(changes)} (the schedule goes on from that step; AdamW's moments are kept)",
            file=sys.stderr,
        )


def report_schedule_change(saved: int, steps: int, step: int, old_rate: float, new_rate: float) -> None:
    """One stderr line (rank 0): the resumed schedule is ``steps`` long where the checkpoint's was ``saved``, and the
    first group's rate at the resumed ``step`` is ``new_rate`` where the checkpoint's schedule gave ``old_rate``."""
    if rank_zero_only.rank == 0:
        print(
            f"mmoe fit: resumed with a learning-rate schedule of {steps} steps where the checkpoint's had {saved} "
            "(trainer.max_steps, or model.init_args.optimizer.total_steps, changed): the warm-up cosine is "
            f"re-stretched to {steps} steps and goes on from global step {step} at lr {new_rate:.3g} (the "
            f"checkpoint's schedule gave {old_rate:.3g}); set model.init_args.optimizer.total_steps {saved} to keep it",
            file=sys.stderr,
        )
