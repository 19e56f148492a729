"""What every mmoe training task shares: the balance term, AdamW with warm-up cosine, X-MoE's norm restore, building a
fine-tuning backbone from a pre-trained checkpoint, gathering validation outputs and writing prediction files.

* Total loss = task loss + alpha * sum (or mean) of the MoE layers' balance losses (X-MoE Eq. 10), plus, when
  ``z_loss_coefficient`` is set, that coefficient times the sum (or mean) of their router z-losses (ST-MoE Eq. 5).
* AdamW with warm-up cosine (:mod:`mmoe.tasks.optimizer`, one typed ``optimizer`` argument of every task).
* X-MoE §3.1: expert embeddings are put back to L2 norm 0.1 after every optimiser step.
* X-MoE §3.3 frozen routing: routers and experts of the pre-trained backbone stay fixed during fine-tuning while the
  balance loss stays in the objective.
* Exact resume: checkpoints hold the random generators' states (torch, CUDA, numpy, Python; every process's), put back
  before the first training step after ``--ckpt_path``; the data loaders save their own position.
* Samples the data loaders skipped (corrupt or lost) are logged as ``data/skipped/<stream>``.
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
from pathlib import Path
from typing import Any, Literal

import lightning as L
import numpy as np
import torch

from mmoe.atomic import write_text_atomic
from mmoe.data.tokenizer import TextTokenizer
from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer
from mmoe.model.backbone import resize_vision_positions
from mmoe.model.beit3 import TASK_HEADS
from mmoe.moe import RoutingRecord, restore_expert_embedding_norm
from mmoe.tasks.checkpoint import PretrainedWeights, config_from_dict, config_to_dict, load_weights, read_pretrained
from mmoe.tasks.expert_parallel import (
    average_expert_gradients,
    gather_optimizer_states,
    shard_experts,
    slice_optimizer_states,
)
from mmoe.tasks.fsdp import shard_task
from mmoe.tasks.optimizer import FINETUNING_OPTIMIZER, OptimizerConfig, adamw_with_schedule, parameter_groups

# Task checkpoints hold the backbone config in their hyper-parameters; Lightning loads checkpoints with
# ``weights_only=True`` (``--ckpt_path``, ``load_from_checkpoint``), which refuses classes it is not told about.
torch.serialization.add_safe_globals([MultiwayConfig, MoEPlan])

#: The values of ``balance_reduce``: add or average the MoE layers' balance losses.
BALANCE_REDUCTIONS = ("sum", "mean")
#: Task arguments that name output files; kept out of the saved hyper-parameters.
OUTPUT_ARGUMENTS = ("predictions_file", "results_dir")


def detached(record: RoutingRecord) -> RoutingRecord:
    """The record with its balance loss and z-loss detached (what ``training_step`` hands to callbacks)."""
    record.balance_loss = record.balance_loss.detach()
    record.z_loss = record.z_loss.detach()
    return record


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
    and the routing records; the base adds alpha x the balance loss (X-MoE Eq. 10), logs ``<stage>/loss``,
    ``<stage>/balance_loss``, ``<stage>/z_loss``, ``<stage>/dropped_fraction`` and ``<stage>/requested_capacity`` with
    the task's metrics,
    and ``training_step`` hands the callbacks the routing records with detached balance losses.

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
    ) -> None:
        """``z_loss_coefficient``: the subclass's argument, checked here."""
        super().__init__()
        if balance_reduce not in BALANCE_REDUCTIONS:
            raise ValueError(f"model.balance_reduce must be 'sum' or 'mean', got {balance_reduce!r}")
        if z_loss_coefficient < 0:
            raise ValueError(f"model.z_loss_coefficient must be >= 0, got {z_loss_coefficient!r}")
        self.z_loss_coefficient = z_loss_coefficient
        self.optimizer_config = OptimizerConfig.from_value(optimizer)
        if text_tokenizer is not None:  # a missing or unreadable file fails here, named by the option that gives it
            try:
                TextTokenizer(sentencepiece=text_tokenizer)
            except (FileNotFoundError, ValueError) as error:
                raise type(error)(f"model.text_tokenizer: {error}") from None

    def store_configs(self) -> None:
        """Saves the backbone's architecture and the optimiser config in the hyper-parameters as plain dicts:
        checkpoints are read with ``weights_only=True``, and LightningCLI parses a checkpoint's hyper-parameters with
        ``--ckpt_path`` (in a fresh process it cannot read a :class:`MultiwayConfig` instance into ``backbone:
        MultiwayConfig | None`` when the config file says null). :func:`mmoe.tasks.checkpoint.read_backbone_state`
        reads both backbone forms (older checkpoints hold the instance)."""
        self.hparams.backbone = config_to_dict(self.backbone.config)
        self.hparams.optimizer = self.optimizer_config.to_dict()

    def balance_loss(self, routing: list[RoutingRecord]) -> torch.Tensor:
        """Sum (or mean, ``balance_reduce="mean"``) of the MoE layers' balance losses; 0 for a dense backbone."""
        return self.reduce_layers([record.balance_loss for record in routing])

    def z_loss(self, routing: list[RoutingRecord]) -> torch.Tensor:
        """Sum (or mean, as the balance losses) of the MoE layers' router z-losses (ST-MoE Eq. 5)."""
        return self.reduce_layers([record.z_loss for record in routing])

    def reduce_layers(self, losses: list[torch.Tensor]) -> torch.Tensor:
        if not losses:
            return torch.zeros((), device=self.device)
        stacked = torch.stack(losses)
        return stacked.mean() if self.hparams.balance_reduce == "mean" else stacked.sum()

    def step_losses(self, batch: Any) -> StepLosses:
        """The task loss, the task's metrics and the routing records of one batch; each task defines it."""
        raise NotImplementedError

    def shared_step(self, batch: Any, stage: str) -> tuple[torch.Tensor, list[RoutingRecord], Any]:
        """Task loss + alpha * balance loss of one batch, logged under ``stage``: (loss, routing, the step's
        ``output``)."""
        step = self.step_losses(batch)
        balance = self.balance_loss(step.routing)
        loss = step.task_loss + self.hparams.balance_coefficient * balance
        log = {f"{stage}/{name}": value.detach() for name, value in step.logged.items()}
        if step.routing:
            z_loss = self.z_loss(step.routing)
            if self.z_loss_coefficient > 0:
                loss = loss + self.z_loss_coefficient * z_loss
            log[f"{stage}/z_loss"] = z_loss.detach()
        log[f"{stage}/loss"] = loss.detach()
        log[f"{stage}/balance_loss"] = balance.detach()
        if step.routing:
            log[f"{stage}/dropped_fraction"] = torch.stack([r.dropped_fraction for r in step.routing]).mean()
            log[f"{stage}/requested_capacity"] = (
                torch.stack([r.requested_capacity for r in step.routing]).float().mean()
            )
        sync = stage != "train"
        self.log_dict(log, batch_size=step.size, sync_dist=sync)
        self.log(f"{stage}_loss", loss.detach(), batch_size=step.size, prog_bar=True, logger=False, sync_dist=sync)
        return loss, step.routing, step.output

    def training_step(self, batch: Any, batch_idx: int) -> dict:
        loss, routing, _ = self.shared_step(batch, "train")
        return {"loss": loss, "routing": [detached(record) for record in routing]}

    def setup(self, stage: str) -> None:
        shard_experts(self)  # expert parallelism: before DDP wraps the module and the optimiser is built

    def configure_model(self) -> None:
        """Under Lightning's ``ModelParallelStrategy`` (FSDP2): every backbone block and then the whole task become
        fully sharded units over the data-parallel mesh (:mod:`mmoe.tasks.fsdp`), with bf16 / fp16 parameters in
        compute when the trainer's precision says so."""
        mesh = self.device_mesh
        if mesh is None or getattr(self, "_fully_sharded", False):
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
        self._fully_sharded = True

    def on_before_optimizer_step(self, optimizer) -> None:
        average_expert_gradients(self)

    def optimizer_parameter_names(self) -> list[str]:
        """Parameter names in the optimiser's order (what its state indices refer to)."""
        config = self.optimizer_config
        groups = parameter_groups(self, config.weight_decay, config.layer_decay, config.head_lr_multiplier,
                                  self.head_prefixes)  # fmt: skip
        names = {id(parameter): name for name, parameter in self.named_parameters()}
        return [names[id(parameter)] for group in groups for parameter in group["params"]]

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["rng_states"] = gather_objects([random_states()])
        add_missing_optimizer_states(self, checkpoint)  # an FSDP2 resume loads every parameter's state strictly
        gather_optimizer_states(self, checkpoint, self.optimizer_parameter_names)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        reshape_scalar_states(self, checkpoint)
        slice_optimizer_states(self, checkpoint, self.optimizer_parameter_names)
        states = checkpoint.get("rng_states")
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        # Put back at the first training step, not now: loaders are created (and draw worker seeds) in between.
        self._rng_states_to_restore = states[rank] if states and rank < len(states) else None

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        states = getattr(self, "_rng_states_to_restore", None)
        if states is not None:
            set_random_states(states)
            self._rng_states_to_restore = None

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.log_skipped_samples("train")

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

    def configure_optimizers(self):
        return adamw_with_schedule(
            self, self.optimizer_config, self.head_prefixes, lambda: self.trainer.estimated_stepping_batches
        )


