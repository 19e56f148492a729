"""Zero-shot probes of a pre-training run, measured at validation on the held-out image-text pairs (the validation
pair stream; open_clip evaluates zero-shot while it trains in the same spirit).

Each pair's image goes through an image-only pass and its (unmasked) caption through a text-only pass of the
backbone; both become one L2-normalised vector each:

* with the contrastive loss on (``contrastive_coefficient > 0``): the vision / language CLS through BEiT-3's
  retrieval projections (``vision_head``, ``language_head``), what :func:`mmoe.tasks.retrieval.contrastive_loss` scores;
* with it off: the mean of the image's patch tokens and the mean of the caption's non-padding tokens. No head is
  trained to align them, so their cosine measures only what masked data modelling aligns by itself.

Two probes over the first ``pairs`` held-out pairs, N of them (``val/probe/pairs``):

* **Matching** (``val/probe/i2t_r1``, ``i2t_r5``, ``t2i_r1``, ``t2i_r5``; ``pooled_`` before each with the pooled
  vectors): image -> text and text -> image recall at 1 and 5 among the N pairs, each pair's own caption (image) the
  one positive, ties counted against the query (:mod:`mmoe.metrics.retrieval`). Chance: K / N for R@K.
* **Attributes** (``val/probe/color_acc``, ``val/probe/shape_acc``): zero-shot classification of the colour and the
  shape of the image's first object among the synthetic world's classes (:mod:`mmoe.data.synth.scenes`: 6 colours,
  4 shapes). A class's vector is the normalised mean of its prompts' text vectors (CLIP's prompt ensembling): the
  prompts ``a <colour> <shape>`` over the other attribute's classes ("a red circle", "a red square", ... for red).
  An image is assigned the class of highest cosine. Chance: 1 / number of classes (1/6, 1/4): the corpus draws every
  attribute uniformly and independently, so that is also the expected share of the commonest class.

The label is read from the pair's caption, the corpus's own record of a scene: the first colour word and the first
shape word it names. The synthetic corpus's validation pairs (Karpathy val) carry each image's first caption, which
always lists the objects top to bottom (:func:`mmoe.data.synth.language.captions`), so that is the top object's
colour and shape. A caption naming no colour (shape) leaves its pair out of that accuracy; with none left, the
accuracy is not logged.

The first process alone probes (its own first pairs) and logs; the others run no probe forward.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from mmoe.data.batches import PAIR, PretrainBatch
from mmoe.data.synth.scenes import COLORS, SHAPES
from mmoe.data.tokenizer import TextTokenizer
from mmoe.metrics.retrieval import image_to_text_ranks, text_to_image_ranks
from mmoe.model import MultiwayTransformer

__all__ = [
    "ATTRIBUTE_CLASSES",
    "DEFAULT_PROBE_PAIRS",
    "PREFIX",
    "ProbeEncoder",
    "ProbeEmbeddings",
    "ZeroShotProbeCollector",
    "caption_labels",
    "class_prompts",
    "probe_chance",
    "probe_metrics",
]

#: The attributes probed and their class names, in label order.
ATTRIBUTE_CLASSES: dict[str, tuple[str, ...]] = {"color": tuple(COLORS), "shape": SHAPES}

#: The logged keys' prefix.
PREFIX = "val/probe/"

#: Recall is reported at these ranks.
PROBE_RECALL_AT = (1, 5)

#: Pairs probed per validation by default (``MaskedPretraining(probe_pairs=)``).
DEFAULT_PROBE_PAIRS = 128


@dataclass
class ProbeEmbeddings:
    """What the probes score: N pairs' L2-normalised vectors and labels, and each attribute's class vectors.

    Attributes:
        image_ND: the images' vectors.
        text_ND: their captions' vectors.
        labels: attribute -> (N,) long class index of each pair's image (-1: the caption names none).
        classes: attribute -> (C, D) class vectors.
        pooled: whether the vectors are pooled features (contrastive loss off) rather than the retrieval heads'.
    """

    image_ND: torch.Tensor
    text_ND: torch.Tensor
    labels: dict[str, torch.Tensor]
    classes: dict[str, torch.Tensor]
    pooled: bool


_WORD = re.compile(r"[a-z]+")


def caption_labels(caption: str) -> dict[str, int]:
    """Attribute -> class index of the first colour / shape word of ``caption`` (-1 when it names none)."""
    words = _WORD.findall(caption.lower())
    labels = {}
    for attribute, names in ATTRIBUTE_CLASSES.items():
        labels[attribute] = next((names.index(word) for word in words if word in names), -1)
    return labels


def class_prompts(attribute: str) -> list[list[str]]:
    """The prompts of each class of ``attribute``: ``a <colour> <shape>`` over every class of the other attribute."""
    if attribute not in ATTRIBUTE_CLASSES:
        raise ValueError(f"no zero-shot attribute {attribute!r}; expected one of {sorted(ATTRIBUTE_CLASSES)}")
    if attribute == "color":
        return [[f"a {color} {shape}" for shape in SHAPES] for color in ATTRIBUTE_CLASSES["color"]]
    return [[f"a {color} {shape}" for color in ATTRIBUTE_CLASSES["color"]] for shape in SHAPES]


@dataclass
class ProbeEncoder:
    """The backbone passes that turn images and token ids into the probes' vectors (see the module docstring).

    Attributes:
        backbone: the pre-trained backbone.
        vision_head: the vision CLS projection (None: mean-pooled patches, no head).
        language_head: the language CLS projection (None: mean-pooled tokens).
    """

    backbone: MultiwayTransformer
    vision_head: nn.Module | None = None
    language_head: nn.Module | None = None

    @property
    def pooled(self) -> bool:
        return self.vision_head is None

    def images(self, image: torch.Tensor) -> torch.Tensor:
        """(B, D) normalised vectors of (B, 3, S, S) images."""
        hidden = self.backbone(image=image).hidden  # (B, 1 + patches, D)
        vector = hidden[:, 1:].mean(1) if self.vision_head is None else self.vision_head(hidden[:, 0])
        return F.normalize(vector.float(), dim=-1)

    def texts(self, ids: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
        """(B, D) normalised vectors of (B, T) token ids, ``padding`` True at padding."""
        hidden = self.backbone(text=ids, text_padding_mask=padding).hidden  # (B, T, D)
        if self.language_head is not None:
            return F.normalize(self.language_head(hidden[:, 0]).float(), dim=-1)
        kept = torch.ones_like(ids, dtype=torch.bool) if padding is None else ~padding
        weights = kept.to(hidden.dtype)[..., None]
        return F.normalize((hidden * weights).sum(1).float() / weights.sum(1).float(), dim=-1)

    def class_vectors(self, tokenizer: TextTokenizer, device: torch.device) -> dict[str, torch.Tensor]:
        """Attribute -> (C, D) normalised means of each class's prompt vectors."""
        vectors = {}
        for attribute in ATTRIBUTE_CLASSES:
            prompts = class_prompts(attribute)
            ids, padding = tokenizer.pad([tokenizer.encode(text) for group in prompts for text in group])
            prompt_PD = self.texts(ids.to(device), padding.to(device))
            per_class_CKD = prompt_PD.view(len(prompts), len(prompts[0]), -1)
            vectors[attribute] = F.normalize(per_class_CKD.mean(1), dim=-1)
        return vectors


