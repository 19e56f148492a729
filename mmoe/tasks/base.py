"""The base of every mmoe training task: the balance term, AdamW with warm-up cosine, X-MoE's norm restore, exact
resume and the distributed hooks.

* Total loss = task loss + alpha * sum (or mean) of the MoE layers' balance losses (X-MoE Eq. 10), plus, when
  ``z_loss_coefficient`` is set, that coefficient times the sum (or mean) of their router z-losses (ST-MoE Eq. 5),
  plus the sum (or mean) of each further loss the layers return (``RoutingRecord.auxiliary_losses``: LIMoE's local
  and global entropy losses, already weighted by the MoE plan's ``local_entropy_weight`` / ``global_entropy_weight``),
  each logged as ``<stage>/<name>``.
* AdamW with warm-up cosine (:mod:`mmoe.runtime.optimizer`, one typed ``optimizer`` argument of every task).
* X-MoE §3.1: expert embeddings are put back to L2 norm 0.1 after every optimiser step.
* Auxiliary-loss-free balancing (Wang et al., 2024): routers with a selection bias get it updated after every
  optimiser step from the step's expert loads (:mod:`mmoe.runtime.selection_bias`), its spread logged as
  ``train/selection_bias_spread``.
* Exact resume: checkpoints hold the random generators' states (torch, CUDA, numpy, Python; every process's), put back
  before the first training step after ``--ckpt_path`` (:mod:`mmoe.runtime.state`); the data loaders save their own
  position. Optimiser settings changed on a resume train from the resumed step (:mod:`mmoe.runtime.optimizer_resume`).
* Samples the data loaders skipped (corrupt or lost) are logged as ``data/skipped/<stream>``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import lightning as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.tensor import DTensor

from mmoe.data.tokenizer import TextTokenizer
from mmoe.model import MultiwayTransformer
from mmoe.moe import RoutingRecord, restore_expert_embedding_norm
from mmoe.moe.choices.values import finite_at_least
from mmoe.runtime.checkpoint import config_to_dict
from mmoe.runtime.expert_parallel import (
    ExpertGroups,
    average_expert_gradients,
    gather_optimizer_states,
    shard_experts,
    slice_optimizer_states,
)
from mmoe.runtime.fsdp import shard_task
from mmoe.runtime.gradient_norm import MeasuredNorm, clip_to_measured_norm, local_total_norm, optimizer_gradients
from mmoe.runtime.optimizer import OptimizerConfig, adamw_with_schedule, parameter_groups, schedule_length
from mmoe.runtime.optimizer_resume import (
    SCHEDULE_STEPS_KEY,
    apply_optimizer_config,
    report_changes,
    report_schedule_change,
    resume_changes,
)
from mmoe.runtime.predictions import gather_objects
from mmoe.runtime.selection_bias import SelectionLoads
from mmoe.runtime.state import add_missing_optimizer_states, random_states, reshape_scalar_states, set_random_states

#: The values of ``balance_reduce``: add or average the MoE layers' balance losses.
BALANCE_REDUCTIONS = ("sum", "mean")


def require_loss_weight(name: str, value: object) -> None:
    """A task's loss weight ``model.<name>`` is a finite number >= 0 (an infinite or NaN one ends the first step as a
    non-finite loss that does not name it)."""
    if not finite_at_least(value, 0.0):
        raise ValueError(f"model.{name} must be a finite number >= 0, got {value!r}")


def detached(record: RoutingRecord) -> RoutingRecord:
    """A copy of the record with its balance loss, z-loss and auxiliary losses detached (what ``training_step`` hands
    to callbacks)."""
    return dataclasses.replace(
        record,
        balance_loss=record.balance_loss.detach(),
        z_loss=record.z_loss.detach(),
        auxiliary_losses={name: value.detach() for name, value in record.auxiliary_losses.items()},
    )


@dataclasses.dataclass
class StepLosses:
    """What a task's :meth:`BackboneTask.step_losses` gives for one batch.

    Attributes:
        task_loss: the task's loss (the objective before the balance term).
        logged: name -> value of the task's own metrics, logged as ``<stage>/<name>`` (detached there).
        routing: the routing records of every forward of the step.
        size: the batch size the logged values are averaged with.
        output: what the task needs back from the step (fine-tuning: the logits); None when nothing.
    """

    task_loss: torch.Tensor
    logged: dict[str, torch.Tensor]
    routing: list[RoutingRecord]
    size: int
    output: Any = None


class BackboneTask(L.LightningModule):
    """Base of the mmoe tasks: a ``backbone`` plus heads, trained with AdamW + warm-up cosine and the balance term.

    One step for every task (:meth:`shared_step`): the subclass's :meth:`step_losses` gives the task loss, its metrics
    and the routing records; the base adds alpha x the balance loss (X-MoE Eq. 10) and the layers' auxiliary losses
    (:meth:`auxiliary_losses`), logs ``<stage>/loss``, ``<stage>/balance_loss``, ``<stage>/z_loss``, each auxiliary
    loss as ``<stage>/<name>`` (``<stage>/local_entropy_loss``, ``<stage>/global_entropy_loss``),
    ``<stage>/dropped_fraction``, ``<stage>/requested_capacity`` (and ``<stage>/unrouted_fraction`` with expert-choice
    routing) with the task's metrics, and ``training_step`` hands the callbacks the routing records with detached
    losses.

    Subclasses save these hyper-parameters (``self.save_hyperparameters()``): ``backbone`` and ``optimizer`` (stored as
    plain dicts by :meth:`store_configs`), ``balance_coefficient``, ``balance_reduce`` and ``z_loss_coefficient``.

    Args:
        balance_reduce: the subclass's ``balance_reduce`` argument, checked here.
        optimizer: the subclass's ``optimizer`` argument (or the plain dict of a checkpoint's hyper-parameters).
        text_tokenizer: the subclass's ``text_tokenizer`` argument, checked here.
    """

    #: Parameter-name prefixes that get ``head_lr_multiplier`` (BEiT-3 scales parameters named ``head*``).
    head_prefixes: tuple[str, ...] = ("head.",)
    backbone: MultiwayTransformer

    def __init__(
        self,
        balance_reduce: str,
        optimizer: OptimizerConfig | dict,
        text_tokenizer: str | None = None,
        z_loss_coefficient: float = 0.0,
        balance_coefficient: float = 1e-2,
    ) -> None:
        """``z_loss_coefficient``, ``balance_coefficient``: the subclass's arguments, checked here."""
        super().__init__()
        if balance_reduce not in BALANCE_REDUCTIONS:
            raise ValueError(f"model.balance_reduce must be 'sum' or 'mean', got {balance_reduce!r}")
        require_loss_weight("z_loss_coefficient", z_loss_coefficient)
        require_loss_weight("balance_coefficient", balance_coefficient)
        self.z_loss_coefficient = z_loss_coefficient
        self.optimizer_config = OptimizerConfig.from_value(optimizer)
        #: The expert-parallel process groups once ``setup`` sharded the experts (:mod:`mmoe.runtime.expert_parallel`).
        self.expert_groups: ExpertGroups | None = None
        #: Whether ``configure_model`` made the task FSDP2 units already (it runs once per stage).
        self.fully_sharded = False
        #: This process's random states from a checkpoint, put back at the first training step after a resume.
        self.rng_states_to_restore: dict | None = None
        #: The optimiser settings a resumed fit changed (name -> (checkpoint's, config's)), put into the restored
        #: optimiser when training starts.
        self.optimizer_changes: dict[str, tuple[Any, Any]] = {}
        #: The schedule lengths of this fit and of the checkpoint it resumes (None: none known).
        self.schedule_steps: int | None = None
        self.saved_schedule_steps: int | None = None
        #: The losses the latest training step logged (``train/loss``, ``train/balance_loss``, ...; detached): what a
        #: non-finite step is reported with (:mod:`mmoe.runtime.non_finite`), read before the optimiser step.
        self.latest_train_losses: dict[str, torch.Tensor] = {}
        #: The loss-free balancing loads of the current optimiser step (made at the first training step).
        self.selection_loads: SelectionLoads | None = None
        #: This optimiser step's gradient norm as :meth:`gradient_norm` measured it, until the clipping reuses it.
        self.measured_gradient_norm: MeasuredNorm | None = None
        if text_tokenizer is not None:  # a missing or unreadable file fails here, named by the option that gives it
            try:
                TextTokenizer(sentencepiece=text_tokenizer)
            except (FileNotFoundError, ValueError) as error:
                raise type(error)(f"model.text_tokenizer: {error}") from None

    def store_configs(self) -> None:
        """Saves the backbone's architecture and the optimiser config in the hyper-parameters as plain dicts:
        checkpoints are read with ``weights_only=True``, and LightningCLI parses a checkpoint's hyper-parameters with
        ``--ckpt_path`` (in a fresh process it cannot read a :class:`MultiwayConfig` instance into ``backbone:
        MultiwayConfig | None`` when the config file says null). :func:`mmoe.runtime.checkpoint.read_backbone_state`
        reads both backbone forms (older checkpoints hold the instance)."""
        self.hparams.backbone = config_to_dict(self.backbone.config)
        self.hparams.optimizer = self.optimizer_config.to_dict()

    def balance_loss(self, routing: list[RoutingRecord]) -> torch.Tensor:
        """Sum (or mean, ``balance_reduce="mean"``) of the MoE layers' balance losses; 0 for a dense backbone."""
        return self.reduce_layers([record.balance_loss for record in routing])

    def z_loss(self, routing: list[RoutingRecord]) -> torch.Tensor:
        """Sum (or mean, as the balance losses) of the MoE layers' router z-losses (ST-MoE Eq. 5)."""
        return self.reduce_layers([record.z_loss for record in routing])

    def auxiliary_losses(self, routing: list[RoutingRecord]) -> dict[str, torch.Tensor]:
        """Each further loss the MoE layers return (``RoutingRecord.auxiliary_losses``, already weighted), summed (or
        averaged) over the records that carry it as the balance losses are; empty when no layer returns one."""
        names = dict.fromkeys(name for record in routing for name in record.auxiliary_losses)
        return {
            name: self.reduce_layers([r.auxiliary_losses[name] for r in routing if name in r.auxiliary_losses])
            for name in names
        }

    def reduce_layers(self, losses: list[torch.Tensor]) -> torch.Tensor:
        if not losses:
            return torch.zeros((), device=self.device)
        stacked = torch.stack(losses)
        return stacked.mean() if self.hparams.balance_reduce == "mean" else stacked.sum()

    def step_losses(self, batch: Any) -> StepLosses:
        """The task loss, the task's metrics and the routing records of one batch; each task defines it."""
        raise NotImplementedError

    def shared_step(self, batch: Any, stage: str) -> tuple[torch.Tensor, list[RoutingRecord], Any]:
        """Task loss + alpha * balance loss (+ the z-loss term and the auxiliary losses) of one batch, logged under
        ``stage``: (loss, routing, the step's ``output``)."""
        step = self.step_losses(batch)
        balance = self.balance_loss(step.routing)
        loss = step.task_loss + self.hparams.balance_coefficient * balance
        log = {f"{stage}/{name}": value.detach() for name, value in step.logged.items()}
        if step.routing:
            z_loss = self.z_loss(step.routing)
            if self.z_loss_coefficient > 0:
                loss = loss + self.z_loss_coefficient * z_loss
            log[f"{stage}/z_loss"] = z_loss.detach()
        for name, value in self.auxiliary_losses(step.routing).items():
            loss = loss + value
            log[f"{stage}/{name}"] = value.detach()
        log[f"{stage}/loss"] = loss.detach()
        log[f"{stage}/balance_loss"] = balance.detach()
        if step.routing:
            log[f"{stage}/dropped_fraction"] = torch.stack([r.dropped_fraction for r in step.routing]).mean()
            log[f"{stage}/requested_capacity"] = (
                torch.stack([r.requested_capacity for r in step.routing]).float().mean()
            )
            unrouted = [r.unrouted_fraction for r in step.routing if r.unrouted_fraction is not None]
            if unrouted:  # expert choice: tokens no expert took
                log[f"{stage}/unrouted_fraction"] = torch.stack(unrouted).mean()
        sync = stage != "train"
        if stage == "train":
            self.latest_train_losses = {name: value for name, value in log.items() if name.endswith("loss")}
        self.log_dict(log, batch_size=step.size, sync_dist=sync)
        self.log(f"{stage}_loss", loss.detach(), batch_size=step.size, prog_bar=True, logger=False, sync_dist=sync)
        return loss, step.routing, step.output

    def training_step(self, batch: Any, batch_idx: int) -> dict:
        loss, routing, _ = self.shared_step(batch, "train")
        if self.selection_loads is None:
            self.selection_loads = SelectionLoads(self.backbone)
        self.selection_loads.add(routing)
        return {"loss": loss, "routing": [detached(record) for record in routing]}

    def setup(self, stage: str) -> None:
        shard_experts(self)  # expert parallelism: before DDP wraps the module and the optimiser is built

    def configure_model(self) -> None:
        """Under Lightning's ``ModelParallelStrategy`` (FSDP2): every backbone block and then the whole task become
        fully sharded units over the data-parallel mesh (:mod:`mmoe.runtime.fsdp`), with bf16 / fp16 parameters in
        compute when the trainer's precision says so."""
        mesh = self.device_mesh
        if mesh is None or self.fully_sharded:
            return
        if mesh["tensor_parallel"].size() > 1:
            raise ValueError(
                f"ModelParallelStrategy's tensor_parallel_size is {mesh['tensor_parallel'].size()}: mmoe shards with "
                "FSDP only; set --trainer.strategy.init_args.tensor_parallel_size 1 and data_parallel_size to the "
                "world size"
            )
        precision = str(self.trainer.precision)
        param_dtype = (
            torch.bfloat16 if precision.startswith("bf16") else torch.float16 if precision.startswith("16") else None
        )
        shard_task(self, mesh["data_parallel"], param_dtype)
        self.fully_sharded = True

    def on_before_optimizer_step(self, optimizer) -> None:
        average_expert_gradients(self)

    def gradient_norm(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """The total 2-norm of ``optimizer``'s gradients (``torch.nn.utils.get_total_norm``, on their device; each
        process's own shards of sharded gradients), kept for :meth:`configure_gradient_clipping` to reuse while the
        gradients are unchanged (:mod:`mmoe.runtime.gradient_norm`)."""
        grads = optimizer_gradients(optimizer)
        if any(isinstance(grad, DTensor) for grad in grads):
            return local_total_norm(grads)
        self.measured_gradient_norm = MeasuredNorm.of(grads)
        return self.measured_gradient_norm.total

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Lightning's norm clipping (``torch.nn.utils.clip_grad_norm_``) with the norm :meth:`gradient_norm` measured
        this step, when it is still the norm of these gradients, and without the multiply by one of a step that needs
        no clipping: the same gradients, bit for bit. Any other case (value clipping, a precision plugin with its own
        clipping or a gradient scaler, gradients changed since) is Lightning's own."""
        measured, self.measured_gradient_norm = self.measured_gradient_norm, None
        plugin = self.trainer.precision_plugin
        if (
            measured is None
            or not gradient_clip_val
            or (gradient_clip_algorithm or "norm").lower() != "norm"
            or type(plugin) not in (Precision, MixedPrecision)
            or getattr(plugin, "scaler", None) is not None
            or (isinstance(plugin, MixedPrecision) and optimizer.defaults.get("fused"))  # Lightning refuses it
        ):
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        parameters = list(plugin.main_params(optimizer))
        if not measured.is_of([p.grad for p in parameters if p.grad is not None]):
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        clip_to_measured_norm(parameters, float(gradient_clip_val), measured.total)

    def optimizer_parameter_names(self) -> list[str]:
        """Parameter names in the optimiser's order (what its state indices refer to)."""
        groups = parameter_groups(self, self.optimizer_config, self.head_prefixes)
        names = {id(parameter): name for name, parameter in self.named_parameters()}
        return [names[id(parameter)] for group in groups for parameter in group["params"]]

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["rng_states"] = gather_objects([random_states()])
        add_missing_optimizer_states(self, checkpoint)  # an FSDP2 resume loads every parameter's state strictly
        gather_optimizer_states(self, checkpoint, self.optimizer_parameter_names)
        if self.schedule_steps is not None:
            checkpoint[SCHEDULE_STEPS_KEY] = self.schedule_steps

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        reshape_scalar_states(self, checkpoint)
        slice_optimizer_states(self, checkpoint, self.optimizer_parameter_names)
        states = checkpoint.get("rng_states")
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        # Put back at the first training step, not now: loaders are created (and draw worker seeds) in between.
        self.rng_states_to_restore = states[rank] if states and rank < len(states) else None
        if self.fitting():  # before Lightning restores the optimiser: a change it cannot take is refused first
            self.optimizer_changes = resume_changes(self, checkpoint, self.trainer.ckpt_path)
            self.saved_schedule_steps = checkpoint.get(SCHEDULE_STEPS_KEY)

    def fitting(self) -> bool:
        """Whether a trainer runs ``fit`` with this task (not so in ``load_from_checkpoint``, which has none)."""
        try:
            return self.trainer.state.fn == TrainerFn.FITTING
        except RuntimeError:  # not attached to a trainer
            return False

    def on_train_start(self) -> None:
        """A resume's changed optimiser settings and schedule length go into the optimiser and schedule Lightning
        restored."""
        saved, restretched = self.saved_schedule_steps, self.saved_schedule_steps not in (None, self.schedule_steps)
        if self.optimizer_changes or restretched:
            optimizer, step = self.trainer.optimizers[0], self.trainer.global_step
            old_rate = optimizer.param_groups[0]["lr"]
            groups = parameter_groups(self, self.optimizer_config, self.head_prefixes)
            apply_optimizer_config(
                optimizer, self.trainer.lr_scheduler_configs[0].scheduler, groups, self.optimizer_config
            )
            if self.optimizer_changes:
                report_changes(self.optimizer_changes, step)
            if restretched:
                report_schedule_change(saved, self.schedule_steps, step, old_rate, optimizer.param_groups[0]["lr"])
            self.optimizer_changes, self.saved_schedule_steps = {}, None

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.rng_states_to_restore is not None:
            set_random_states(self.rng_states_to_restore)
            self.rng_states_to_restore = None

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.log_skipped_samples("train")
        if self.selection_loads is not None and self.selection_loads.routers:
            self.log("train/selection_bias_spread", self.selection_loads.bias_spread(), batch_size=1)

    def on_validation_epoch_end(self) -> None:
        self.log_skipped_samples("val")

    def log_skipped_samples(self, split: str) -> None:
        """Logs ``data/skipped/<stream>``: samples the DataModule's ``split`` streams skipped so far."""
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is None or not hasattr(datamodule, "skipped_samples"):
            return
        counts = {
            f"data/skipped/{stream}": float(count)
            for stream, count in datamodule.skipped_samples().items()
            if stream.split("/")[0] == split
        }
        if counts:
            self.log_dict(counts, reduce_fx="max")

    def optimizer_step(self, *args, **kwargs) -> None:
        super().optimizer_step(*args, **kwargs)
        # X-MoE keeps the expert embeddings at norm 0.1 (§3.1): restored after every optimiser step (not in a
        # zero-grad hook, which Lightning runs between the forward and the backward).
        restore_expert_embedding_norm(self.backbone)
        if self.selection_loads is not None:  # Wang et al. (2024) Algorithm 1: after the step, from its loads
            self.selection_loads.update()

    def configure_optimizers(self):
        # Lightning refuses to clip the gradients of a fused optimiser under mixed precision (it would unscale them
        # itself), so a clipped mixed-precision run takes torch's default AdamW.
        clipped_mixed = bool(self.trainer.gradient_clip_val) and str(self.trainer.precision).endswith("-mixed")
        self.schedule_steps = schedule_length(self.optimizer_config, lambda: self.trainer.estimated_stepping_batches)
        answer = adamw_with_schedule(
            self, self.optimizer_config, self.head_prefixes, lambda: self.schedule_steps, fused=not clipped_mixed
        )
        return answer


def batch_size(batch: dict) -> int:
    for key in ("image", "image_left", "text_ids"):
        if key in batch:
            return len(batch[key])
    raise ValueError(f"cannot tell the batch size of a batch with keys {sorted(batch)}")