class FineTuningTask(BackboneTask):
    """A task head over a pre-trained (or fresh) multiway backbone: the arguments every fine-tuning task shares.

    Args:
        backbone: the backbone's architecture. Without ``pretrained`` the backbone starts from scratch; with it,
            the weights are loaded into this architecture, which must match the checkpoint's parameter shapes except
            ``image_size`` (the vision position table is resized bicubically, as BEiT-3 does to fine-tune at 384 or
            480 px); None = the checkpoint's own architecture.
        pretrained: an exported backbone (``mmoe.tasks.checkpoint.export_backbone``), a Lightning checkpoint of
            any mmoe task, or a released BEiT-3 checkpoint (``beit3_base_patch16_224.pth``, a task model; its task
            head loads into the matching task where the shapes agree, see :meth:`load_beit3_head`) to start from.
        text_tokenizer: the SentencePiece model of the texts (BEiT-3's ``beit3.spm``, XLM-R ids); None = open_clip's
            BPE. The data's tokenizer follows it (the mmoe CLI links it); the backbone's text embedding must fit it.
        frozen_routing: X-MoE §3.3: freeze the routers and experts of every MoE layer (``MoEPlan.frozen``); the
            balance loss stays in the objective. No effect on a dense backbone.
        balance_coefficient: alpha, the weight of the balance losses (X-MoE Eq. 10).
        balance_reduce: ``"sum"`` adds the MoE layers' balance losses (MH-MoE code); ``"mean"`` averages them (the
            z-losses alike).
        z_loss_coefficient: weight of the router z-loss (ST-MoE Eq. 5; ST-MoE uses 1e-3); 0 = off, as in BEiT-3,
            X-MoE and MH-MoE.
        eval_capacity_factor: the MoE layers' capacity factor in evaluation and prediction (``MoEPlan
            .eval_capacity_factor``), over the pre-trained backbone's; None = keep the backbone's.
        optimizer: AdamW and its warm-up cosine schedule (:class:`mmoe.tasks.optimizer.OptimizerConfig`; layer-wise
            decay and the head's learning-rate multiplier included).

    Prediction (``mmoe predict``): ``predict_step`` appends its entries to ``self.predictions``; at the end the base
    class gathers them over the processes, keeps the first entry of each sample (``prediction_key``; a distributed
    sampler may repeat samples to even out the ranks), sets ``predicted_count`` and writes ``predictions_file``
    atomically in the task's :meth:`format_predictions` (a JSON list unless the task says otherwise).
    """

    #: The field of a prediction entry that names its sample: a dict key, or an index into a tuple entry.
    prediction_key: str | int
    #: Where ``mmoe predict`` writes the predictions; None = not written. Set by each task's ``__init__``.
    predictions_file: str | None = None

    def __init__(
        self,
        backbone: MultiwayConfig | None = None,
        pretrained: str | None = None,
        text_tokenizer: str | None = None,
        frozen_routing: bool = False,
        balance_coefficient: float = 1e-2,
        balance_reduce: Literal["sum", "mean"] = "sum",
        z_loss_coefficient: float = 0.0,
        eval_capacity_factor: float | None = None,
        optimizer: OptimizerConfig = FINETUNING_OPTIMIZER,
    ) -> None:
        super().__init__(balance_reduce, optimizer, text_tokenizer, z_loss_coefficient)
        if backbone is None and pretrained is None:
            raise ValueError("give model.backbone (train from scratch) or model.pretrained (a checkpoint), or both")
        # Also collects the init arguments of the subclass calling this. Output paths stay out of the checkpoint:
        # LightningCLI applies a checkpoint's hyper-parameters over the command line (``mmoe predict --ckpt_path``),
        # which would otherwise reset a ``predictions_file`` given there to the training run's value.
        self.save_hyperparameters(ignore=list(OUTPUT_ARGUMENTS))
        weights = read_pretrained(pretrained) if pretrained is not None else None
        self.backbone = build_backbone(backbone, weights, frozen_routing, eval_capacity_factor)
        # A released BEiT-3 file's heads, until the subclass has built its own (load_beit3_head).
        self._beit3_heads = weights.heads if weights is not None else {}
        # The checkpoints of this task are self-contained: they rebuild the architecture from the saved config and
        # take every weight from their own state dict, without the pre-trained file.
        self.store_configs()
        self.hparams.pretrained = None
        self.validation_outputs: list[dict] = []
        self.predictions: list[dict] = []
        #: Distinct samples predicted by the last ``predict`` (all processes); ``mmoe predict`` compares it with the
        #: number of samples the split holds.
        self.predicted_count: int | None = None

    def load_beit3_head(self, task: str, rows: torch.Tensor | None = None) -> None:
        """Loads the head of a released BEiT-3 ``pretrained`` file of ``task`` (a key of
        :data:`mmoe.model.beit3.TASK_HEADS`) into this task's head where the shapes agree, and forgets the file's
        heads; each subclass calls it once its head is built. Layers whose shape differs (another answer vocabulary)
        keep their fresh initialisation; one stderr line says what was loaded and what was not.

        Args:
            task: the BEiT-3 model whose head names to read.
            rows: the rows of the file's output layer this head keeps (captioning with ``output_vocab``: its ids).
        """
        heads, self._beit3_heads = self._beit3_heads, {}
        names = TASK_HEADS[task]
        if not any(key.startswith(tuple(names)) for key in heads):
            return
        own = self.state_dict()
        loaded, fresh = {}, []
        for key, value in heads.items():
            prefix = next((prefix for prefix in names if key.startswith(prefix)), None)
            if prefix is None:
                continue
            target = names[prefix] + key[len(prefix) :]
            if target not in own:
                fresh.append(f"{key} (no {target} here)")
                continue
            if rows is not None and value.shape[0] != own[target].shape[0] and value.shape[0] > int(rows.max()):
                value = value[rows.to(value.device)]
            if own[target].shape == value.shape:
                loaded[target] = value
            else:
                fresh.append(f"{target} {tuple(own[target].shape)} (file {tuple(value.shape)})")
        self.load_state_dict(loaded, strict=False)
        kept = f"; kept fresh: {', '.join(fresh)}" if fresh else ""
        print(f"mmoe: BEiT-3 {task} head: {len(loaded)} tensors loaded from model.pretrained{kept}", file=sys.stderr)

    def on_validation_epoch_start(self) -> None:
        self.validation_outputs = []

    def on_predict_epoch_start(self) -> None:
        self.predictions = []

    def on_predict_epoch_end(self) -> None:
        entries = unique_entries(gather_objects(self.predictions), self.prediction_key)
        self.predicted_count = len(entries)
        if self.predictions_file is not None and self.trainer.is_global_zero:
            self.write_predictions(entries, self.predictions_file)

    def format_predictions(self, entries: list) -> str:
        """The text of a predictions file holding ``entries``: a JSON list (VQA, captions) by default."""
        return json.dumps(entries) + "\n"

    def write_predictions(self, entries: list, path: str | Path) -> None:
        """Writes ``entries`` to ``path`` atomically in :meth:`format_predictions`, one entry per sample (the first
        one kept)."""
        write_text_atomic(path, self.format_predictions(unique_entries(entries, self.prediction_key)))

    def step_losses(self, batch: dict) -> StepLosses:
        """``task_loss`` of ``forward_batch``'s logits, logged as ``<stage>/task_loss``; the logits are the output."""
        logits, routing = self.forward_batch(batch)
        task_loss = self.task_loss(logits, batch)
        return StepLosses(task_loss, {"task_loss": task_loss}, routing, batch_size(batch), logits)

    def forward_batch(self, batch: dict) -> tuple[torch.Tensor, list[RoutingRecord]]:
        """(logits, routing records) of one batch; each task defines it."""
        raise NotImplementedError

    def task_loss(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        """The task's loss of ``forward_batch``'s logits; each task defines it."""
        raise NotImplementedError


def read_vocabulary_file(path: str | Path, what: str, written_by: str) -> Any:
    """The JSON value of a task's vocabulary file (answers, caption tokens); a missing file or bad JSON is an error
    naming ``what``, the file and ``written_by`` (what writes it)."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path} does not exist ({written_by})") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{what} {path} is not valid JSON: {error}") from None


def build_backbone(
    config: MultiwayConfig | dict | None,
    pretrained: str | PretrainedWeights | None,
    frozen_routing: bool = False,
    eval_capacity_factor: float | None = None,
) -> MultiwayTransformer:
    """The backbone of a fine-tuning task (see :class:`FineTuningTask`'s ``backbone``, ``pretrained``: a file, or
    what :func:`read_pretrained` read from it, ``frozen_routing`` and ``eval_capacity_factor``); a dict ``config`` is
    a checkpoint's saved hyper-parameter (``load_from_checkpoint``)."""
    if isinstance(config, dict):
        config = config_from_dict(config)
    weights = None
    if pretrained is not None:
        if not isinstance(pretrained, PretrainedWeights):
            pretrained = read_pretrained(pretrained)
        stored, weights = pretrained.config, pretrained.backbone
        if config is None:
            config = stored
        elif config.image_size != stored.image_size or config.patch_size != stored.patch_size:
            weights = dict(weights)
            weights["vision_positions"] = resize_vision_positions(weights["vision_positions"], stored, config)
    if frozen_routing and config.moe is not None:
        config = dataclasses.replace(config, moe=dataclasses.replace(config.moe, frozen=True))
    if eval_capacity_factor is not None and config.moe is not None:
        config = dataclasses.replace(
            config, moe=dataclasses.replace(config.moe, eval_capacity_factor=eval_capacity_factor)
        )
    backbone = MultiwayTransformer(config)
    if weights is not None:
        load_weights(backbone, weights, f"model.backbone does not match the architecture stored in {pretrained.source}")
    return backbone


def reshape_scalar_states(task: BackboneTask, checkpoint: dict[str, Any]) -> None:
    """Optimiser moments saved as 0-dim tensors for a parameter that is now (1,) (X-MoE's ``log_temperature`` was a
    scalar in older checkpoints) take the parameter's shape, so such a run resumes."""
    states = checkpoint.get("optimizer_states") or []
    if not states:
        return
    parameters = dict(task.named_parameters())
    names = task.optimizer_parameter_names()
    for optimizer_state in states:
        for index, state in optimizer_state.get("state", {}).items():
            if not isinstance(index, int) or index >= len(names) or parameters[names[index]].shape != (1,):
                continue
            for key, value in state.items():
                if key != "step" and isinstance(value, torch.Tensor) and value.dim() == 0:
                    state[key] = value.reshape(1)


def add_missing_optimizer_states(task: BackboneTask, checkpoint: dict[str, Any]) -> None:
    """Index-keyed AdamW states (a run without FSDP) get zero moments at step 0 for the trainable parameters that
    never had a gradient (the state AdamW would start them with), so that the checkpoint also resumes under FSDP2,
    which loads every parameter's state strictly. Checkpoints written before this lack them and resume only without
    FSDP."""
    names = task.optimizer_parameter_names()
    parameters = dict(task.named_parameters())
    for optimizer_state in checkpoint.get("optimizer_states") or []:
        states = optimizer_state.get("state", {})
        if not all(isinstance(key, int) for key in states):
            continue  # already keyed by parameter name (a fully sharded run's checkpoint)
        for index, name in enumerate(names):
            if index not in states:
                zeros = torch.zeros(parameters[name].shape, dtype=torch.float32, device=parameters[name].device)
                states[index] = {"step": torch.tensor(0.0), "exp_avg": zeros, "exp_avg_sq": zeros.clone()}


def batch_size(batch: dict) -> int:
    for key in ("image", "image_left", "text_ids"):
        if key in batch:
            return len(batch[key])
    raise ValueError(f"cannot tell the batch size of a batch with keys {sorted(batch)}")


def random_states() -> dict[str, Any]:
    """This process's random generator states (torch, CUDA, numpy's global, Python's), as plain values that
    ``torch.load(weights_only=True)`` reads back."""
    kind, keys, position, has_gauss, cached = np.random.get_state()
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached],
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_random_states(states: dict[str, Any]) -> None:
    """Puts back :func:`random_states`."""
    torch.set_rng_state(states["torch"])
    kind, keys, position, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    random.setstate(_as_tuples(states["python"]))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _as_tuples(value: Any) -> Any:
    """Python's random state with the tuples a checkpoint round trip may have turned into lists."""
    return tuple(_as_tuples(item) for item in value) if isinstance(value, list | tuple) else value


def unique_entries(entries: list, key: str | int) -> list:
    """The first entry of each distinct ``entry[key]``, in order of first appearance."""
    unique: dict = {}
    for entry in entries:
        unique.setdefault(entry[key], entry)
    return list(unique.values())


def as_ids(values: torch.Tensor | list) -> list:
    """A batch's per-sample ids as a Python list (a collated long tensor becomes ints)."""
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)


def gather_objects(items: list) -> list:
    """Concatenation of ``items`` over all processes (each process's list, in rank order); ``items`` itself when
    not distributed."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return items
    gathered: list[list] = [[] for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather_object(gathered, items)
    return [item for part in gathered for item in part]
