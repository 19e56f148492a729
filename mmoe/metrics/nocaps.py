"""NoCaps (Agrawal et al., 2019): COCO caption metrics per domain, and the results file its evaluation server takes.

NoCaps' files follow COCO's captions format: ``nocaps_val_4500_captions.json`` holds ``images`` (``id``,
``file_name``, ``open_images_id``, ..., and ``domain``: ``in-domain``, ``near-domain`` or ``out-domain``, how far the
image's objects are from COCO's classes) and ``annotations`` (``image_id``, ``id``, ``caption``; 10 per image);
``nocaps_test_image_info.json`` holds ``images`` only (its captions are private). The evaluation server (EvalAI
challenge 355; nocaps-org/updown-baseline ``updown/utils/evalai.py``) takes a JSON list of ``{"image_id": int,
"caption": str}``, one per image of the split, and reports each metric on the images of each domain and on all of them
(``entire``). :func:`score_by_domain` does the same with pycocoevalcap (:mod:`mmoe.metrics.captions`): every domain's
subset scored as COCOEvalCap scores a results file, so CIDEr's IDF comes from that subset's references.

A file that has annotations names every image's domain and gives every image a caption; a file without them (image
info) names the domain of every image or of none.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmoe.atomic import write_json_atomic
from mmoe.io import OutputPathError, check_output_path, json_excerpt, writing_output
from mmoe.metrics.captions import (
    DEFAULT_SPICE_TIMEOUT,
    METRICS,
    load_caption_results,
    score_tokenized,
    tokenize_captions,
)
from mmoe.metrics.files import EvalInputError, read_json, require_field

#: NoCaps' domains, as its files' ``domain`` field and the evaluation server name them.
DOMAINS = ("in-domain", "near-domain", "out-domain")
#: The evaluation server's name for all images of the split.
ENTIRE = "entire"
#: What a report says of a split whose captions are private.
SERVER_ONLY = "the NoCaps evaluation server (EvalAI challenge 355) scores this split; its captions are private"


def image_domain(image: dict[str, Any], where: str, required: bool, error: type[Exception]) -> str | None:
    """The ``domain`` field of one of a file's ``images`` (None when absent and not ``required``), one of
    :data:`DOMAINS`; else ``error`` naming ``where``, the value and the domains expected."""
    if "domain" not in image:
        if not required:
            return None
        raise error(f"{where}: missing field 'domain'; expected one of {', '.join(DOMAINS)}")
    domain = image["domain"]
    if domain not in DOMAINS:
        raise error(f"{where}: field 'domain' = {json_excerpt(domain)}: expected one of {', '.join(DOMAINS)}")
    return domain


def checked_domains(domains: Sequence[str | None], where: str, error: type[Exception]) -> None:
    """Every image of a file has a domain, or none has; else ``error`` naming the first image without one."""
    if None in domains and any(domain is not None for domain in domains):
        first = domains.index(None)
        raise error(f"{where}: images[{first}] has no 'domain' while other images have one; expected it on every image")


@dataclass(frozen=True)
class NocapsSplit:
    """The images of a NoCaps file in its order: ``references`` image id -> captions (empty lists in a file without
    annotations), ``domains`` image id -> domain (None in a file without domains)."""

    path: Path
    references: dict[Hashable, list[str]]
    domains: dict[Hashable, str | None]

    @property
    def annotated(self) -> bool:
        return any(self.references.values())


def load_nocaps_file(path: str | Path) -> NocapsSplit:
    """Reads ``nocaps_val_4500_captions.json`` or ``nocaps_test_image_info.json`` (any COCO-style NoCaps file).

    Raises:
        EvalInputError: malformed JSON, an image without ``id`` or with a domain outside :data:`DOMAINS` (missing in
            a file with annotations), an id twice, a caption of an unknown image, an image without a caption in a
            file with annotations.
    """
    path = Path(path)
    data = read_json(path)
    images = require_field(data, "images", list, str(path))
    has_annotations = data.get("annotations") is not None
    annotations = require_field(data, "annotations", list, str(path)) if has_annotations else []
    references: dict[Hashable, list[str]] = {}
    domains: dict[Hashable, str | None] = {}
    for index, image in enumerate(images):
        where = f"{path}, images[{index}]"
        image_id = require_field(image, "id", int, where)
        if image_id in references:
            raise EvalInputError(f"{where}: image id {image_id} appears twice")
        references[image_id] = []
        domains[image_id] = image_domain(image, f"{where} (id {image_id})", bool(annotations), EvalInputError)
    checked_domains(list(domains.values()), str(path), EvalInputError)
    for index, annotation in enumerate(annotations):
        where = f"{path}, annotations[{index}]"
        image_id = require_field(annotation, "image_id", int, where)
        if image_id not in references:
            raise EvalInputError(f"{where}: image id {image_id} is not in 'images'")
        references[image_id].append(require_field(annotation, "caption", str, f"{where} (image id {image_id})"))
    if annotations:
        uncaptioned = [image_id for image_id, captions in references.items() if not captions]
        if uncaptioned:
            raise EvalInputError(
                f"{path}: no caption in 'annotations' for {len(uncaptioned)} of the {len(references)} images (first: "
                f"image id {uncaptioned[0]}); expected captions for every image"
            )
    return NocapsSplit(path, references, domains)


def score_by_domain(
    split: NocapsSplit,
    predictions: Mapping[Hashable, str],
    *,
    meteor: bool = True,
    spice: bool = True,
    spice_timeout: float = DEFAULT_SPICE_TIMEOUT,
) -> dict[str, dict[str, Any]]:
    """The metrics of :func:`mmoe.metrics.captions.score_captions` on each domain's images and on all of them.

    Returns:
        ``{"in-domain": ..., "near-domain": ..., "out-domain": ..., "entire": ...}``, each the metrics of the images
        of that domain with a prediction, plus ``images_scored`` and ``images_total``; a domain without a scored
        image gives the counts only. The PTB tokenizer runs once for all images.
    """
    gts, res = tokenize_captions(split.references, predictions)
    report = {}
    for domain in (*DOMAINS, ENTIRE):
        if domain != ENTIRE and None in split.domains.values():
            continue
        ids = [i for i in gts if domain == ENTIRE or split.domains[i] == domain]
        total = sum(domain == ENTIRE or d == domain for d in split.domains.values())
        scores = (
            score_tokenized(
                {i: gts[i] for i in ids},
                {i: res[i] for i in ids},
                meteor=meteor,
                spice=spice,
                spice_timeout=spice_timeout,
            )
            if ids
            else {}
        )
        report[domain] = {**scores, "images_scored": len(ids), "images_total": total}
    return report


def domain_table(report: Mapping[str, Mapping[str, Any]]) -> str:
    """The per-domain report as a Markdown table: a row per metric, a column per domain (fractions, as
    pycocoevalcap reports them; "-" where a metric was not computed)."""
    columns = list(report)
    lines = ["| metric | " + " | ".join(columns) + " |", "| --- |" + " --- |" * len(columns)]
    for name in (*METRICS, "images_scored", "images_total"):
        cells = [report[column].get(name) for column in columns]
        shown = [f"{cell:.4f}" if isinstance(cell, float) else "-" if cell is None else str(cell) for cell in cells]
        lines.append(f"| {name} | " + " | ".join(shown) + " |")
    return "\n".join(lines)


def write_submission(path: str | Path, split: NocapsSplit, predictions: Mapping[Hashable, str], results: str) -> int:
    """Writes the evaluation server's results file: ``[{"image_id", "caption"}]``, one entry per image of ``split`` in
    its order (whole or absent); returns the entries written.

    Raises:
        EvalInputError: an image of the split without a caption in ``results``, or ``path`` cannot be written.
    """
    missing = [image_id for image_id in split.references if image_id not in predictions]
    if missing:
        raise EvalInputError(
            f"{results}: no caption for {len(missing)} of the {len(split.references)} images of {split.path} (first: "
            f"image id {missing[0]}); the evaluation server takes one caption for every image"
        )
    entries = [{"image_id": image_id, "caption": predictions[image_id]} for image_id in split.references]
    try:
        with writing_output(path, "--submission"):
            write_json_atomic(path, entries)
    except OutputPathError as error:
        raise EvalInputError(str(error)) from None
    return len(entries)


def evaluate_nocaps_files(
    results: str | Path,
    annotations: str | Path,
    submission: str | Path | None = None,
    *,
    meteor: bool = True,
    spice: bool = True,
    spice_timeout: float = DEFAULT_SPICE_TIMEOUT,
) -> dict[str, Any]:
    """What ``mmoe eval nocaps`` prints: a file with captions scored per domain (:func:`score_by_domain`), one
    without them counted per domain; with ``submission``, the evaluation server's results file written there."""
    if submission is not None:
        try:
            check_output_path(submission, "--submission")
        except OutputPathError as error:
            raise EvalInputError(str(error)) from None
    split = load_nocaps_file(annotations)
    predictions = load_caption_results(results, split.references, set(split.references), str(annotations))
    if split.annotated:
        report: dict[str, Any] = score_by_domain(
            split, predictions, meteor=meteor, spice=spice, spice_timeout=spice_timeout
        )
    else:
        report = {"images": _domain_counts(split), "captions": len(predictions), "scored": SERVER_ONLY}
    if submission is not None:
        report["submission"] = {
            "path": str(submission),
            "entries": write_submission(submission, split, predictions, str(results)),
        }
    return report


def _domain_counts(split: NocapsSplit) -> dict[str, int]:
    counts = {domain: sum(d == domain for d in split.domains.values()) for domain in DOMAINS}
    return {**(counts if None not in split.domains.values() else {}), ENTIRE: len(split.domains)}
