"""VQAv2 fine-tuning: answer classification over the training answer vocabulary (BEiT-3, Wang et al., 2023, §3.1;
unilm ``BEiT3ForVisualQuestionAnswering``).

Image and question go through the backbone as one sequence; the fused representation is the vision CLS token after
BEiT-3's pooler (LayerNorm -> Linear(D, D) -> tanh), classified by Linear(D, 2D) -> LayerNorm -> GELU ->
Linear(2D, num_answers). Targets are soft VQA scores (0.3 / 0.6 / 0.9 / 1.0 for 1 / 2 / 3 / >= 4 of the ten
annotators, computed by :mod:`mmoe.data`); the loss is BEiT-3's ``BCEWithLogitsLoss`` mean times the number of answers
(a sum over answers, a mean over questions).

Validation reports two numbers: ``val/vqa_accuracy``, the official VQA accuracy (:func:`mmoe.metrics.vqa.vqa_accuracy`)
of the predicted answer string against the ten human answers, overall and per answer type; and ``val/vqa_score``, the
soft target of the argmax class (BEiT-3's in-training ``VQAScore``, which is lower when the right answer is outside the
vocabulary). ``mmoe predict`` writes the test-dev submission ``[{"question_id", "answer"}]``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from mmoe.data.answers import read_answer_vocab
from mmoe.data.batches import VQABatch
from mmoe.metrics.vqa import vqa_accuracy
from mmoe.model import MultiwayConfig
from mmoe.model.heads import vqa_pooler_and_head
from mmoe.moe import RoutingRecord
from mmoe.runtime.predictions import as_ids
from mmoe.tasks.finetuning import FineTuningTask, required_argument


class VQAFineTuning(FineTuningTask):
    """Fine-tune a multiway backbone on VQAv2 (soft-target answer classification).

    Batches (:class:`mmoe.data.collate.VQACollator`): ``image``, ``text_ids``, ``text_padding_mask``, ``targets``
    (B, num_answers) soft scores for training; ``answers`` (ten raw human answers) and ``answer_type`` for the
    validation accuracy; ``question_id`` for predictions.

    Args:
        answer_vocab: the training answer vocabulary, ``answers.json`` written by ``mmoe data convert vqav2``, read
            by :func:`mmoe.data.answers.read_answer_vocab` (a JSON list, index = class label, or an object answer ->
            label), as the DataModule reads it.
        predictions_file: where ``mmoe predict`` writes the submission ``[{"question_id", "answer"}]`` (atomically;
            one entry per question id). None = not written.
        prior_bias: start the classifier's output biases at the log-odds of a uniform answer prior, -log(K - 1) for
            K answers (RetinaNet's prior initialisation for sigmoid classifiers with many negatives, Lin et al., 2017,
            §4.1), instead of BEiT-3's zero. With zero biases every one of the K sigmoids starts at 0.5 and the first
            steps' gradient pushes the whole network to lower all logits at once (tasks/vqav2/README.md). A BEiT-3
            head loaded from a released file keeps its biases.
        **kwargs: the shared fine-tuning arguments of :class:`mmoe.tasks.finetuning.FineTuningTask` (backbone,
            pretrained, frozen_routing, balance and optimiser settings).
    """

    name = "vqav2"
    beit3_heads = {
        "pooler.norm.": "pooler.norm.",
        "pooler.dense.": "pooler.dense.",
        "head.0.": "head.0.",
        "head.1.": "head.1.",
        "head.3.": "head.3.",
    }
    prediction_key = "question_id"
    file_arguments = ("answer_vocab", "text_tokenizer")

    def __init__(
        self, answer_vocab: str, predictions_file: str | None = None, prior_bias: bool = False, **kwargs
    ) -> None:
        super().__init__(**kwargs)
        self.predictions_file = predictions_file
        self.answers = read_answer_vocab(answer_vocab)
        config = self.backbone.config
        self.pooler, self.head = vqa_pooler_and_head(config.dim, len(self.answers), config.layernorm_eps)
        if prior_bias and len(self.answers) > 1:
            torch.nn.init.constant_(self.head[-1].bias, -math.log(len(self.answers) - 1))
        self.load_beit3_head()

    @classmethod
    def head_parameters(cls, config: MultiwayConfig, init_args: dict[str, Any]) -> dict[str, int]:
        answers = len(read_answer_vocab(required_argument(init_args, "answer_vocab")))
        return {
            "head": sum(p.numel() for module in vqa_pooler_and_head(config.dim, answers) for p in module.parameters())
        }

    def forward(self, image: torch.Tensor, text: torch.Tensor, text_padding_mask: torch.Tensor | None = None):
        """(B, num_answers) logits and the routing records."""
        out = self.backbone(image=image, text=text, text_padding_mask=text_padding_mask)
        return self.head(self.pooler(out.hidden[:, 0])), out.routing  # vision CLS

    def forward_batch(self, batch: VQABatch) -> tuple[torch.Tensor, list[RoutingRecord]]:
        return self(batch["image"], batch["text_ids"], batch.get("text_padding_mask"))

    def task_loss(self, logits: torch.Tensor, batch: VQABatch) -> torch.Tensor:
        targets = batch["targets"]
        return F.binary_cross_entropy_with_logits(logits.float(), targets.float()) * targets.shape[1]

    def predicted_answers(self, logits: torch.Tensor) -> list[str]:
        return [self.answers[index] for index in logits.argmax(dim=-1).tolist()]

    def validation_step(self, batch: VQABatch, batch_idx: int) -> None:
        if "targets" in batch:
            _, _, logits = self.shared_step(batch, "val")
            score = batch["targets"].gather(1, logits.argmax(dim=-1, keepdim=True)).float().mean()
            self.log("val/vqa_score", 100 * score, batch_size=len(logits), sync_dist=True)
        else:
            logits, _ = self.forward_batch(batch)
        humans = batch.get("answers")
        if not humans:
            return
        types = batch.get("answer_type") or [""] * len(humans)
        for prediction, answers, answer_type in zip(self.predicted_answers(logits), humans, types, strict=True):
            if answers:
                self.validation_outputs.append({"accuracy": vqa_accuracy(prediction, answers), "type": answer_type})

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()
        outputs = self.gathered_validation_outputs()
        if not outputs:
            return
        log = {"val/vqa_accuracy": 100 * sum(o["accuracy"] for o in outputs) / len(outputs)}
        for answer_type in sorted({o["type"] for o in outputs if o["type"]}):
            scores = [o["accuracy"] for o in outputs if o["type"] == answer_type]
            log[f"val/vqa_accuracy_{answer_type.replace('/', '_')}"] = 100 * sum(scores) / len(scores)
        self.log_dict(log)

    def prediction_entries(self, batch: VQABatch) -> list[dict]:
        """``{"question_id", "answer"}`` per question: the test-dev submission's entries."""
        logits, _ = self.forward_batch(batch)
        answers = self.predicted_answers(logits)
        return [
            {"question_id": qid, "answer": answer}
            for qid, answer in zip(as_ids(batch["question_id"]), answers, strict=True)
        ]
