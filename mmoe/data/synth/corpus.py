"""The embedded default corpus: a small synthetic vision-language world written in the benchmarks' original formats.

``build_corpus(out)`` lays out under ``out`` exactly what ``data/README.md`` documents for the real datasets, every
path named by :class:`mmoe.data.synth.layout.CorpusLayout` (its module docstring draws the tree).

Every image, text and answer comes from a generator seeded by (seed, split, index): the same seed gives the same
files, and a larger size keeps the smaller one's first items.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from mmoe.data.processes import run_in_processes
from mmoe.data.synth.chance import (
    chance_summary,
)
from mmoe.data.synth.classification import RenderedImage, write_classification_files
from mmoe.data.synth.karpathy import coco_document, flickr30k_document
from mmoe.data.synth.language import captions, human_answers, majority_answer, questions, statement
from mmoe.data.synth.layout import CorpusLayout
from mmoe.data.synth.scenes import Scene, render, sample_scene

__all__ = ["SIZES", "SynthSizes", "build_corpus"]

_SPLIT_CODES = {
    "train2014": 1,
    "val2014": 2,
    "test2015": 3,
    "nlvr2-train": 4,
    "nlvr2-dev": 5,
    "nlvr2-test1": 6,
    "text": 7,
    "nlvr2-statements": 8,
}
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


def _coco_images(layout: CorpusLayout, seed: int, subtype: str, count: int, size: int) -> list[_Image]:
    folder = layout.coco_split_images(subtype)
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


def _captions_file(layout: CorpusLayout, subtype: str, images: list[_Image], size: int) -> None:
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
    _write_json(layout.coco_captions(subtype), document)


def _flickr30k_files(layout: CorpusLayout, train: list[_Image], val: list[_Image]) -> int:
    """The Flickr30K layout of the COCO images (``flickr30k_document``), the images copied under their new names.
    Returns the number of test images."""
    document = flickr30k_document(train, val)
    folder = layout.flickr_images
    folder.mkdir(parents=True, exist_ok=True)
    for image, record in zip([*train, *val], document["images"], strict=True):
        source = layout.coco_split_images(image.subtype) / image.file_name
        (folder / record["filename"]).write_bytes(source.read_bytes())
    _write_json(layout.karpathy_flickr, document)
    return sum(record["split"] == "test" for record in document["images"])


def _vqa_files(layout: CorpusLayout, seed: int, subtype: str, images: list[_Image], per_image: int, annotated: bool):
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
                }
            )
    header = {
        "info": {"description": "mmoe synthetic shapes (VQAv2 format)"},
        "license": {"name": "CC BY 4.0"},
        "data_type": "mscoco",
    }
    splits = [(subtype, question_records)]
    if subtype == "test2015":
        splits.append(("test-dev2015", question_records[: len(question_records) // 2]))
    for name, records in splits:
        document = {**header, "task_type": "Open-Ended", "data_subtype": name, "questions": records}
        _write_json(layout.vqa_questions(name), document)
    if annotated:
        document = {**header, "data_subtype": subtype, "annotations": annotation_records}
        _write_json(layout.vqa_annotations(subtype), document)
    return annotation_records, {record["question_id"]: record["question"] for record in question_records}


def _nlvr2_split(layout: CorpusLayout, seed: int, split: str, sets: int, size: int) -> list[dict[str, Any]]:
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
            folder = layout.nlvr2_image_folder(split, directory)
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
    _write_json(layout.nlvr2_records(split), records, lines=True)
    return records


def _pretrain_files(layout: CorpusLayout, seed: int, train: list[_Image], texts: int) -> None:
    layout.pretrain_text.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for index in range(texts):
        rng = _rng(seed, "text", index)
        lines.append(captions(sample_scene(rng), rng, count=1)[0])
    layout.pretrain_text.write_text("\n".join(lines) + "\n")
    pairs = [f"{i.subtype}/{i.file_name}\t{caption}" for i in train for caption in i.captions[:2]]
    layout.pretrain_pairs.write_text("\n".join(pairs) + "\n")


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
    classification_chance: dict[str, Any]


def _rendered(layout: CorpusLayout, images: list[_Image]) -> list[RenderedImage]:
    return [RenderedImage(i.image_id, layout.coco_split_images(i.subtype) / i.file_name, i.scene) for i in images]


def _coco_files(layout: CorpusLayout, seed: int, sizes: SynthSizes) -> _CocoFiles:
    """The COCO images and everything written from them: captions, Karpathy and Flickr30K layouts, VQAv2, the
    pre-training text and pairs, and the classification folders in ImageNet's layouts."""
    train = _coco_images(layout, seed, "train2014", sizes.train_images, sizes.image_size)
    val = _coco_images(layout, seed, "val2014", sizes.val_images, sizes.image_size)
    test = _coco_images(layout, seed, "test2015", sizes.test_images, sizes.image_size)
    _captions_file(layout, "train2014", train, sizes.image_size)
    _captions_file(layout, "val2014", val, sizes.image_size)
    _write_json(layout.karpathy_coco, coco_document(train, val))
    retrieval_test_images = _flickr30k_files(layout, train, val)
    per_image = sizes.questions_per_image
    vqa_train, train_questions = _vqa_files(layout, seed, "train2014", train, per_image, annotated=True)
    vqa_val, val_questions = _vqa_files(layout, seed, "val2014", val, per_image, annotated=True)
    _vqa_files(layout, seed, "test2015", test, per_image, annotated=False)
    _pretrain_files(layout, seed, train, sizes.texts)
    classification = write_classification_files(
        layout, _rendered(layout, train), _rendered(layout, val), sizes.image_size
    )
    questions = train_questions | val_questions
    return _CocoFiles(train, val, test, retrieval_test_images, vqa_train, vqa_val, questions, classification)


def build_corpus(
    out: str | os.PathLike, seed: int = 0, sizes: SynthSizes | None = None, workers: int = 1
) -> dict[str, Any]:
    """Writes the synthetic corpus under ``out`` (see the module docstring) and returns its summary, also written to
    ``out/synth.json``: the sizes, file counts and each task's chance level.

    ``workers`` > 1 writes the COCO part and each NLVR2 split in that many processes at once
    (:func:`mmoe.data.processes.run_in_processes`); the files are the same.
    """
    sizes = sizes or SynthSizes()
    layout = CorpusLayout(Path(out))
    nlvr2_sets = {"train": sizes.nlvr2_train_sets, "dev": sizes.nlvr2_eval_sets, "test1": sizes.nlvr2_eval_sets}
    jobs = [partial(_coco_files, layout, seed, sizes)]
    jobs += [partial(_nlvr2_split, layout, seed, split, sets, sizes.image_size) for split, sets in nlvr2_sets.items()]
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
            "classification_images": {"train": len(train), "val": len(val)},
        },
        "chance": {
            **chance_summary(
                coco.vqa_train, coco.vqa_val, coco.questions, train, val[third : 2 * third], coco.retrieval_test_images
            ),
            "classification_val": coco.classification_chance,
        },
    }
    _write_json(layout.summary, summary)
    return summary
