"""The embedded default corpus: a small synthetic vision-language world written in the benchmarks' original formats.

``build_corpus(out)`` lays out under ``out`` exactly what ``data/README.md`` documents for the real datasets:

```
coco/{train2014,val2014,test2015}/COCO_<subtype>_<image_id:012d>.jpg
coco/annotations/captions_{train2014,val2014}.json       official COCO captions format
coco/karpathy/dataset_coco.json                          Karpathy split (train / restval / val / test)
flickr30k/dataset_flickr30k.json, flickr30k/images/      Flickr30K Karpathy split (train / val / test, for retrieval;
                                                         the COCO images again, named <imgid>.jpg)
vqav2/v2_OpenEnded_mscoco_<subtype>_questions.json       train2014, val2014, test2015, test-dev2015
vqav2/v2_mscoco_<subtype>_annotations.json               train2014, val2014 (10 answers per question)
nlvr2/{train,dev,test1}.json                             NLVR2 JSON lines
nlvr2/images/{train/<directory>,dev,test1}/<split>-<set>-<pair>-img{0,1}.png
pretrain/text.txt, pretrain/pairs.tsv                    text-only corpus; image<TAB>caption (paths under coco/)
synth.json                                               seed, sizes, counts and chance levels
```

Every image, text and answer comes from a generator seeded by (seed, split, index): the same seed gives the same
files, and a larger size keeps the smaller one's first items.
"""

from __future__ import annotations

import io
import json
import os
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from mmoe.data.answers import answer_scores, normalize_answer
from mmoe.data.processes import run_in_processes
from mmoe.data.synth.karpathy import coco_document, flickr30k_document
from mmoe.data.synth.language import captions, human_answers, majority_answer, questions, statement
from mmoe.data.synth.scenes import Scene, render, sample_scene

#: The corpus summary at the corpus root: seed, sizes, counts and each task's chance levels.
SUMMARY_FILE = "synth.json"

_SPLIT_CODES = {"train2014": 1, "val2014": 2, "test2015": 3, "nlvr2-train": 4, "nlvr2-dev": 5, "nlvr2-test1": 6,
                "text": 7, "nlvr2-statements": 8}  # fmt: skip
_IMAGE_ID_BASE = {"train2014": 0, "val2014": 100_000, "test2015": 200_000}


@dataclass
class SynthSizes:
    """How much the generator writes.

    Args:
        train_images: COCO train2014 images (captions, VQA train, pre-training pairs).
        val_images: val2014 images (captions val, Karpathy val / test / restval thirds, VQA val).
        test_images: test2015 images (VQA test2015; the first half of their questions also form test-dev2015).
        questions_per_image: VQA questions per image.
        nlvr2_train_sets: NLVR2 training sets; a set is one statement with 4 image pairs (2 true, 2 false).
        nlvr2_eval_sets: sets in each of dev and test1.
        texts: lines of the text-only pre-training corpus.
        image_size: image side in pixels.
    """

    train_images: int = 2000
    val_images: int = 500
    test_images: int = 200
    questions_per_image: int = 5
    nlvr2_train_sets: int = 400
    nlvr2_eval_sets: int = 100
    texts: int = 4000
    image_size: int = 64


SIZES = {
    "tiny": SynthSizes(24, 12, 6, 3, 6, 3, 40),
    "small": SynthSizes(),
    "medium": SynthSizes(10_000, 2000, 1000, 5, 2000, 500, 20_000),
    "large": SynthSizes(50_000, 10_000, 5000, 5, 10_000, 1000, 100_000),
}


def _rng(seed: int, split: str, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, _SPLIT_CODES[split], index])


def _encode(image, image_format: str) -> bytes:
    buffer = io.BytesIO()
    if image_format == "JPEG":
        image.save(buffer, format="JPEG", quality=95)
    else:
        image.save(buffer, format="PNG", optimize=False)
    return buffer.getvalue()