@dataclass
class ZeroShotProbeCollector:
    """Collects the first ``pairs`` validation pairs' vectors and labels, then scores them once per validation.

    Attributes:
        pairs: how many pairs to probe.
        tokenizer: the data's tokenizer (captions decoded, prompts encoded).
    """

    pairs: int
    tokenizer: TextTokenizer
    _images: list[torch.Tensor] = field(default_factory=list)
    _texts: list[torch.Tensor] = field(default_factory=list)
    _labels: list[dict[str, int]] = field(default_factory=list)

    @property
    def collected(self) -> int:
        return sum(len(vectors) for vectors in self._images)

    @torch.no_grad()
    def add(self, encoder: ProbeEncoder, batch: PretrainBatch) -> None:
        """Encodes the pairs of a pair batch while fewer than ``pairs`` are collected; other kinds are passed over."""
        room = self.pairs - self.collected
        if batch["kind"] != PAIR or room <= 0:
            return
        ids = batch["text_targets"][:room]
        padding = batch.get("text_padding_mask")
        self._images.append(encoder.images(batch["image"][:room]))
        self._texts.append(encoder.texts(ids, None if padding is None else padding[:room]))
        self._labels.extend(caption_labels(self.tokenizer.decode(row)) for row in ids)

    @torch.no_grad()
    def finish(self, encoder: ProbeEncoder, device: torch.device) -> ProbeEmbeddings | None:
        """The collected pairs with their class vectors (None when fewer than 2 pairs came), and a fresh start."""
        images, texts, labels = self._images, self._texts, self._labels
        self._images, self._texts, self._labels = [], [], []
        if sum(len(vectors) for vectors in images) < 2:
            return None
        return ProbeEmbeddings(
            image_ND=torch.cat(images),
            text_ND=torch.cat(texts),
            labels={
                attribute: torch.tensor([label[attribute] for label in labels], device=device)
                for attribute in ATTRIBUTE_CLASSES
            },
            classes=encoder.class_vectors(self.tokenizer, device),
            pooled=encoder.pooled,
        )


def probe_metrics(embeddings: ProbeEmbeddings) -> dict[str, float]:
    """The logged probe values (``val/probe/<name>``, see the module docstring) of one set of embeddings."""
    image_ND, text_ND = embeddings.image_ND.float(), embeddings.text_ND.float()
    count = image_ND.shape[0]
    own_N = torch.arange(count, device=image_ND.device)
    ranks = {"i2t": image_to_text_ranks(image_ND, text_ND, own_N), "t2i": text_to_image_ranks(image_ND, text_ND, own_N)}
    matching = "pooled_" if embeddings.pooled else ""
    metrics = {f"{PREFIX}pairs": float(count)}
    for direction, rank_N in ranks.items():
        for k in PROBE_RECALL_AT:
            metrics[f"{PREFIX}{matching}{direction}_r{k}"] = int((rank_N <= k).sum()) / count
    for attribute, labels_N in embeddings.labels.items():
        labelled = labels_N >= 0
        if bool(labelled.any()):
            predicted_N = (image_ND @ embeddings.classes[attribute].float().T).argmax(1)
            right = int((predicted_N == labels_N)[labelled].sum())
            metrics[f"{PREFIX}{attribute}_acc"] = right / int(labelled.sum())
    return metrics


def probe_chance(metrics: dict[str, float]) -> dict[str, float]:
    """The chance level of each logged probe value in ``metrics`` (keys as :func:`probe_metrics` gives them): K / N
    for recall at K among the N pairs (``val/probe/pairs``), one over the number of classes for an attribute."""
    count = metrics[f"{PREFIX}pairs"]
    chance = {}
    for key in metrics:
        name = key.removeprefix(PREFIX)
        rank = re.fullmatch(r"(?:pooled_)?(?:i2t|t2i)_r(\d+)", name)
        if rank:
            chance[key] = min(1.0, int(rank.group(1)) / count)
        elif name.endswith("_acc") and name[: -len("_acc")] in ATTRIBUTE_CLASSES:
            chance[key] = 1 / len(ATTRIBUTE_CLASSES[name[: -len("_acc")]])
    return chance
