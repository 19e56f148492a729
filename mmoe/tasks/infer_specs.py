"""Each fine-tuning task's :class:`~mmoe.tasks.inference.InferSpec`: what ``mmoe infer <task>`` reads and answers.

* VQA: the ``--top-k`` answers with their sigmoid scores (BEiT-3's VQA head is trained with binary cross-entropy).
* NLVR2: true / false for the pair and the probability of true.
* Captioning: the caption (beam search, the checkpoint's length settings; ``--beam`` replaces its beams).
* Retrieval: the cosine similarity of the image's and the text's embeddings (the searches: :mod:`mmoe.infer.search`).
* Classification: the ``--top-k`` classes (names from the checkpoint's ``classes.json``) with their softmax
  probabilities.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mmoe.data import classification
from mmoe.data.decoders import CaptionDecoder, NLVR2Decoder, RetrievalDecoder, VQADecoder
from mmoe.data.transforms import eval_transform
from mmoe.io import positive_int
from mmoe.tasks.captioning import CaptioningFineTuning
from mmoe.tasks.classification import ImageClassificationFineTuning
from mmoe.tasks.inference import (
    Answer,
    Answers,
    Caption,
    Classes,
    InferOption,
    InferSpec,
    Similarity,
    Tokenize,
    Verdict,
)
from mmoe.tasks.nlvr2 import NLVR2FineTuning
from mmoe.tasks.retrieval import RetrievalFineTuning
from mmoe.tasks.vqa import VQAFineTuning


@torch.no_grad()
def vqa_answers(
    task: VQAFineTuning, images: torch.Tensor, text: str | None, tokenize: Tokenize, options: dict[str, Any]
) -> tuple[Answers, str | None]:
    """The ``top_k`` answers with their sigmoid scores."""
    logits, _ = task(images, *tokenize(text))
    scores = logits[0].float().sigmoid()
    best = scores.topk(min(options["top_k"], scores.numel()))
    answers = [Answer(task.answers[i], round(float(s), 6)) for s, i in zip(best.values, best.indices, strict=True)]
    return Answers(answers), text


def vqa_folder_entry(image: Path, result: Answers, text: str | None) -> dict:
    return {"question": text, "answer": result.answers[0].answer, "score": result.answers[0].score}


VQA_INFER = InferSpec(
    task=VQAFineTuning,
    run=vqa_answers,
    shard_decoder=lambda size, tokenizer: VQADecoder(eval_transform(size), tokenizer, min_side=size),
    aliases=("vqa",),
    text="question",
    options=(InferOption("top-k", "answers to list (default 5)", positive_int, 5),),
    folder_entry=vqa_folder_entry,
)


@torch.no_grad()
def nlvr2_verdict(
    task: NLVR2FineTuning, images: torch.Tensor, text: str | None, tokenize: Tokenize, options: dict[str, Any]
) -> tuple[Verdict, str | None]:
    """True / false and the probability of true for the pair ``images`` (left, right)."""
    logits, _ = task(images[:1], images[1:], *tokenize(text))
    probability = float(logits[0].float().softmax(-1)[1])
    return Verdict(probability > 0.5, round(probability, 6)), text


NLVR2_INFER = InferSpec(
    task=NLVR2FineTuning,
    run=nlvr2_verdict,
    shard_decoder=lambda size, tokenizer: NLVR2Decoder(eval_transform(size), tokenizer, min_side=size),
    images=("left", "right"),
    text="sentence",
)


def caption(
    task: CaptioningFineTuning, images: torch.Tensor, text: str | None, tokenize: Tokenize, options: dict[str, Any]
) -> tuple[Caption, str | None]:
    """The caption of the image; its routing is listed."""
    words = task.captions(images)[0]
    return Caption(words), words


def caption_folder_entry(image: Path, result: Caption, text: str | None) -> dict:
    """COCO results use integer image ids: a file named by a number (``000000391895.jpg``) gives that number."""
    return {"image_id": int(image.stem) if image.stem.isdigit() else image.name, "caption": result.caption}


def caption_beams(options: dict[str, Any]) -> dict[str, Any]:
    return {"num_beams": options["beam"]} if options.get("beam") is not None else {}


CAPTIONING_INFER = InferSpec(
    task=CaptioningFineTuning,
    run=caption,
    shard_decoder=lambda size, tokenizer: CaptionDecoder(eval_transform(size), tokenizer, mode="eval", min_side=size),
    aliases=("caption",),
    options=(InferOption("beam", "beams (default: the checkpoint's num_beams; 1 = greedy)", positive_int),),
    arguments=caption_beams,
    folder_entry=caption_folder_entry,
)


@torch.no_grad()
def similarity(
    task: RetrievalFineTuning, images: torch.Tensor, text: str | None, tokenize: Tokenize, options: dict[str, Any]
) -> tuple[Similarity, str | None]:
    """The cosine similarity of the image and the text."""
    image_BD, text_BD, _ = task(images[:1], *tokenize(text))
    return Similarity(round(float(image_BD[0] @ text_BD[0]), 6)), text


def similarity_folder_entry(image: Path, result: Similarity, text: str | None) -> dict:
    return {"text": text, "similarity": result.similarity}


RETRIEVAL_INFER = InferSpec(
    task=RetrievalFineTuning,
    run=similarity,
    shard_decoder=lambda size, tokenizer: RetrievalDecoder(eval_transform(size), tokenizer, "eval", min_side=size),
    aliases=("retrieve",),
    alternatives=("images",),
    text="text",
    options=(
        InferOption("texts", "a text file, one candidate a line: its lines ranked against --image"),
        InferOption("top-k", "matches to list (default 5)", positive_int, 5),
        InferOption(
            "cache",
            "folder of the --images embeddings cache: a file per checkpoint, each image keyed by a digest of its "
            "bytes (default $XDG_CACHE_HOME/mmoe/retrieval)",
        ),
    ),
    folder_entry=similarity_folder_entry,
)


@torch.no_grad()
def classify(
    task: ImageClassificationFineTuning,
    images: torch.Tensor,
    text: str | None,
    tokenize: Tokenize,
    options: dict[str, Any],
) -> tuple[Classes, str | None]:
    """The image's ``top_k`` most probable classes (the checkpoint's ``top_k`` when not given)."""
    logits, _ = task(images[:1], task.evaluated_parts())
    probabilities, indices = task.ranked(logits, options.get("top_k") or task.top_k)
    return Classes(**task.described(indices[0].tolist(), probabilities[0].tolist())), None


def classify_folder_entry(image: Path, result: Classes, text: str | None) -> dict:
    best = result.classes[0]
    return {
        "image": image.name,
        "label": best.index,
        "wnid": best.wnid,
        "name": best.name,
        "probability": best.probability,
    }


CLASSIFICATION_INFER = InferSpec(
    task=ImageClassificationFineTuning,
    run=classify,
    shard_decoder=lambda size, tokenizer: classification.ClassificationDecoder(
        classification.eval_transform(size), min_side=size
    ),
    aliases=("classify",),
    options=(InferOption("top-k", "classes to list (default: the checkpoint's top_k)", positive_int),),
    folder_entry=classify_folder_entry,
)
