"""Image classification fine-tuning, ImageNet-1K as BEiT-3 does it (Wang et al., 2023, §3.2 "image classification";
unilm ``BEiT3ForImageClassification``, ``ImageNetHandler``).

* An image-only pass of the backbone: every token goes through the vision way (vision attention projections, vision
  FFNs or experts); the text weights take no part. The backbone's final LayerNorm is off (BEiT-3's
  ``normalize_output=False``, :attr:`ImageClassificationFineTuning.output_norm`).
* Head: the mean of the patch tokens (the CLS left out) -> ``fc_norm`` LayerNorm(D) -> ``head`` Linear(D, classes),
  its weight and bias multiplied by ``head_init_scale`` (BEiT-3: 1e-3) at initialisation
  (:func:`mmoe.model.heads.classification_head`).
* Loss: with Mixup / CutMix on, timm's ``Mixup`` mixes each training batch and gives soft targets (label smoothing
  folded in), scored by timm's ``SoftTargetCrossEntropy``; otherwise timm's ``LabelSmoothingCrossEntropy`` (plain
  cross-entropy at smoothing 0). Validation scores plain cross-entropy.
* Optional EMA of the weights (timm's ``ModelEmaV3``, :class:`mmoe.tasks.classification_ema.EmaWeights`), updated
  after every optimiser step; validation and ``mmoe predict`` then use the EMA weights.
* Validation logs top-1 and top-5 accuracy (:func:`mmoe.metrics.classification.top_k_accuracy`, fractions);
  ``mmoe predict`` writes per image its key and file name, the ``top_k`` classes (indices, WordNet ids, names) and
  their softmax probabilities, the file ``mmoe eval classification`` scores.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from PIL import Image
from timm.data import Mixup
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from torch import nn

from mmoe.data.classification import eval_transform, read_classes
from mmoe.metrics.classification import TOP_K, top_k_accuracy
from mmoe.model import MultiwayConfig
from mmoe.model.heads import BEIT3_HEAD_INIT_SCALE, classification_head
from mmoe.moe import RoutingRecord
from mmoe.tasks.classification_ema import EMA_KEY, EmaWeights
from mmoe.tasks.finetuning import FineTuningTask, required_argument


@dataclasses.dataclass(frozen=True)
class MixupConfig:
    """timm's ``Mixup`` / CutMix, its arguments as timm names them (BEiT-3's ``--mixup``, ``--cutmix``,
    ``--mixup_prob``, ``--mixup_switch_prob``, ``--mixup_mode``); the task's ``label_smoothing`` and class count are
    added. BEiT-3 base: mixup 0.8, CutMix 1.0, prob 1, switch 0.5, per batch.

    Args:
        mixup_alpha: mixup's Beta(alpha, alpha); 0 = no mixup.
        cutmix_alpha: CutMix's Beta(alpha, alpha); 0 = no CutMix.
        prob: probability of mixing a batch.
        switch_prob: probability of CutMix instead of mixup when both are on.
        mode: ``batch`` (one mix per batch), ``pair`` or ``elem``.
    """

    mixup_alpha: float = 0.8
    cutmix_alpha: float = 1.0
    prob: float = 1.0
    switch_prob: float = 0.5
    mode: Literal["batch", "pair", "elem"] = "batch"

    def timm_mixup(self, label_smoothing: float, num_classes: int) -> Mixup | None:
        """timm's ``Mixup`` of these settings; None when both alphas are 0."""
        if self.mixup_alpha <= 0 and self.cutmix_alpha <= 0:
            return None
        return Mixup(**dataclasses.asdict(self), label_smoothing=label_smoothing, num_classes=num_classes)


