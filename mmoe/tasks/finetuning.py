"""What every fine-tuning task shares: a backbone built from a pre-trained checkpoint (or fresh), a released BEiT-3
head loaded where it fits, and predictions gathered over the processes and written whole.

* X-MoE §3.3 frozen routing: routers and experts of the pre-trained backbone stay fixed during fine-tuning while the
  balance loss stays in the objective.
* Each task class owns what is particular to it: its short :attr:`FineTuningTask.name` (the key of
  :data:`mmoe.tasks.catalog.FINETUNING_TASKS`), its BEiT-3 head names, its head's parameter count, its prediction
  entries and its predictions file format. What ``mmoe infer`` needs of it lives beside it, in its
  :class:`mmoe.tasks.inference.InferSpec`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar, Literal

import torch
from lightning.pytorch.trainer.states import TrainerFn
from PIL import Image

from mmoe.atomic import write_text_atomic
from mmoe.data.transforms import eval_transform
from mmoe.model import MultiwayConfig, MultiwayTransformer
from mmoe.model.backbone import resize_vision_positions
from mmoe.moe import RoutingRecord
from mmoe.runtime.checkpoint import PretrainedWeights, config_from_dict, load_weights, read_pretrained
from mmoe.runtime.optimizer import FINETUNING_OPTIMIZER, OptimizerConfig
from mmoe.runtime.predictions import gather_objects, unique_entries
from mmoe.tasks.base import BackboneTask, StepLosses, batch_size

#: Task arguments that name output files; kept out of the saved hyper-parameters.
OUTPUT_ARGUMENTS = ("predictions_file", "results_dir")


class FineTuningTask(BackboneTask):
    """A task head over a pre-trained (or fresh) multiway backbone: the arguments every fine-tuning task shares.

    Args:
        backbone: the backbone's architecture. Without ``pretrained`` the backbone starts from scratch; with it,
            the weights are loaded into this architecture, which must match the checkpoint's parameter shapes except
            ``image_size`` (the vision position table is resized bicubically, as BEiT-3 does to fine-tune at 384 or
            480 px); None = the checkpoint's own architecture.
        pretrained: an exported backbone (``mmoe.runtime.checkpoint.export_backbone``), a Lightning checkpoint of
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
        optimizer: AdamW and its warm-up cosine schedule (:class:`mmoe.runtime.optimizer.OptimizerConfig`; layer-wise
            decay and the head's learning-rate multiplier included).

    Prediction (``mmoe predict``, ``mmoe infer --shards``): ``predict_step`` appends the task's
    :meth:`prediction_entries` of each batch to ``self.predictions``; at the end the base class gathers them over the
    processes, keeps the first entry of each sample (``prediction_key``; a distributed sampler may repeat samples to
    even out the ranks), sets ``predicted_count`` and writes ``predictions_file`` atomically in the task's
    :meth:`format_predictions` (a JSON list unless the task says otherwise). With an expert-choice backbone a
    sample's result depends on the samples that share its batch (``eval_batch_size`` changes it): ``mmoe
    validate``, ``test`` and ``predict`` say so in one warning line (:meth:`warn_batch_dependent_routing`).
    """

    #: The task's short name: its key in :data:`mmoe.tasks.catalog.FINETUNING_TASKS`, its configs'
    #: (``configs/finetune/<name>_<size>.yaml``) and its ``mmoe infer`` subcommand's.
    name: ClassVar[str]
    #: The task-head parameter names of the released BEiT-3 model of this task (unilm's) -> this task's, prefix to
    #: prefix (:meth:`load_beit3_head`).
    beit3_heads: ClassVar[dict[str, str]]
    #: The field of a prediction entry that names its sample: a dict key, or an index into a tuple entry.
    prediction_key: ClassVar[str | int]
    #: Task arguments naming files a checkpoint records: ``mmoe export`` copies them into its folder, ``mmoe infer
    #: --<argument>`` gives a moved one's new path.
    file_arguments: ClassVar[tuple[str, ...]] = ("text_tokenizer",)
    #: Where ``mmoe predict`` writes the predictions; None = not written. Set by each task's ``__init__``.
    predictions_file: str | None = None
    #: Whether the task's text tokens see only earlier ones (captioning): expert-choice routing and batch-priority drops
    #: are then refused, since either decides over the whole batch and an earlier token's routing would depend on later
    #: ones.
    causal_text: ClassVar[bool] = False
    #: The backbone's final LayerNorm (``MultiwayConfig.output_norm``, torchscale's ``normalize_output``) as the task
    #: needs it, over the configured or pre-trained backbone's; None = the backbone's own. BEiT-3's ImageNet model
    #: turns it off, its pre-trained weights' final LayerNorm left unused.
    output_norm: ClassVar[bool | None] = None

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
        super().__init__(balance_reduce, optimizer, text_tokenizer, z_loss_coefficient, balance_coefficient)
        if backbone is None and pretrained is None:
            raise ValueError("give model.backbone (train from scratch) or model.pretrained (a checkpoint), or both")
        # Also collects the init arguments of the subclass calling this. Output paths stay out of the checkpoint:
        # LightningCLI applies a checkpoint's hyper-parameters over the command line (``mmoe predict --ckpt_path``),
        # which would otherwise reset a ``predictions_file`` given there to the training run's value.
        self.save_hyperparameters(ignore=list(OUTPUT_ARGUMENTS))
        weights = read_pretrained(pretrained) if pretrained is not None else None
        self.backbone = build_backbone(backbone, weights, frozen_routing, eval_capacity_factor, self.output_norm)
        if self.causal_text:
            refuse_batch_dependent_routing(self.name, self.backbone.config)
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
        self._warned_routing = False

    @classmethod
    def head_parameters(cls, config: MultiwayConfig, init_args: dict) -> dict[str, int]:
        """Parameters of the task's heads for a backbone of ``config`` and the task's arguments ``init_args`` (a
        config's ``model.init_args``; files it names are read for their sizes), per head that makes one kind of
        prediction (``mmoe info``)."""
        raise NotImplementedError

    @classmethod
    def evaluated_weights(cls, checkpoint: dict) -> dict[str, torch.Tensor]:
        """The weights a Lightning checkpoint of the task is evaluated with (what ``mmoe infer`` and ``mmoe export``
        take): its ``state_dict``, unless the task keeps other weights for evaluation (an EMA of them)."""
        return checkpoint["state_dict"]

    @classmethod
    def head_of(cls, key: str) -> str:
        """The head (as :meth:`head_parameters` names it) a state-dict key outside the backbone belongs to: ``head``
        unless the task has several."""
        return "head"

    def image_transform(self) -> Callable[[Image.Image], torch.Tensor]:
        """How the task's evaluation images are made from a decoded RGB image (``mmoe infer``): resize, center crop
        and mmoe's 0.5 / 0.5 normalisation (:func:`mmoe.data.transforms.eval_transform`) at the backbone's size."""
        return eval_transform(self.backbone.config.image_size)

    def text_attention_mask(self, text_len: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """The attention mask of the backbone pass the task reads a text of ``text_len`` tokens in, (1, L, L) with
        True = may attend; None = full attention (captioning: image tokens never see the caption)."""
        return None

    def load_beit3_head(self, rows: torch.Tensor | None = None) -> None:
        """Loads the head of a released BEiT-3 ``pretrained`` file of this task (:attr:`beit3_heads`) into this
        task's head where the shapes agree, and forgets the file's heads; each subclass calls it once its head is
        built. Layers whose shape differs (another answer vocabulary) keep their fresh initialisation; one stderr line
        says what was loaded and what was not.

        Args:
            rows: the rows of the file's output layer this head keeps (captioning with ``output_vocab``: its ids).
        """
        heads, self._beit3_heads = self._beit3_heads, {}
        names = self.beit3_heads
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
        print(
            f"mmoe: BEiT-3 {self.name} head: {len(loaded)} tensors loaded from model.pretrained{kept}", file=sys.stderr
        )

    def on_validation_start(self) -> None:
        self.warn_batch_dependent_routing()

    def on_test_start(self) -> None:
        self.warn_batch_dependent_routing()

    def on_predict_start(self) -> None:
        self.warn_batch_dependent_routing()

    def warn_batch_dependent_routing(self) -> None:
        """One stderr line when ``mmoe validate``, ``test`` or ``predict`` runs an expert-choice backbone (Zhou et al.,
        2022): each expert picks its top-C tokens of the whole batch, so a sample's result depends on the samples
        beside it; the routing is per batch by design, and ``mmoe infer`` routes each input alone."""
        moe, state = self.backbone.config.moe, self.trainer.state.fn
        if moe is None or moe.routing != "expert_choice" or state == TrainerFn.FITTING or self._warned_routing:
            return
        self._warned_routing = True
        if self.trainer.is_global_zero:
            print(
                f"mmoe {state.value}: warning: model.backbone.moe.routing='expert_choice' picks each expert's tokens "
                "over the whole batch, so these results depend on which samples share a batch (another "
                "data.init_args.eval_batch_size, sample order or process count changes them)",
                file=sys.stderr,
            )

    def on_validation_epoch_start(self) -> None:
        self.validation_outputs = []

    def gathered_validation_outputs(self) -> list:
        """Every process's validation outputs of this epoch (each process's in order), this process's list emptied."""
        outputs = gather_objects(self.validation_outputs)
        self.validation_outputs = []
        return outputs

    def on_predict_epoch_start(self) -> None:
        self.predictions = []

    def prediction_entries(self, batch: dict) -> list:
        """The predictions-file entries of one batch (one per sample, named by ``prediction_key``); each task
        defines it."""
        raise NotImplementedError

    def predict_step(self, batch: dict, batch_idx: int) -> list:
        entries = self.prediction_entries(batch)
        self.predictions.extend(entries)
        return entries

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


def required_argument(init_args: dict, key: str) -> str:
    """``init_args[key]``, a file a task's head size depends on; an error naming ``model.init_args.<key>`` when the
    arguments lack it."""
    value = init_args.get(key)
    if not value:
        raise ValueError(f"model.init_args.{key} is needed to count the head")
    return value


def routes_over_the_batch(config: MultiwayConfig) -> bool:
    """Whether ``config`` routes by expert choice, drops by batch priority (V-MoE), or routes top-k > 1 under a finite
    capacity: each decides a token's routing over the whole batch, so an earlier token's routing may depend on later
    ones (:func:`later_choices_drop_earlier`)."""
    moe = config.moe
    return moe is not None and (
        moe.routing == "expert_choice"
        or moe.capacity_priority == "batch_priority"
        or later_choices_drop_earlier(config) is not None
    )


def later_choices_drop_earlier(config: MultiwayConfig) -> str | None:
    """The capacity field (``capacity_factor`` or ``eval_capacity_factor``) whose finite value lets a later token
    drop an earlier token's choice under top-k > 1 token choice, or None. GShard's position priority fills each
    expert with all first choices before any second choice, so a later token's first choice can take the place of
    an earlier token's second choice, in the same sequence too."""
    moe = config.moe
    if moe is None or moe.routing != "token_choice" or moe.top_k < 2:
        return None
    for name in ("capacity_factor", "eval_capacity_factor"):
        value = getattr(moe, name)
        if value is not None and math.isfinite(value):
            return name
    return None


def refuse_batch_dependent_routing(task: str, config: MultiwayConfig) -> None:
    """One-line ``ValueError``, for a task whose text is causal, when ``config`` routes over the batch
    (:func:`routes_over_the_batch`), naming which of the two it does, or mixes every token of a sequence (Soft MoE)."""
    if config.moe is not None and config.moe.routing == "soft":
        raise ValueError(
            f"model.backbone.moe.routing='soft' is refused for {task}: its text is causal (a token sees only earlier "
            "ones), but each Soft MoE slot mixes every token of the sequence and every token takes every slot's "
            "output, so an earlier token's output would depend on later ones; give model.backbone with "
            "moe.routing: token_choice and capacity_factor: null"
        )
    if not routes_over_the_batch(config):
        return
    capacity = later_choices_drop_earlier(config)
    if capacity is not None and config.moe.capacity_priority == "position":
        raise ValueError(
            f"model.backbone.moe.{capacity}={getattr(config.moe, capacity)!r} with top_k={config.moe.top_k} is "
            f"refused for {task}: its text is causal (a token sees only earlier ones), but a finite capacity fills "
            "each expert with all first choices before any second choice, so a later token's first choice could drop "
            f"an earlier token's second choice; give {capacity}: null (dropless), or top_k: 1"
        )
    if config.moe.capacity_priority == "batch_priority":
        raise ValueError(
            f"model.backbone.moe.capacity_priority='batch_priority' is refused for {task}: its text is causal (a token "
            "sees only earlier ones), but batch priority drops the least confident choices of the whole batch first, "
            "so whether an earlier token keeps its expert would depend on later ones; give capacity_priority: "
            "position, or capacity_factor: null (dropless)"
        )
    raise ValueError(
        f"model.backbone.moe.routing='expert_choice' is refused for {task}: its text is causal (a token sees only "
        "earlier ones), but each expert picks its top-C tokens of the whole batch, so an earlier token's routing "
        "would depend on later ones (and generation, which routes on the prefix, on other tokens than training); "
        "give model.backbone with moe.routing: token_choice and capacity_factor: null (an expert-choice "
        "backbone's weights load into it)"
    )


def build_backbone(
    config: MultiwayConfig | dict | None,
    pretrained: str | PretrainedWeights | None,
    frozen_routing: bool = False,
    eval_capacity_factor: float | None = None,
    output_norm: bool | None = None,
) -> MultiwayTransformer:
    """The backbone of a fine-tuning task (see :class:`FineTuningTask`'s ``backbone``, ``pretrained``: a file, or
    what :func:`read_pretrained` read from it, ``frozen_routing``, ``eval_capacity_factor`` and the task's
    ``output_norm`` over the config's; a backbone without the final LayerNorm leaves a pre-trained one out); a dict
    ``config`` is a checkpoint's saved hyper-parameter (``load_from_checkpoint``)."""
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
    if output_norm is not None and config.output_norm != output_norm:
        config = dataclasses.replace(config, output_norm=output_norm)
    if weights is not None and not config.output_norm:  # a pre-trained final LayerNorm is left unused
        weights = {key: value for key, value in weights.items() if not key.startswith("final_norm.")}
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
