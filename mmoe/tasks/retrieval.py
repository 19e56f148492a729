"""Image-text retrieval, a dual encoder over one multiway backbone (BEiT-3, Wang et al., 2023, §3.1 "image-text
retrieval"; unilm ``BEiT3ForRetrieval``).

* An image-only pass (every token through the vision experts) and a text-only pass (through the language experts) of
  the same backbone; the vision CLS (first image token) and the language CLS (first text token, the start-of-text
  token) are projected by ``vision_head`` / ``language_head``, Linear(D, D) without bias, and L2-normalised.
* Loss: CLIP's symmetric contrastive loss (Radford et al., 2021, Fig. 3) over the global batch, as BEiT-3's
  ``ClipLoss``: logits = exp(t) * v_i . l_j with a learnable t initialised to log(1 / 0.07); the mean of the
  cross-entropy over images (each against every text) and over texts (each against every image), the positive of row
  i being column i. Under data parallelism each process gathers every process's embeddings with their gradients
  (:func:`gather_with_grad`) and computes the global loss, so its gradients equal one process's on the global batch
  once the data-parallel average is taken. BEiT-3 does not bound t; ``max_logit_scale`` can (CLIP clamps exp(t) at
  100).
* The balance losses and routing records of both passes enter the objective and the callbacks (X-MoE Eq. 10).
* Validation embeds every image and every caption of the split and logs image -> text and text -> image R@1/5/10 and
  their mean (:mod:`mmoe.metrics.retrieval`). ``mmoe predict`` writes the embeddings file ``mmoe eval retrieval``
  scores (:func:`stack_embeddings`, :func:`mmoe.metrics.retrieval.score_embeddings`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mmoe.atomic import atomic_write
from mmoe.data.batches import RetrievalBatch
from mmoe.data.collate import RetrievalCollator
from mmoe.data.tokenizer import TextTokenizer
from mmoe.metrics.retrieval import score_embeddings
from mmoe.model import MultiwayConfig
from mmoe.model.heads import LOG_LOGIT_SCALE_INIT, retrieval_heads
from mmoe.moe import RoutingRecord
from mmoe.runtime.predictions import as_ids
from mmoe.tasks.base import StepLosses, batch_size
from mmoe.tasks.finetuning import FineTuningTask


def gather_with_grad(local_BD: torch.Tensor) -> torch.Tensor:
    """(sum of B over processes, D): every process's ``local_BD`` in rank order, differentiable (the backward sums
    each process's gradient into the process that owns the rows); ``local_BD`` itself when not distributed. The
    processes' B may differ (a short last batch): rows are padded to the largest for the exchange and dropped
    after."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return local_BD
    if torch.distributed.get_world_size() == 1:
        return local_BD
    from torch.distributed.nn.functional import all_gather

    world = torch.distributed.get_world_size()
    sizes = [torch.zeros((), dtype=torch.long, device=local_BD.device) for _ in range(world)]
    torch.distributed.all_gather(sizes, torch.tensor(len(local_BD), device=local_BD.device))
    largest = int(max(sizes))
    padded = F.pad(local_BD, (0, 0, 0, largest - len(local_BD)))
    parts = all_gather(padded)
    return torch.cat([part[: int(size)] for part, size in zip(parts, sizes, strict=True)], dim=0)


def contrastive_loss(image_BD: torch.Tensor, text_BD: torch.Tensor, logit_scale: torch.Tensor) -> torch.Tensor:
    """CLIP's symmetric cross-entropy (BEiT-3 ``ClipLoss``): row i of ``image_BD`` and of ``text_BD`` are a pair,
    every other row a negative; ``logit_scale`` multiplies the dot products (exp(t), not t)."""
    logits_BB = logit_scale * image_BD.float() @ text_BD.float().T
    labels = torch.arange(len(logits_BB), device=logits_BB.device)
    return (F.cross_entropy(logits_BB, labels) + F.cross_entropy(logits_BB.T, labels)) / 2


