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
        share of them found in the same image's references; c the mean, over those occurrences, of the share of
        all images whose references hold the word. Both 0.0 when no listed word occurs.
    """
    listed = {word.lower() for word in words}
    missing = [image_id for image_id in predictions if image_id not in references]
    if missing:
        raise KeyError(f"predicted image ids {missing[:5]} have no references")
    in_refs = {image_id: {w for caption in captions for w in _words(caption)} & listed
               for image_id, captions in references.items()}  # fmt: skip
    share = {word: sum(word in found for found in in_refs.values()) / max(1, len(in_refs)) for word in listed}
    count = hits = 0
    chance = 0.0
    for image_id, caption in predictions.items():
        for word in _words(caption):
            if word in listed:
                count += 1
                hits += word in in_refs[image_id]
                chance += share[word]
    if not count:
        return {"words": 0, "precision": 0.0, "chance": 0.0}
    return {"words": count, "precision": hits / count, "chance": chance / count}
