"""Texts of the synthetic corpus: captions, VQA questions with 10 human-style answers, NLVR2-style statements.

Every text is a function of a scene (or a pair of scenes) and a ``numpy.random.Generator``, so a seed fixes them all.
The vocabulary is small: the attribute words of :mod:`mmoe.data.synth.scenes` and a few dozen function words.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mmoe.data.synth.scenes import COLORS, PLURALS, ROWS, SHAPES, SIZES, TEXTURES, Scene

NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six")
# Colours / shapes / patterns people confuse: what a careless annotator answers instead.
CONFUSIONS = {
    "red": "purple",
    "purple": "blue",
    "blue": "purple",
    "green": "yellow",
    "yellow": "white",
    "white": "yellow",
    "circle": "square",
    "square": "cross",
    "triangle": "cross",
    "cross": "square",
    "plain": "striped",
    "striped": "dotted",
    "dotted": "plain",
    "small": "large",
    "large": "small",
    "top": "middle",
    "middle": "bottom",
    "bottom": "middle",
    "yes": "no",
    "no": "yes",
}


def _pick(rng: np.random.Generator, options):
    options = list(options)
    return options[int(rng.integers(len(options)))]


def _located(obj, rng: np.random.Generator) -> str:
    where = _pick(rng, ("at the", "near the", "in the")) if obj.row != "middle" else "in the"
    return f"a {obj.phrase()} {where} {obj.row}"


def _listing(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _where(row: str) -> str:
    return "in the middle" if row == "middle" else f"at the {row}"


def captions(scene: Scene, rng: np.random.Generator, count: int = 5) -> list[str]:
    """``count`` different descriptions of a scene (COCO has 5 per image), from six templates."""
    objects = list(scene.shapes)
    n = len(objects)
    shuffled = [objects[i] for i in rng.permutation(n)]
    order_words = " in the image" if n == 1 else " from top to bottom"
    templates = [
        _listing([_located(o, rng) for o in objects]),
        f"{NUMBER_WORDS[n]} {'shape' if n == 1 else 'shapes'} on a dark background: "
        + _listing([f"a {o.phrase()}" for o in objects]),
        "there is " + _listing([_located(o, rng) for o in shuffled]),
        "a picture of " + _listing([f"a {o.phrase(size=False)}" for o in shuffled]),
        _listing([f"a {o.size} {o.color} {o.shape}" for o in objects]) + order_words,
        "an image with " + _listing([f"a {o.phrase(texture=False)} {_where(o.row)}" for o in objects]),
    ]
    order = rng.permutation(len(templates))[:count]
    return [templates[i] for i in sorted(order)]


@dataclass(frozen=True)
class Question:
    """A VQA question about a scene.

    Attributes:
        text: the question.
        answer: the correct answer, already in normalised form.
        answer_type: ``yes/no``, ``number`` or ``other`` (VQAv2's answer types).
        question_type: VQAv2-style question type (the question's first words).
    """

    text: str
    answer: str
    answer_type: str
    question_type: str


def _yes_no(scene: Scene, rng: np.random.Generator, want_yes: bool) -> Question:
    kind = _pick(rng, ("exists", "texture", "row"))
    target = _pick(rng, scene.shapes)
    if kind == "exists":
        if want_yes:
            color, shape = target.color, target.shape
        else:
            absent = [(c, s) for c in COLORS for s in SHAPES if not scene.count(color=c, shape=s)]
            color, shape = _pick(rng, absent)
        return Question(f"is there a {color} {shape}?", "yes" if want_yes else "no", "yes/no", "is there a")
    if kind == "texture":
        texture = target.texture if want_yes else _pick(rng, [t for t in TEXTURES if t != target.texture])
        answer = "yes" if want_yes else "no"
        return Question(f"is the {target.color} {target.shape} {texture}?", answer, "yes/no", "is the")
    row = target.row if want_yes else _pick(rng, [r for r in ROWS if r != target.row])
    answer = "yes" if want_yes else "no"
    return Question(f"is the {target.color} {target.shape} {_where(row)}?", answer, "yes/no", "is the")


def _number(scene: Scene, rng: np.random.Generator, want_yes: bool) -> Question:
    kind = _pick(rng, ("all", "color", "shape", "texture"))
    if kind == "all":
        return Question("how many shapes are there?", str(len(scene.shapes)), "number", "how many")
    if kind == "color":
        color = _pick(rng, COLORS) if rng.random() < 0.3 else _pick(rng, scene.shapes).color
        return Question(f"how many {color} shapes are there?", str(scene.count(color=color)), "number", "how many")
    if kind == "shape":
        shape = _pick(rng, SHAPES) if rng.random() < 0.3 else _pick(rng, scene.shapes).shape
        return Question(f"how many {PLURALS[shape]} are there?", str(scene.count(shape=shape)), "number", "how many")
    texture = _pick(rng, ("striped", "dotted"))
    return Question(f"how many {texture} shapes are there?", str(scene.count(texture=texture)), "number", "how many")


def _other(scene: Scene, rng: np.random.Generator, want_yes: bool) -> Question:
    target = _pick(rng, scene.shapes)
    where = _where(target.row)
    kind = _pick(rng, ("color", "shape", "pattern", "size"))
    if kind == "color":
        return Question(f"what color is the shape {where}?", target.color, "other", "what color is the")
    if kind == "shape":
        return Question(f"what shape is {where}?", target.shape, "other", "what")
    if kind == "pattern":
        return Question(f"what pattern does the {target.color} {target.shape} have?", target.texture, "other", "what")
    return Question(f"what size is the {target.color} {target.shape}?", target.size, "other", "what")


QUESTION_FAMILIES: dict[str, Callable[[Scene, np.random.Generator, bool], Question]] = {
    "yes/no": _yes_no,
    "number": _number,
    "other": _other,
}


def questions(scene: Scene, rng: np.random.Generator, count: int) -> list[Question]:
    """Up to ``count`` distinct questions; answer types drawn 38% yes/no, 12% number, 50% other (about VQAv2's mix).
    Whether a yes/no question's answer is yes is decided first (even odds), then a new question with that answer
    is drawn, so repeated questions cannot tilt the balance."""
    found: dict[str, Question] = {}
    for _ in range(count):
        family = ("yes/no", "number", "other")[int(rng.choice(3, p=(0.38, 0.12, 0.5)))]
        want_yes = bool(rng.integers(2))
        for _ in range(20):
            question = QUESTION_FAMILIES[family](scene, rng, want_yes)
            if question.text not in found:
                found[question.text] = question
                break
    return list(found.values())


def human_answers(question: Question, rng: np.random.Generator, annotators: int = 10) -> list[str]:
    """Answers of ``annotators`` people: most give the right answer, some (per-question carefulness) a confusable
    or off-by-one answer; a few add a trailing period (removed by the official punctuation rule)."""
    error_rate = float(rng.choice((0.0, 0.0, 0.1, 0.2)))
    answers = []
    for _ in range(annotators):
        answer = question.answer
        if rng.random() < error_rate:
            if question.answer_type == "number":
                answer = str(max(0, int(answer) + _pick(rng, (-1, 1))))
            else:
                answer = CONFUSIONS.get(answer, answer)
        if rng.random() < 0.05:
            answer += "."
        answers.append(answer)
    return answers


def majority_answer(answers: list[str]) -> str:
    """VQAv2's ``multiple_choice_answer``: the most common answer (period-stripped), ties to the first given."""
    cleaned = [answer.rstrip(".") for answer in answers]
    counts = Counter(cleaned)
    return max(cleaned, key=lambda answer: (counts[answer], -cleaned.index(answer)))


@dataclass(frozen=True)
class Statement:
    """An NLVR2-style sentence about a pair of scenes and its truth test."""

    text: str
    holds: Callable[[Scene, Scene], bool]


def _side(scenes: tuple[Scene, Scene], side: str) -> Scene:
    return scenes[0] if side == "left" else scenes[1]


#: Share of NLVR2 sets whose statement is the image comparison "there are more shapes in the left image than in the
#: right image". Its words are the same in every set, so its truth is a function of the two images alone: a model
#: trained from scratch gets a signal from it before it can relate words to image content, which the six slotted
#: templates need (each value of a slot is true of different images, so averaged over the slot's values the image
#: content alone tells nothing). tasks/nlvr2/README.md measures both kinds.
COMPARISON_SHARE = 0.5


def statement(rng: np.random.Generator) -> Statement:
    """A random statement: the left/right shape-count comparison with probability :data:`COMPARISON_SHARE`, otherwise
    one of six templates with random attribute values (colours, shapes, textures, sizes, sides, number words)."""
    if rng.random() < COMPARISON_SHARE:
        return Statement(
            "there are more shapes in the left image than in the right image",
            lambda a, b: len(a.shapes) > len(b.shapes),
        )
    color, shape, size = _pick(rng, COLORS), _pick(rng, SHAPES), _pick(rng, SIZES)
    texture, side = _pick(rng, ("striped", "dotted")), _pick(rng, ("left", "right"))
    n, total = int(rng.integers(1, 4)), int(rng.integers(2, 6))

    def has(scene: Scene, **attributes: str) -> bool:
        return scene.count(**attributes) > 0

    templates = [
        (
            f"the {side} image contains a {color} {shape}",
            lambda a, b: has(_side((a, b), side), color=color, shape=shape),
        ),
        (f"both images contain a {color} shape", lambda a, b: has(a, color=color) and has(b, color=color)),
        (f"there are {NUMBER_WORDS[total]} shapes in total", lambda a, b: len(a.shapes) + len(b.shapes) == total),
        (
            f"exactly one image contains a {texture} {shape}",
            lambda a, b: has(a, texture=texture, shape=shape) != has(b, texture=texture, shape=shape),
        ),
        (
            f"each image contains exactly {NUMBER_WORDS[n]} {'shape' if n == 1 else 'shapes'}",
            lambda a, b: len(a.shapes) == n and len(b.shapes) == n,
        ),
        (
            f"the {side} image has a {size} shape at the top",
            lambda a, b: has(_side((a, b), side), size=size, row="top"),
        ),
    ]
    text, holds = templates[int(rng.integers(len(templates)))]
    return Statement(text, holds)
