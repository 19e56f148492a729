"""COCO caption metrics (BLEU-1..4, METEOR, ROUGE-L, CIDEr, SPICE) computed by pycocoevalcap, as its COCOEvalCap does.

``pycocoevalcap/eval.py`` (``COCOEvalCap.evaluate``) gathers, for every scored image, its reference captions and the
one result caption, tokenizes both sides with the Stanford PTB tokenizer (Java; lower-cased, punctuation tokens
dropped), then runs ``Bleu(4)`` (corpus BLEU, "closest" reference length), ``Meteor()`` (METEOR 1.5 jar),
``Rouge()`` (ROUGE-L, beta 1.2), ``Cider()`` (CIDEr-D with IDF from the scored references) and ``Spice()``. The images
scored are those of the results (the coco-caption demo sets ``cocoEval.params['image_id'] = cocoRes.getImgIds()``),
in the order of the ground truth. mmoe calls the same pycocoevalcap scorers on the same tokenized input in the same
order, so the numbers are pycocoevalcap's. Two differences in what happens around them: SPICE never downloads
anything (:mod:`mmoe.metrics.spice`), and a carriage return inside a caption becomes a space before tokenization
(pycocoevalcap replaces only newlines, and the tokenizer's line-per-caption protocol would shift every later caption).
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

from mmoe.metrics.files import EvalInputError, read_json, require_field, require_list
from mmoe.metrics.spice import compute_spice

METRICS = ("Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr", "SPICE")

#: Seconds after which the SPICE jar is stopped and SPICE reported unavailable (it takes minutes on 5,000 images).
DEFAULT_SPICE_TIMEOUT = 1800.0


class ScorerUnavailableError(RuntimeError):
    """A Java-based scorer that every caption score needs (PTB tokenizer, METEOR) could not run."""


def score_captions(
    references: Mapping[Hashable, Sequence[str]],
    predictions: Mapping[Hashable, str],
    *,
    meteor: bool = True,
    spice: bool = True,
    spice_timeout: float = DEFAULT_SPICE_TIMEOUT,
) -> dict[str, Any]:
    """Scores one predicted caption per image against the reference captions, with pycocoevalcap.

    Args:
        references: image id -> raw reference captions; its order is the order images are scored in.
        predictions: image id -> raw predicted caption. Only these images are scored; ground-truth images without a
            prediction are left out with a warning, as the official code scores the images of the results.
        meteor: compute METEOR (its jar loads a 62 MB paraphrase table: seconds even for a few captions); ``False``
            reports ``"METEOR": None`` with ``"METEOR_unavailable": "not requested"``.
        spice: compute SPICE (slow: minutes on 5,000 images); ``False`` reports it as not requested.
        spice_timeout: seconds before the SPICE jar is stopped.

    Returns:
        ``{"Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr", "SPICE"}`` as fractions (CIDEr can
        exceed 1), with ``"SPICE": None`` and a one-line ``"SPICE_unavailable"`` reason when SPICE cannot run, and
        ``"images_scored"`` of ``"images_total"`` (the ground-truth images; a partial results file scores fewer).

    Raises:
        EvalInputError: no prediction, a prediction for an image without references, or a non-string caption.
        ScorerUnavailableError: Java is missing, or the PTB tokenizer or METEOR failed.
    """
    gts, res = tokenize_captions(references, predictions)
    report = score_tokenized(gts, res, meteor=meteor, spice=spice, spice_timeout=spice_timeout)
    report["images_scored"], report["images_total"] = len(gts), len(references)
    return report


def tokenize_captions(
    references: Mapping[Hashable, Sequence[str]], predictions: Mapping[Hashable, str]
) -> tuple[dict[Hashable, list[str]], dict[Hashable, list[str]]]:
    """The checked images' PTB-tokenized reference and predicted captions (``gts``, ``res``), in the order of
    ``references``: the input of :func:`score_tokenized`. The tokenizer treats each caption on its own (one per
    line), so the captions of a subset of the images are those of the whole set.

    Raises:
        EvalInputError, ScorerUnavailableError: as :func:`score_captions`.
    """
    image_ids = _checked_image_ids(references, predictions)
    if shutil.which("java") is None:
        raise ScorerUnavailableError("java not found on PATH: the PTB tokenizer and METEOR of pycocoevalcap need it")
    gts = _tokenize({i: references[i] for i in image_ids}, "reference")
    res = _tokenize({i: [predictions[i]] for i in image_ids}, "predicted")
    return gts, res


def score_tokenized(
    gts: dict[Hashable, list[str]],
    res: dict[Hashable, list[str]],
    *,
    meteor: bool = True,
    spice: bool = True,
    spice_timeout: float = DEFAULT_SPICE_TIMEOUT,
) -> dict[str, Any]:
    """The metrics of :func:`score_captions` (without the image counts) over tokenized captions, one result each."""
    report = _score_tokenized(gts, res, meteor)
    if not meteor:
        report["METEOR_unavailable"] = "not requested"
    if spice:
        report["SPICE"], reason = compute_spice(gts, {i: captions[0] for i, captions in res.items()}, spice_timeout)
    else:
        report["SPICE"], reason = None, "not requested"
    if reason is not None:
        report["SPICE_unavailable"] = reason
    return report


def _checked_image_ids(references: Mapping[Hashable, Sequence[str]], predictions: Mapping[Hashable, str]) -> list:
    if not predictions:
        raise EvalInputError("no predicted caption to score")
    for image_id, caption in predictions.items():
        if image_id not in references:
            raise EvalInputError(f"predicted caption for image id {image_id!r}, which has no reference captions")
        if not isinstance(caption, str):
            raise EvalInputError(f"image id {image_id!r}: predicted caption must be a string, got {caption!r}")
    image_ids = [image_id for image_id in references if image_id in predictions]
    for image_id in image_ids:
        captions = references[image_id]
        if isinstance(captions, str) or not captions or not all(isinstance(c, str) for c in captions):
            raise EvalInputError(f"image id {image_id!r}: expected a non-empty list of reference strings")
    missing = len(references) - len(image_ids)
    if missing:
        warnings.warn(
            f"{missing} of {len(references)} ground-truth images have no predicted caption; scoring the "
            f"{len(image_ids)} images that have one, as the official COCO caption evaluation does",
            stacklevel=4,
        )
    return image_ids


def _tokenize(captions: Mapping[Hashable, Sequence[str]], side: str) -> dict[Hashable, list[str]]:
    """pycocoevalcap's PTBTokenizer on ``{image_id: [{"caption": ...}]}``, checked caption for caption."""
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    entries = {i: [{"caption": c.replace("\r", " ")} for c in texts] for i, texts in captions.items()}
    try:
        tokenized = PTBTokenizer().tokenize(entries)
    except OSError as error:
        raise ScorerUnavailableError(f"the PTB tokenizer (Java) could not run: {error}") from None
    if any(len(tokenized.get(i, ())) != len(texts) for i, texts in captions.items()):
        raise ScorerUnavailableError(f"the PTB tokenizer (Java) returned fewer {side} captions than it was given")
    return tokenized


