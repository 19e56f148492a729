"""Do generated captions name what is in the image? Precision of chosen words (e.g. colours) against the references.

CIDEr and BLEU reward a caption that repeats the references' sentence structure whatever it says about the picture:
on the synthetic corpus a model that writes the common template with the wrong colours beats the constant caption.
This check looks only at a list of content words: of the listed words a caption uses (each occurrence counted), the
share that the same image's references use too. Its chance level is the same words checked against a random image:
for each occurrence, the share of all images whose references use that word. A caption model that reads the image
scores above that level; one that writes fixed words scores at it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence


def _words(text: str) -> list[str]:
    return [word.strip(".,;:!?\"'()").lower() for word in text.split()]


def word_counts(
    predictions: Mapping[Hashable, str],
    references: Mapping[Hashable, Sequence[str]],
    words: Iterable[str],
) -> dict[Hashable, tuple[int, int]]:
    """Per predicted image, ``(right, written)``: of the listed ``words`` its caption uses (each occurrence counted),
    the number its references use too, and the number in all. Summed over the images: :func:`word_precision`.

    Raises:
        KeyError: a predicted image id without references.
    """
    return _right_and_written(*_listed_words(predictions, references, words))


def word_precision(
    predictions: Mapping[Hashable, str],
    references: Mapping[Hashable, Sequence[str]],
    words: Iterable[str],
) -> dict[str, float | int]:
    """Precision of ``words`` in the predicted captions against each image's references, and its chance level.

    Args:
        predictions: image id -> generated caption.
        references: image id -> reference captions; every predicted id must be here.
        words: the content words checked (e.g. the synthetic world's colours, :data:`mmoe.data.synth.scenes.COLORS`).

    Returns:
        ``{"words": n, "precision": p, "chance": c}``: n occurrences of the listed words in the predictions; p the
        share of them found in the same image's references (:func:`word_counts` summed); c the mean, over those
        occurrences, of the share of all images whose references hold the word. Both 0.0 when no listed word occurs.
    """
    written, in_refs = _listed_words(predictions, references, words)
    counts = _right_and_written(written, in_refs).values()
    count = sum(total for _, total in counts)
    if not count:
        return {"words": 0, "precision": 0.0, "chance": 0.0}
    used = {word for found in written.values() for word in found}
    share = {word: sum(word in found for found in in_refs.values()) / max(1, len(in_refs)) for word in used}
    chance = sum(share[word] for found in written.values() for word in found)
    return {"words": count, "precision": sum(right for right, _ in counts) / count, "chance": chance / count}


def _listed_words(
    predictions: Mapping[Hashable, str], references: Mapping[Hashable, Sequence[str]], words: Iterable[str]
) -> tuple[dict[Hashable, list[str]], dict[Hashable, set[str]]]:
    """Per predicted image the listed words its caption uses, in order; per image of ``references`` the listed words
    its references use (lower case). KeyError for a predicted image without references."""
    listed = {word.lower() for word in words}
    missing = [image_id for image_id in predictions if image_id not in references]
    if missing:
        raise KeyError(f"predicted image ids {missing[:5]} have no references")
    in_refs = {
        image_id: {w for caption in captions for w in _words(caption)} & listed
        for image_id, captions in references.items()
    }
    written = {
        image_id: [word for word in _words(caption) if word in listed] for image_id, caption in predictions.items()
    }
    return written, in_refs


def _right_and_written(
    written: Mapping[Hashable, list[str]], in_refs: Mapping[Hashable, set[str]]
) -> dict[Hashable, tuple[int, int]]:
    return {
        image_id: (sum(word in in_refs[image_id] for word in found), len(found)) for image_id, found in written.items()
    }