class ImageClassificationFineTuning(FineTuningTask):
    """Fine-tune a multiway backbone as an image classifier (BEiT-3's ImageNet-1K recipe).

    Batches (:class:`mmoe.data.datamodules.ClassificationDataModule`): ``image`` (B, 3, S, S), ``label`` (B,) long,
    ``key`` (list of the samples' keys).

    Args:
        classes: the split's ``classes.json`` (:func:`mmoe.data.classification.read_classes`): the number of classes,
            and the WordNet ids and names of predictions.
        predictions_file: where ``mmoe predict`` writes its JSON list ``[{"key", "image", "labels", "wnids", "names",
            "probabilities"}]`` (atomically; ``image``: the file name without suffix, ImageNet's image id). None = not
            written.
        top_k: classes per image in predictions (and ``mmoe infer classify``'s default).
        head_init_scale: factor on the head's initial linear weight and bias (BEiT-3: 1e-3, for a pre-trained
            backbone).
        mixup: timm's Mixup / CutMix (:class:`MixupConfig`); None = off.
        label_smoothing: BEiT-3's 0.1; folded into Mixup's soft targets when mixing, else the smoothed loss's.
        ema_decay: decay of timm's ``ModelEmaV3`` over the task's weights (BEiT-3's ``--model_ema_decay`` 0.9999);
            None = no EMA (BEiT-3's recipes).
        **kwargs: the shared fine-tuning arguments of :class:`mmoe.tasks.finetuning.FineTuningTask` (backbone,
            pretrained, frozen_routing, balance and optimiser settings).
    """

    name = "imagenet"
    beit3_heads = {"fc_norm.": "fc_norm.", "head.": "head."}
    prediction_key = "key"
    file_arguments = ("classes", "text_tokenizer")
    output_norm = False

    def __init__(
        self,
        classes: str,
        predictions_file: str | None = None,
        top_k: int = 5,
        head_init_scale: float = BEIT3_HEAD_INIT_SCALE,
        mixup: MixupConfig | None = None,
        label_smoothing: float = 0.1,
        ema_decay: float | None = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if top_k < 1:
            raise ValueError(f"model.top_k must be >= 1, got {top_k!r}")
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"model.label_smoothing must lie in [0, 1), got {label_smoothing!r}")
        if ema_decay is not None and not 0.0 < ema_decay < 1.0:
            raise ValueError(f"model.ema_decay must lie in (0, 1) or be null, got {ema_decay!r}")
        self.predictions_file = predictions_file
        self.top_k = top_k
        self.classes = read_classes(classes)
        config = self.backbone.config
        self.fc_norm, self.head = classification_head(
            config.dim, len(self.classes), config.layernorm_eps, head_init_scale
        )
        if isinstance(mixup, dict):  # a checkpoint's saved hyper-parameter
            mixup = MixupConfig(**mixup)
        self.mixup = None if mixup is None else mixup.timm_mixup(label_smoothing, len(self.classes))
        if mixup is not None:
            self.hparams.mixup = dataclasses.asdict(mixup)  # checkpoints hold plain values (weights_only loading)
        self.train_loss: nn.Module = (
            SoftTargetCrossEntropy()
            if self.mixup is not None
            else LabelSmoothingCrossEntropy(label_smoothing)
            if label_smoothing > 0
            else nn.CrossEntropyLoss()
        )
        self.ema = EmaWeights(ema_decay) if ema_decay is not None else None
        self.load_beit3_head()

    @classmethod
    def head_parameters(cls, config: MultiwayConfig, init_args: dict[str, Any]) -> dict[str, int]:
        """``fc_norm``'s scale and shift (2 D) and ``head``'s weight and bias ((D + 1) x classes)."""
        classes = len(read_classes(required_argument(init_args, "classes")))
        return {"head": 2 * config.dim + (config.dim + 1) * classes}

    def image_transform(self) -> Callable[[Image.Image], torch.Tensor]:
        """timm's evaluation transform at the backbone's size, ImageNet's mean and std (the DataModule's, at its
        default ``eval_crop_pct`` 1)."""
        return eval_transform(self.backbone.config.image_size)

    def parts(self) -> nn.ModuleDict:
        """The task's weights as one module (backbone, ``fc_norm``, ``head``): what the EMA averages."""
        return nn.ModuleDict({"backbone": self.backbone, "fc_norm": self.fc_norm, "head": self.head})

    def evaluated_parts(self) -> nn.ModuleDict:
        """The weights evaluation and prediction use: the EMA's when on, else the task's own."""
        return self.parts() if self.ema is None else self.ema.averaged(self.parts())

    def forward(self, image: torch.Tensor, parts: nn.ModuleDict | None = None):
        """(B, classes) logits of an image-only pass, and its routing records (``parts``: other weights of the same
        shapes, e.g. the EMA's; default the task's own)."""
        parts = self.parts() if parts is None else parts
        out = parts["backbone"](image=image)
        pooled = out.hidden[:, 1:].mean(dim=1)  # the patch tokens; BEiT-3 leaves the CLS out
        return parts["head"](parts["fc_norm"](pooled)), out.routing

    def forward_batch(self, batch: dict) -> tuple[torch.Tensor, list[RoutingRecord]]:
        return self(batch["image"], None if self.training else self.evaluated_parts())

    def task_loss(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        if "targets" in batch:  # mixed by timm's Mixup: soft targets
            return self.train_loss(logits.float(), batch["targets"])
        if self.training:
            return self.train_loss(logits.float(), batch["label"])
        return F.cross_entropy(logits.float(), batch["label"])

    def training_step(self, batch: dict, batch_idx: int) -> dict:
        if self.mixup is not None:
            if len(batch["image"]) % 2:
                raise ValueError(
                    f"Mixup / CutMix need an even batch size, got {len(batch['image'])}: set data.init_args.batch_size"
                )
            image, targets = self.mixup(batch["image"], batch["label"])
            batch = {**batch, "image": image, "targets": targets}
        return super().training_step(batch, batch_idx)

    def optimizer_step(self, *args, **kwargs) -> None:
        super().optimizer_step(*args, **kwargs)
        if self.ema is not None:
            self.ema.update(self.parts())

    def ranked(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(probabilities, class indices) of each image's ``k`` most probable classes (fewer when the classes are)."""
        return logits.float().softmax(dim=-1).topk(min(k, logits.shape[-1]), dim=-1)

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        _, _, logits = self.shared_step(batch, "val")
        _, indices = self.ranked(logits, max(TOP_K))
        for row, label in zip(indices.tolist(), batch["label"].tolist(), strict=True):
            self.validation_outputs.append({"ranked": row, "label": label})

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()
        outputs = self.gathered_validation_outputs()
        if not outputs:
            return
        scores = top_k_accuracy([o["ranked"] for o in outputs], [o["label"] for o in outputs])
        self.log_dict({f"val/{name}_accuracy": value for name, value in scores.items()})

    def prediction_entries(self, batch: dict) -> list[dict]:
        """Per image: its ``key``, its file ``name`` (:class:`mmoe.data.classification.ClassificationDecoder`), its
        ``top_k`` classes (``labels``, ``wnids``, ``names``) and their ``probabilities``, best first."""
        logits, _ = self.forward_batch(batch)
        probabilities, indices = self.ranked(logits, self.top_k)
        names = batch.get("name") or batch["key"]
        rows = zip(batch["key"], names, indices.tolist(), probabilities.tolist(), strict=True)
        return [{"key": key, "image": name, **self.described(row, values)} for key, name, row, values in rows]

    def described(self, indices: list[int], probabilities: list[float]) -> dict[str, list]:
        """The classes ``indices`` as a predictions entry names them, with their ``probabilities``."""
        return {
            "labels": indices,
            "wnids": [self.classes[i].wnid for i in indices],
            "names": [self.classes[i].name for i in indices],
            "probabilities": [round(p, 6) for p in probabilities],
        }

    @classmethod
    def evaluated_weights(cls, checkpoint: dict) -> dict[str, torch.Tensor]:
        """The checkpoint's EMA of the weights where its fit kept one (validation and ``mmoe predict`` use it), else
        its trained weights."""
        return checkpoint["state_dict"] | (checkpoint.get(EMA_KEY) or {})

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        if self.ema is not None:
            self.ema.save(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        if self.ema is not None:
            self.ema.load(checkpoint)