def _write_json(path: Path, value: Any, lines: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if lines:
        text = "".join(json.dumps(record, sort_keys=True) + "\n" for record in value)
    else:
        text = json.dumps(value, sort_keys=True)
    path.write_text(text)


@dataclass
class _Image:
    image_id: int
    subtype: str
    file_name: str
    scene: Scene
    captions: list[str]


def _coco_images(root: Path, seed: int, subtype: str, count: int, size: int) -> list[_Image]:
    folder = root / "coco" / subtype
    folder.mkdir(parents=True, exist_ok=True)
    images = []
    for index in range(count):
        rng = _rng(seed, subtype, index)
        scene = sample_scene(rng)
        image_id = _IMAGE_ID_BASE[subtype] + index + 1
        file_name = f"COCO_{subtype}_{image_id:012d}.jpg"
        (folder / file_name).write_bytes(_encode(render(scene, size), "JPEG"))
        images.append(_Image(image_id, subtype, file_name, scene, captions(scene, rng)))
    return images


def _captions_file(root: Path, subtype: str, images: list[_Image], size: int) -> None:
    annotations, next_id = [], 1
    for image in images:
        for caption in image.captions:
            annotations.append(
                {"id": image.image_id * 10 + next_id % 10, "image_id": image.image_id, "caption": caption}
            )
            next_id += 1
    document = {
        "info": {"description": "mmoe synthetic shapes (COCO captions format)", "version": "1.0"},
        "licenses": [],
        "images": [
            {"id": i.image_id, "file_name": i.file_name, "width": size, "height": size, "license": 0} for i in images
        ],
        "annotations": annotations,
    }
    _write_json(root / "coco" / "annotations" / f"captions_{subtype}.json", document)


def _flickr30k_files(root: Path, train: list[_Image], val: list[_Image]) -> int:
    """The Flickr30K layout of the COCO images (``flickr30k_document``), the images copied under their new names.
    Returns the number of test images."""
    document = flickr30k_document(train, val)
    folder = root / "flickr30k" / "images"
    folder.mkdir(parents=True, exist_ok=True)
    for image, record in zip([*train, *val], document["images"], strict=True):
        (folder / record["filename"]).write_bytes((root / "coco" / image.subtype / image.file_name).read_bytes())
    _write_json(root / "flickr30k" / "dataset_flickr30k.json", document)
    return sum(record["split"] == "test" for record in document["images"])


def _vqa_files(root: Path, seed: int, subtype: str, images: list[_Image], per_image: int, annotated: bool):
    question_records, annotation_records = [], []
    for image in images:
        rng = np.random.default_rng([seed, _SPLIT_CODES[image.subtype], image.image_id, 99])
        for k, question in enumerate(questions(image.scene, rng, per_image)):
            question_id = image.image_id * 1000 + k
            question_records.append({"image_id": image.image_id, "question": question.text, "question_id": question_id})
            if not annotated:
                continue
            answers = human_answers(question, rng)
            annotation_records.append(
                {
                    "question_id": question_id,
                    "image_id": image.image_id,
                    "question_type": question.question_type,
                    "answer_type": question.answer_type,
                    "multiple_choice_answer": majority_answer(answers),
                    "answers": [
                        {
                            "answer": a,
                            "answer_confidence": "yes" if a.rstrip(".") == question.answer else "maybe",
                            "answer_id": i + 1,
                        }
                        for i, a in enumerate(answers)
                    ],
                }  # fmt: skip
            )
    header = {"info": {"description": "mmoe synthetic shapes (VQAv2 format)"}, "license": {"name": "CC BY 4.0"},
              "data_type": "mscoco"}  # fmt: skip
    folder = root / "vqav2"
    splits = [(subtype, question_records)]
    if subtype == "test2015":
        splits.append(("test-dev2015", question_records[: len(question_records) // 2]))
    for name, records in splits:
        document = {**header, "task_type": "Open-Ended", "data_subtype": name, "questions": records}
        _write_json(folder / f"v2_OpenEnded_mscoco_{name}_questions.json", document)
    if annotated:
        document = {**header, "data_subtype": subtype, "annotations": annotation_records}
        _write_json(folder / f"v2_mscoco_{subtype}_annotations.json", document)
    return annotation_records, {record["question_id"]: record["question"] for record in question_records}


def _nlvr2_split(root: Path, seed: int, split: str, sets: int, size: int) -> list[dict[str, Any]]:
    records = []
    for set_id in range(sets):
        rng = _rng(seed, f"nlvr2-{split}", set_id)
        labels = [bool(v) for v in rng.permutation([True, True, False, False])]
        chosen = statement(rng)
        for pair_id, label in enumerate(labels):
            for _ in range(10_000):
                left, right = sample_scene(rng), sample_scene(rng)
                if chosen.holds(left, right) == label:
                    break
            else:  # pragma: no cover - every template is satisfiable both ways within a few draws
                raise RuntimeError(f"could not draw a {label} pair for {chosen.text!r}")
            stem = f"{split}-{set_id}-{pair_id}"
            directory = str(set_id % 10)
            folder = root / "nlvr2" / "images" / (f"train/{directory}" if split == "train" else split)
            folder.mkdir(parents=True, exist_ok=True)
            for side, scene in (("img0", left), ("img1", right)):
                (folder / f"{stem}-{side}.png").write_bytes(_encode(render(scene, size), "PNG"))
            record = {
                "identifier": f"{stem}-0",
                "sentence": chosen.text,
                "label": str(label),
                "left_url": f"synthetic://{stem}-img0.png",
                "right_url": f"synthetic://{stem}-img1.png",
                "writer": "synth",
                "validation": {},
                "extra_validations": {},
                "synset": "shapes",
                "query": "shapes",
            }
            if split == "train":
                record["directory"] = directory
            records.append(record)
    _write_json(root / "nlvr2" / f"{split}.json", records, lines=True)
    return records


def _pretrain_files(root: Path, seed: int, train: list[_Image], texts: int) -> None:
    folder = root / "pretrain"
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for index in range(texts):
        rng = _rng(seed, "text", index)
        lines.append(captions(sample_scene(rng), rng, count=1)[0])
    (folder / "text.txt").write_text("\n".join(lines) + "\n")
    pairs = [f"{i.subtype}/{i.file_name}\t{caption}" for i in train for caption in i.captions[:2]]
    (folder / "pairs.tsv").write_text("\n".join(pairs) + "\n")


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


def caption_constant_baseline(train: list[_Image], test: list[_Image]) -> dict[str, Any]:
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


@dataclass
class _CocoFiles:
    """What :func:`_coco_files` wrote that the corpus summary counts."""

    train: list[_Image]
    val: list[_Image]
    test: list[_Image]
    retrieval_test_images: int
    vqa_train: list[dict[str, Any]]
    vqa_val: list[dict[str, Any]]
    questions: dict[int, str]


def _coco_files(root: Path, seed: int, sizes: SynthSizes) -> _CocoFiles:
    """The COCO images and everything written from them: captions, Karpathy and Flickr30K layouts, VQAv2 and the
    pre-training text and pairs."""
    train = _coco_images(root, seed, "train2014", sizes.train_images, sizes.image_size)
    val = _coco_images(root, seed, "val2014", sizes.val_images, sizes.image_size)
    test = _coco_images(root, seed, "test2015", sizes.test_images, sizes.image_size)
    _captions_file(root, "train2014", train, sizes.image_size)
    _captions_file(root, "val2014", val, sizes.image_size)
    _write_json(root / "coco" / "karpathy" / "dataset_coco.json", coco_document(train, val))
    retrieval_test_images = _flickr30k_files(root, train, val)
    vqa_train, train_questions = _vqa_files(root, seed, "train2014", train, sizes.questions_per_image, annotated=True)
    vqa_val, val_questions = _vqa_files(root, seed, "val2014", val, sizes.questions_per_image, annotated=True)
    _vqa_files(root, seed, "test2015", test, sizes.questions_per_image, annotated=False)
    _pretrain_files(root, seed, train, sizes.texts)
    return _CocoFiles(train, val, test, retrieval_test_images, vqa_train, vqa_val, train_questions | val_questions)


def build_corpus(
    out: str | os.PathLike, seed: int = 0, sizes: SynthSizes | None = None, workers: int = 1
) -> dict[str, Any]:
    """Writes the synthetic corpus under ``out`` (see the module docstring) and returns its summary, also written to
    ``out/synth.json``: the sizes, file counts and each task's chance level.

    ``workers`` > 1 writes the COCO part and each NLVR2 split in that many processes at once
    (:func:`mmoe.data.processes.run_in_processes`); the files are the same.
    """
    sizes = sizes or SynthSizes()
    root = Path(out)
    nlvr2_sets = {"train": sizes.nlvr2_train_sets, "dev": sizes.nlvr2_eval_sets, "test1": sizes.nlvr2_eval_sets}
    jobs = [partial(_coco_files, root, seed, sizes)]
    jobs += [partial(_nlvr2_split, root, seed, split, sets, sizes.image_size) for split, sets in nlvr2_sets.items()]
    coco, *nlvr2_records = run_in_processes(jobs, workers)
    nlvr2 = dict(zip(nlvr2_sets, nlvr2_records, strict=True))
    train, val = coco.train, coco.val
    third = max(1, len(val) // 3)
    summary = {
        "seed": seed,
        "sizes": asdict(sizes),
        "counts": {
            "coco_images": {"train2014": len(train), "val2014": len(val), "test2015": len(coco.test)},
            "vqav2_questions": {"train2014": len(coco.vqa_train), "val2014": len(coco.vqa_val)},
            "nlvr2_pairs": {split: len(records) for split, records in nlvr2.items()},
        },
        "chance": {
            "vqav2_val_prior_accuracy": vqa_prior_accuracy(coco.vqa_train, coco.vqa_val),
            "vqav2_val_question_prior_accuracy": vqa_prior_accuracy(coco.vqa_train, coco.vqa_val, coco.questions),
            "nlvr2": {
                "accuracy_constant_answer": 0.5,
                "accuracy_random": 0.5,
                "consistency_random": 1 / 16,
                "note": "every set has 2 true and 2 false pairs",
            },  # fmt: skip
            "captioning_karpathy_test_constant_caption": caption_constant_baseline(train, val[third : 2 * third]),
            "retrieval_flickr30k_test": {
                "images": coco.retrieval_test_images,
                "text_to_image_r1_random": 1 / coco.retrieval_test_images,
                "note": "a caption's image ranked first by chance; image -> text has several positives",
            },
        },
    }
    _write_json(root / SUMMARY_FILE, summary)
    return summary


@dataclass(frozen=True)
class ChanceLevels:
    """Each task's chance level, as :func:`build_corpus` writes them under ``chance`` in the corpus summary.

    Attributes:
        vqa_prior: VQA val accuracy of the top training answer per question type (the VQA paper's prior).
        vqa_question_prior: VQA val accuracy of the top training answer per question (image-blind).
        nlvr2_constant: NLVR2 accuracy of a constant answer.
        nlvr2_random_consistency: NLVR2 consistency of random answers.
        caption_constant: each caption metric of the most common training caption on the Karpathy test split.
    """

    vqa_prior: float
    vqa_question_prior: float
    nlvr2_constant: float
    nlvr2_random_consistency: float
    caption_constant: dict[str, float]

    @classmethod
    def from_summary(cls, chance: dict[str, Any]) -> ChanceLevels:
        """The levels of a summary's ``chance`` entry."""
        return cls(
            vqa_prior=chance["vqav2_val_prior_accuracy"]["overall"],
            vqa_question_prior=chance["vqav2_val_question_prior_accuracy"]["overall"],
            nlvr2_constant=chance["nlvr2"]["accuracy_constant_answer"],
            nlvr2_random_consistency=chance["nlvr2"]["consistency_random"],
            caption_constant=chance["captioning_karpathy_test_constant_caption"],
        )