def _score_tokenized(gts: dict[Hashable, list[str]], res: dict[Hashable, list[str]], meteor: bool) -> dict[str, Any]:
    """BLEU, METEOR, ROUGE-L and CIDEr exactly as ``COCOEvalCap.evaluate`` calls them (BLEU without its prints);
    ``"METEOR": None`` when ``meteor`` is false."""
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge

    bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
    meteor_score = _meteor(gts, res) if meteor else None
    rouge, _ = Rouge().compute_score(gts, res)
    cider, _ = Cider().compute_score(gts, res)
    report = {f"Bleu_{n}": float(score) for n, score in enumerate(bleu, start=1)}
    report.update({"METEOR": meteor_score, "ROUGE_L": float(rouge), "CIDEr": float(cider)})
    return report


def _meteor(gts: dict[Hashable, list[str]], res: dict[Hashable, list[str]]) -> float:
    from pycocoevalcap.meteor.meteor import Meteor

    meteor_scorer = Meteor()
    jar = meteor_scorer.meteor_p
    try:
        meteor, _ = meteor_scorer.compute_score(gts, res)
    except ValueError as error:  # the jar died: its empty reply is not a number
        if meteor_scorer.lock.locked():
            meteor_scorer.lock.release()  # else Meteor.__del__ would wait on it forever
        raise ScorerUnavailableError(f"METEOR (meteor-1.5.jar) failed: {error}") from None
    finally:
        del meteor_scorer  # Meteor.__del__ closes the jar's input, stops it and waits for it ...
        jar.stdout.close()  # ... and leaves its output pipes open (a ResourceWarning each when collected)
        jar.stderr.close()
    return float(meteor)


