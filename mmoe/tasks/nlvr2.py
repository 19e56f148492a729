"""NLVR2 fine-tuning: is a sentence true of a pair of images? (BEiT-3, Wang et al., 2023, §3.1; unilm
``BEiT3ForVisualReasoning``).

Each image is paired with the sentence and the two pairs run through the backbone as one doubled batch
``[left images; right images]``. Each pass gives its vision CLS (the first image token) and its language CLS (the
first text token, the start-of-text token); the two passes' ``[vision CLS, language CLS]`` are concatenated (4D) and
classified by BEiT-3's two-layer MLP: LayerNorm(4D) -> Linear(4D, 2D) -> LayerNorm(2D) -> GELU -> Linear(2D, 2),
with its linear layers' initial weights scaled by ``head_init_scale`` (BEiT-3: 1e-3). Cross-entropy on the label
(1 = true).

Validation logs accuracy and consistency (:func:`mmoe.metrics.nlvr2.nlvr2_scores`: a group is the identifier with its
pair id blanked). ``mmoe predict`` writes ``identifier,prediction`` lines (``True`` / ``False``), the file
``mmoe eval nlvr2`` reads.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn

from mmoe.data.batches import NLVR2Batch
from mmoe.metrics.files import EvalInputError
from mmoe.metrics.nlvr2 import nlvr2_scores
from mmoe.model import MultiwayConfig
from mmoe.model.heads import BEIT3_HEAD_INIT_SCALE, nlvr2_head
from mmoe.moe import RoutingRecord
from mmoe.tasks.finetuning import FineTuningTask

__all__ = ["BEIT3_HEAD_INIT_SCALE", "NLVR2FineTuning", "labels_of"]


class NLVR2FineTuning(FineTuningTask):
    """Fine-tune a multiway backbone on NLVR2 (binary classification of a sentence over two images).

    Batches (:class:`mmoe.data.decoders.NLVR2Decoder` + :class:`mmoe.data.collate.PlainCollator`): ``image_left``,
    ``image_right`` (B, 3, H, W), ``text_ids``, ``text_padding_mask``, ``label`` (B,) long (1 true, 0 false, -1
    unknown) and ``identifier`` (list of strings).

    Args:
        predictions_file: where ``mmoe predict`` writes ``identifier,prediction`` lines (atomically). None = not
            written.
        head_init_scale: factor on the MLP's initial linear weights and biases. BEiT-3's 1e-3 suits a pre-trained
            backbone; from scratch it stalls learning (tiny X-MoE on the synthetic corpus: tasks/nlvr2/README.md
            gives the measurement), so the tiny configs use 1.0.
        **kwargs: the shared fine-tuning arguments of :class:`mmoe.tasks.finetuning.FineTuningTask` (backbone,
            pretrained, frozen_routing, balance and optimiser settings).
    """

    name = "nlvr2"
    beit3_heads = {
        "head.norm1.": "head.0.",
        "head.dense1.": "head.1.",
        "head.norm2.": "head.2.",
        "head.dense2.": "head.4.",
    }
    #: Prediction entries are ``(identifier, prediction)`` tuples.
    prediction_key = 0

    def __init__(
        self, predictions_file: str | None = None, head_init_scale: float = BEIT3_HEAD_INIT_SCALE, **kwargs
    ) -> None:
        super().__init__(**kwargs)
        self.predictions_file = predictions_file
        self.head = nlvr2_head(self.backbone.config.dim, self.backbone.config.layernorm_eps, head_init_scale)
        self.load_beit3_head()

    @classmethod
    def head_parameters(cls, config: MultiwayConfig, init_args: dict[str, Any]) -> dict[str, int]:
        return {"head": sum(p.numel() for p in nlvr2_head(config.dim).parameters())}

    def pair_features(
        self,
        image_left: torch.Tensor,
        image_right: torch.Tensor,
        text: torch.Tensor,
        text_padding_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[RoutingRecord]]:
        """(B, 4D) ``[vision CLS, language CLS]`` of the left pass, then of the right pass, from one backbone pass
        over the doubled batch; and the routing records."""
        batch = image_left.shape[0]
        padding = None if text_padding_mask is None else torch.cat([text_padding_mask, text_padding_mask])
        out = self.backbone(
            image=torch.cat([image_left, image_right]), text=torch.cat([text, text]), text_padding_mask=padding
        )
        cls_2BD = torch.cat([out.hidden[:, 0], out.hidden[:, out.image_len]], dim=-1)  # vision CLS, language CLS
        return torch.cat([cls_2BD[:batch], cls_2BD[batch:]], dim=-1), out.routing

    def forward(self, image_left, image_right, text, text_padding_mask=None):
        """(B, 2) logits (index 1 = true) and the routing records."""
        features, routing = self.pair_features(image_left, image_right, text, text_padding_mask)
        return self.head(features), routing

    def forward_batch(self, batch: NLVR2Batch) -> tuple[torch.Tensor, list[RoutingRecord]]:
        return self(batch["image_left"], batch["image_right"], batch["text_ids"], batch.get("text_padding_mask"))

    def task_loss(self, logits: torch.Tensor, batch: NLVR2Batch) -> torch.Tensor:
        return F.cross_entropy(logits.float(), labels_of(batch))

    def validation_step(self, batch: NLVR2Batch, batch_idx: int) -> None:
        _, _, logits = self.shared_step(batch, "val")
        predicted = logits.argmax(dim=-1)
        for identifier, guess, label in zip(
            batch["identifier"], predicted.tolist(), labels_of(batch).tolist(), strict=True
        ):
            self.validation_outputs.append({"identifier": identifier, "prediction": bool(guess), "label": bool(label)})

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()
        outputs = {o["identifier"]: o for o in self.gathered_validation_outputs()}
        if not outputs:
            return
        labels = {i: o["label"] for i, o in outputs.items()}
        predictions = {i: o["prediction"] for i, o in outputs.items()}
        try:
            scores = nlvr2_scores(labels, predictions)
        except EvalInputError as error:  # identifiers not of the official form: no consistency groups
            rank_zero_warn(f"NLVR2 consistency not computed: {error}")
            correct = sum(labels[i] == predictions[i] for i in labels)
            scores = {"accuracy": correct / len(labels)}
        self.log_dict({f"val/{name}": value for name, value in scores.items()})

    def prediction_entries(self, batch: NLVR2Batch) -> list[tuple[str, bool]]:
        """``(identifier, prediction)`` per pair (True: the sentence is true of the pair)."""
        logits, _ = self.forward_batch(batch)
        return list(zip(batch["identifier"], (logits.argmax(dim=-1) == 1).tolist(), strict=True))

    def format_predictions(self, entries: list[tuple[str, bool]]) -> str:
        """``identifier,True|False`` lines, the file ``mmoe eval nlvr2`` reads."""
        return "\n".join(f"{identifier},{prediction}" for identifier, prediction in entries) + "\n"


def labels_of(batch: NLVR2Batch) -> torch.Tensor:
    """The batch's labels (1 true, 0 false); an unlabelled pair (label -1, e.g. from a hidden test split) cannot be
    trained or scored on and is an error naming it."""
    labels = batch["label"]
    unlabelled = [batch["identifier"][i] for i in (labels < 0).nonzero().flatten().tolist()]
    if unlabelled:
        raise ValueError(
            f"NLVR2 pairs without a label cannot be trained or scored on: {', '.join(unlabelled[:5])}"
            f"{' ...' if len(unlabelled) > 5 else ''} (give labelled shards as train_shards / val_shards)"
        )
    return labels