class RetrievalFineTuning(FineTuningTask):
    """Fine-tune a multiway backbone as a dual encoder for image-text retrieval (BEiT-3 ``BEiT3ForRetrieval``).

    Batches (:class:`mmoe.data.datamodules.RetrievalDataModule`): training ``image`` (B, 3, S, S) with one caption
    each in ``text_ids`` / ``text_padding_mask`` (B, T); evaluation every caption of the batch's images,
    ``caption_image`` naming each caption's image row.

    Args:
        predictions_file: where ``mmoe predict`` writes the embeddings of the split's images and captions (a torch
            file, :func:`stack_embeddings`; atomically), the input of ``mmoe eval retrieval``. None = not written.
        max_logit_scale: upper bound of exp(t) in the loss (CLIP: 100); None = unbounded, as BEiT-3.
        eval_chunk: queries scored at once in validation (bounds its memory, :mod:`mmoe.metrics.retrieval`).
        **kwargs: the shared fine-tuning arguments of :class:`mmoe.tasks.finetuning.FineTuningTask` (backbone,
            pretrained, frozen_routing, balance and optimiser settings).
    """

    name = "retrieval"
    beit3_heads = {"vision_head.": "vision_head.", "language_head.": "language_head.", "logit_scale": "logit_scale"}
    #: Prediction entries are ``(image_id, image embedding, caption embeddings, captions)`` tuples.
    prediction_key = 0
    #: The projections get ``optimizer.head_lr_multiplier`` (BEiT-3's ``--task_head_lr_weight``).
    head_prefixes = ("vision_head.", "language_head.")

    def __init__(
        self,
        predictions_file: str | None = None,
        max_logit_scale: float | None = None,
        eval_chunk: int = 1024,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if max_logit_scale is not None and max_logit_scale <= 0:
            raise ValueError(f"model.max_logit_scale must be > 0 or null, got {max_logit_scale!r}")
        if eval_chunk < 1:
            raise ValueError(f"model.eval_chunk must be >= 1, got {eval_chunk!r}")
        self.predictions_file = predictions_file
        self.max_logit_scale = max_logit_scale
        self.eval_chunk = eval_chunk
        self.vision_head, self.language_head = retrieval_heads(self.backbone.config.dim)
        self.logit_scale = nn.Parameter(torch.tensor(LOG_LOGIT_SCALE_INIT))
        self._text_tokenizer: TextTokenizer | None = None
        self.load_beit3_head()

    @classmethod
    def head_parameters(cls, config: MultiwayConfig, init_args: dict[str, Any]) -> dict[str, int]:
        """One projection per embedding (an image's, a text's), and the logit scale (one multiply per image-text
        score)."""
        vision, language = retrieval_heads(config.dim)
        return {"vision_head": vision.weight.numel(), "language_head": language.weight.numel(), "logit_scale": 1}

    @classmethod
    def head_of(cls, key: str) -> str:
        return key.split(".", 1)[0]

    def scale(self) -> torch.Tensor:
        """exp(t), bounded by ``max_logit_scale`` when set."""
        scale = self.logit_scale.float().exp()
        return scale if self.max_logit_scale is None else scale.clamp(max=self.max_logit_scale)

    def embed_images(self, image: torch.Tensor) -> tuple[torch.Tensor, list[RoutingRecord]]:
        """(B, D) L2-normalised image embeddings from an image-only pass, and its routing records."""
        out = self.backbone(image=image)
        return F.normalize(self.vision_head(out.hidden[:, 0]), dim=-1), out.routing  # vision CLS

    def embed_texts(
        self, text: torch.Tensor, text_padding_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[RoutingRecord]]:
        """(B, D) L2-normalised text embeddings from a text-only pass, and its routing records."""
        out = self.backbone(text=text, text_padding_mask=text_padding_mask)
        return F.normalize(self.language_head(out.hidden[:, 0]), dim=-1), out.routing  # language CLS

    def forward(self, image, text, text_padding_mask=None):
        """(image embeddings, text embeddings, the routing records of the image pass then the text pass)."""
        image_BD, image_routing = self.embed_images(image)
        text_BD, text_routing = self.embed_texts(text, text_padding_mask)
        return image_BD, text_BD, image_routing + text_routing

    def step_losses(self, batch: RetrievalBatch) -> StepLosses:
        """The contrastive loss over the global batch (``task_loss``) and exp(t) (``logit_scale``), logged."""
        image_BD, text_BD, routing = self(batch["image"], batch["text_ids"], batch.get("text_padding_mask"))
        scale = self.scale()
        loss = contrastive_loss(gather_with_grad(image_BD), gather_with_grad(text_BD), scale)
        return StepLosses(loss, {"task_loss": loss, "logit_scale": scale}, routing, batch_size(batch))

    @torch.no_grad()
    def batch_embeddings(self, batch: RetrievalBatch) -> list[tuple[int, torch.Tensor, torch.Tensor, list[str]]]:
        """``(image_id, image embedding (D,), its captions' embeddings (k, D), its captions)`` per image of an
        evaluation batch, on the CPU."""
        image_BD, _ = self.embed_images(batch["image"])
        text_MD, _ = self.embed_texts(batch["text_ids"], batch.get("text_padding_mask"))
        image_BD, text_MD = image_BD.float().cpu(), text_MD.float().cpu()
        rows = batch["caption_image"].cpu()
        captions = batch.get("captions") or [[""] * int((rows == b).sum()) for b in range(len(image_BD))]
        return [
            (image_id, image_BD[b], text_MD[rows == b], list(captions[b]))
            for b, image_id in enumerate(as_ids(batch["image_id"]))
        ]

    def validation_step(self, batch: RetrievalBatch, batch_idx: int) -> None:
        self.validation_outputs.extend(self.batch_embeddings(batch))

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()
        entries = self.gathered_validation_outputs()
        if not entries:
            return
        scores = score_embeddings(stack_embeddings(entries), self.eval_chunk)[0]
        self.log_dict({f"val/{name}": value for name, value in scores.items()})

    def prediction_entries(self, batch: RetrievalBatch) -> list:
        if "caption_ids" in batch:  # one decoded sample (``mmoe infer --shards``): its captions not yet collated
            items = [{"caption_ids": ids} for ids in batch.pop("caption_ids")]
            collated = RetrievalCollator(self.text_tokenizer())(items, None)
            batch = {**batch, **{key: value.to(self.device) for key, value in collated.items()}}
        return self.batch_embeddings(batch)

    def text_tokenizer(self) -> TextTokenizer:
        """The tokenizer of the task's texts (its ``text_tokenizer``; open_clip's BPE by default)."""
        if self._text_tokenizer is None:
            self._text_tokenizer = TextTokenizer(sentencepiece=self.hparams.get("text_tokenizer"))
        return self._text_tokenizer

    def write_predictions(self, entries: list, path: str | Path) -> None:
        """Writes the embeddings file of ``entries`` (:func:`stack_embeddings`) to ``path`` atomically."""
        embeddings = stack_embeddings(entries)
        atomic_write(path, lambda temporary: torch.save(embeddings, temporary))


def stack_embeddings(entries: list) -> dict[str, Any]:
    """The embeddings file's content from ``(image_id, image (D,), captions (k, D), caption texts)`` entries (one per
    image, the first of each id kept): ``image_ids`` (N,) long, ``image_embeddings`` (N, D), ``caption_image_ids``
    (M,) long, ``caption_embeddings`` (M, D), ``captions`` (M strings)."""
    seen: dict[int, tuple] = {}
    for entry in entries:
        seen.setdefault(int(entry[0]), entry)
    kept = list(seen.values())
    width = kept[0][1].shape[-1] if kept else 0
    return {
        "image_ids": torch.tensor([entry[0] for entry in kept], dtype=torch.long),
        "image_embeddings": torch.stack([entry[1] for entry in kept]) if kept else torch.zeros(0, width),
        "caption_image_ids": torch.tensor([entry[0] for entry in kept for _ in entry[3]], dtype=torch.long),
        "caption_embeddings": torch.cat([entry[2] for entry in kept]) if kept else torch.zeros(0, width),
        "captions": [caption for entry in kept for caption in entry[3]],
    }