def load_coco_references(path: str | Path) -> tuple[dict[Hashable, list[str]], set[Hashable]]:
    """Reads a COCO ``captions_*.json``: references per image in the order of ``images``, and all known image ids.

    Returns:
        ``(references, known_ids)``: image id -> captions (annotation order) for images with at least one caption,
        ordered like the file's ``images`` list (first appearance in ``annotations`` without one); and every image id
        the file names, as pycocotools' ``loadRes`` accepts results for them.
    """
    data = read_json(path)
    annotations = require_field(data, "annotations", list, str(path))
    by_image: dict[Hashable, list[str]] = {}
    for index, entry in enumerate(annotations):
        where = f"{path}, annotation {index}"
        image_id = require_field(entry, "image_id", (int, str), where)
        by_image.setdefault(image_id, []).append(require_field(entry, "caption", str, where))
    if not isinstance(data, dict) or "images" not in data:
        return by_image, set(by_image)
    images = require_field(data, "images", list, str(path))
    order = [require_field(image, "id", (int, str), f"{path}, image {i}") for i, image in enumerate(images)]
    references = {image_id: by_image[image_id] for image_id in order if image_id in by_image}
    return references, set(order)


def load_karpathy_references(path: str | Path, split: str) -> dict[Hashable, list[str]]:
    """Reads Karpathy's ``dataset_coco.json``: image ``cocoid`` -> ``raw`` sentences for the images of ``split``."""
    data = read_json(path)
    images = require_field(data, "images", list, str(path))
    references: dict[Hashable, list[str]] = {}
    splits: set[str] = set()
    for index, image in enumerate(images):
        where = f"{path}, image {index}"
        image_split = require_field(image, "split", str, where)
        splits.add(image_split)
        if image_split != split:
            continue
        image_id = require_field(image, "cocoid", (int, str), where)
        sentences = require_field(image, "sentences", list, f"{where} (cocoid {image_id!r})")
        raws = [
            require_field(s, "raw", str, f"{where} (cocoid {image_id!r}), sentence {j}")
            for j, s in enumerate(sentences)
        ]
        if not raws:
            raise EvalInputError(f"{where} (cocoid {image_id!r}): no sentences; expected its reference captions")
        references[image_id] = raws
    if not references:
        raise EvalInputError(f"{path}: no image in split {split!r}; the file has splits {sorted(splits)}")
    return references


def load_caption_results(
    path: str | Path, references: Mapping[Hashable, Sequence[str]], known_ids: set[Hashable], reference_name: str
) -> dict[Hashable, str]:
    """Reads a results file ``[{"image_id", "caption"}, ...]`` and checks every image id against the references.

    Raises:
        EvalInputError: malformed JSON or entry, an image id the references do not know or that has no reference
            caption, or two captions for one image (pycocoevalcap's scorers assert one per image).
    """
    entries = require_list(read_json(path), str(path), "{image_id, caption} objects")
    predictions: dict[Hashable, str] = {}
    for index, entry in enumerate(entries):
        image_id = require_field(entry, "image_id", (int, str), f"{path}, entry {index}")
        caption = require_field(entry, "caption", str, f"{path}, entry {index} (image id {image_id!r})")
        if image_id not in known_ids:
            raise EvalInputError(f"{path}, entry {index}: image id {image_id!r} is not in {reference_name}")
        if image_id not in references:
            raise EvalInputError(
                f"{path}, entry {index}: image id {image_id!r} has no reference caption in {reference_name}"
            )
        if image_id in predictions:
            raise EvalInputError(
                f"{path}, entry {index}: second caption for image id {image_id!r}; expected one per image"
            )
        predictions[image_id] = caption
    if not predictions:
        raise EvalInputError(f"{path}: no result; expected one caption per scored image")
    return predictions


def read_caption_files(
    results: str | Path,
    annotations: str | Path | None = None,
    karpathy: str | Path | None = None,
    split: str = "test",
) -> tuple[dict[Hashable, list[str]], dict[Hashable, str]]:
    """``(references, predictions)`` as :func:`score_captions` takes them: references from ``captions_*.json`` or
    Karpathy's file and split, predictions from the results file, checked against them."""
    if (annotations is None) == (karpathy is None):
        raise EvalInputError("give exactly one of --annotations (captions_*.json) and --karpathy (dataset_coco.json)")
    if annotations is not None:
        references, known_ids = load_coco_references(annotations)
        name = str(annotations)
    else:
        references = load_karpathy_references(karpathy, split)
        known_ids, name = set(references), f"the {split!r} split of {karpathy}"
    return references, load_caption_results(results, references, known_ids, name)


def evaluate_caption_files(
    results: str | Path,
    annotations: str | Path | None = None,
    karpathy: str | Path | None = None,
    split: str = "test",
    *,
    meteor: bool = True,
    spice: bool = True,
    spice_timeout: float = DEFAULT_SPICE_TIMEOUT,
) -> dict[str, Any]:
    """What ``mmoe eval caption`` prints: the files read by :func:`read_caption_files`, then scored."""
    references, predictions = read_caption_files(results, annotations, karpathy, split)
    return score_captions(references, predictions, meteor=meteor, spice=spice, spice_timeout=spice_timeout)
