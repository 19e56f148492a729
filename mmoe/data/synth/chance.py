"""Each task's chance level on the synthetic corpus, written under ``chance`` in its summary: the VQA accuracy of an
answerer that never looks at the image, the NLVR2 accuracy and consistency of constant or random answers, the caption
metrics of one constant caption, retrieval's recall of a random ranking; the classification split's levels
(majority class, uniform guess) are :func:`mmoe.data.synth.classification.classification_chance`'s."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmoe.data.answers import answer_scores, normalize_answer
from mmoe.data.synth.karpathy import CaptionedImage


def image_blind_answers(
    train: list[dict[str, Any]], val: list[dict[str, Any]], questions: dict[int, str] | None = None
) -> dict[int, str]:
    """Question id -> the answer of :func:`vqa_prior_accuracy`'s image-blind answerer for each ``val`` annotation."""
    by_type: dict[str, Counter] = defaultdict(Counter)
    by_text: dict[str, Counter] = defaultdict(Counter)
    for annotation in train:
        answer = normalize_answer(annotation["multiple_choice_answer"])
        by_type[annotation["question_type"]][answer] += 1
        if questions is not None:
            by_text[questions[annotation["question_id"]]][answer] += 1
    guesses = {}
    for annotation in val:
        counts = by_text.get(questions[annotation["question_id"]]) if questions is not None else None
        counts = counts or by_type.get(annotation["question_type"])
        guesses[annotation["question_id"]] = counts.most_common(1)[0][0] if counts else ""
    return guesses


def vqa_prior_accuracy(
    train: list[dict[str, Any]], val: list[dict[str, Any]], questions: dict[int, str] | None = None
) -> dict[str, Any]:
    """Official VQA accuracy on ``val`` of an answerer that never looks at the image, overall and per answer type,
    in percent.

    Without ``questions``: every question gets its question type's most common training answer (the "per question
    type prior" baseline of the VQA paper). With ``questions`` (question id -> text, for train and val): every
    question gets the most common training answer to the same question text, falling back to the question type's
    when the text never occurs in training. That is what memorising the questions gives without the image; a
    text-only model can score somewhat higher by sharing answers across similar texts, so a model near this level has
    not shown that it reads the image.
    """
    guesses = image_blind_answers(train, val, questions)
    overall, per_answer_type = [], defaultdict(list)
    for annotation in val:
        guess = guesses[annotation["question_id"]]
        score = answer_scores([a["answer"] for a in annotation["answers"]]).get(guess, 0.0)
        overall.append(score)
        per_answer_type[annotation["answer_type"]].append(score)
    mean = lambda values: round(100 * float(np.mean(values)), 2) if values else None  # noqa: E731
    return {"overall": mean(overall), "perAnswerType": {k: mean(v) for k, v in sorted(per_answer_type.items())}}


def caption_constant_baseline(train: Sequence[CaptionedImage], test: Sequence[CaptionedImage]) -> dict[str, Any]:
    """BLEU-4 and CIDEr-D on the Karpathy test images of always emitting the most common training caption
    (lower-cased whitespace tokens, not the PTB tokenizer)."""
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider

    tokens = lambda text: " ".join(text.lower().replace(",", " ").replace(":", " ").split())  # noqa: E731
    constant = Counter(tokens(c) for image in train for c in image.captions).most_common(1)[0][0]
    references = {i.image_id: [tokens(c) for c in i.captions] for i in test}
    results = {i.image_id: [constant] for i in test}
    bleu, _ = Bleu(4).compute_score(references, results, verbose=0)
    cider, _ = Cider().compute_score(references, results)
    return {"caption": constant, "Bleu_4": round(float(bleu[3]), 4), "CIDEr": round(float(cider), 4)}


def chance_summary(
    vqa_train: list[dict[str, Any]],
    vqa_val: list[dict[str, Any]],
    questions: dict[int, str],
    caption_train: Sequence[CaptionedImage],
    caption_test: Sequence[CaptionedImage],
    retrieval_test_images: int,
) -> dict[str, Any]:
    """The corpus summary's ``chance`` entry (:class:`ChanceLevels` reads it).

    Args:
        vqa_train: the VQAv2 train2014 annotations.
        vqa_val: the VQAv2 val2014 annotations, scored.
        questions: question id -> text, for train and val.
        caption_train: the captioning training images.
        caption_test: the Karpathy test images, scored.
        retrieval_test_images: images in the Flickr30K test split.
    """
    return {
        "vqav2_val_prior_accuracy": vqa_prior_accuracy(vqa_train, vqa_val),
        "vqav2_val_question_prior_accuracy": vqa_prior_accuracy(vqa_train, vqa_val, questions),
        "nlvr2": {
            "accuracy_constant_answer": 0.5,
            "accuracy_random": 0.5,
            "consistency_random": 1 / 16,
            "note": "every set has 2 true and 2 false pairs",
        },
        "captioning_karpathy_test_constant_caption": caption_constant_baseline(caption_train, caption_test),
        "retrieval_flickr30k_test": {
            "images": retrieval_test_images,
            "text_to_image_r1_random": 1 / retrieval_test_images,
            "note": "a caption's image ranked first by chance; image -> text has several positives",
        },
    }


@dataclass(frozen=True)
class ChanceLevels:
    """Each task's chance level, as :func:`chance_summary` writes them under ``chance`` in the corpus summary.

    Attributes:
        vqa_prior: VQA val accuracy of the top training answer per question type (the VQA paper's prior).
        vqa_question_prior: VQA val accuracy of the top training answer per question (image-blind).
        nlvr2_constant: NLVR2 accuracy of a constant answer.
        nlvr2_random_consistency: NLVR2 consistency of random answers.
        caption_constant: each caption metric of the most common training caption on the Karpathy test split.
        classification_majority: classification val accuracy of the most common training class (None in a summary
            written before the classification split).
        classification_uniform: classification val accuracy of a uniform random guess (None as above).
    """

    vqa_prior: float
    vqa_question_prior: float
    nlvr2_constant: float
    nlvr2_random_consistency: float
    caption_constant: dict[str, float]
    classification_majority: float | None = None
    classification_uniform: float | None = None

    @classmethod
    def from_summary(cls, chance: dict[str, Any]) -> ChanceLevels:
        """The levels of a summary's ``chance`` entry."""
        classification = chance.get("classification_val") or {}
        return cls(
            vqa_prior=chance["vqav2_val_prior_accuracy"]["overall"],
            vqa_question_prior=chance["vqav2_val_question_prior_accuracy"]["overall"],
            nlvr2_constant=chance["nlvr2"]["accuracy_constant_answer"],
            nlvr2_random_consistency=chance["nlvr2"]["consistency_random"],
            caption_constant=chance["captioning_karpathy_test_constant_caption"],
            classification_majority=classification.get("accuracy_majority_class"),
            classification_uniform=classification.get("accuracy_uniform"),
        )
