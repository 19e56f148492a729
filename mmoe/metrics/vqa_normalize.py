"""The official VQA answer normalisation, quirks included: what the official evaluation does to the answers before it
compares them (:mod:`mmoe.metrics.vqa` scores with it; :mod:`mmoe.data.answers` builds vocabularies and soft targets
with it).

Reference: GT-Vision-Lab/VQA, ``PythonEvaluationTools/vqaEvaluation/vqaEval.py`` (latest commit). For every question
the official script replaces newlines and tabs by spaces and strips the predicted answer and each ground-truth answer;
then, **only when the ground-truth answers are not all identical**, it runs the punctuation and then the
digit/article/contraction processing on the ground-truth answers *and on the prediction* (:func:`comparison_forms`).

Punctuation processing (``processPunctuation``): each of 21 marks (no apostrophe, colon or period) is deleted when the
*original* text has it next to a space or the text contains a digit-comma-digit anywhere, and is replaced by a space
otherwise. Then periods not followed by a digit are deleted: the pattern ``(?!<=\\d)(\\.)(?!\\d)`` has a mistyped
lookbehind that never applies, so "1." loses its period too, and ``re.UNICODE`` is passed as the ``count`` argument of
``sub``, so at most 32 periods go. Digit/article processing (``processDigitArticle``): lower-case, split on
whitespace, map the words zero..ten and "none" to digits ("none" becomes "0", GT-Vision-Lab/VQA issue #7), drop
"a", "an", "the", expand contractions written without apostrophe ("dont" -> "don't"), join with single spaces.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

#: ``processPunctuation``'s marks, in the official order. The apostrophe, colon and period are not among them.
PUNCTUATION = (";", "/", "[", "]", '"', "{", "}", "(", ")", "=", "+", "\\", "_", "-", ">", "<", "@", "`", ",", "?", "!")

#: ``manualMap``: number words (and "none") become digits.
NUMBER_WORDS = {
    "none": "0",
    "zero": "0",
    "one": "1",
    "two": "2",
    "three": "3",
    "four": "4",
    "five": "5",
    "six": "6",
    "seven": "7",
    "eight": "8",
    "nine": "9",
    "ten": "10",
}

ARTICLES = frozenset({"a", "an", "the"})

#: The official contraction table. Lookups happen after lower-casing, so the keys with capitals ("Im", "Ive",
#: "Id've", "I'dve") never apply; "somebody'd" maps to "somebodyd" (sic). Both kept as in the official table.
CONTRACTIONS = {
    "aint": "ain't",
    "arent": "aren't",
    "cant": "can't",
    "couldve": "could've",
    "couldnt": "couldn't",
    "couldn'tve": "couldn't've",
    "couldnt've": "couldn't've",
    "didnt": "didn't",
    "doesnt": "doesn't",
    "dont": "don't",
    "hadnt": "hadn't",
    "hadnt've": "hadn't've",
    "hadn'tve": "hadn't've",
    "hasnt": "hasn't",
    "havent": "haven't",
    "hed": "he'd",
    "hed've": "he'd've",
    "he'dve": "he'd've",
    "hes": "he's",
    "howd": "how'd",
    "howll": "how'll",
    "hows": "how's",
    "Id've": "I'd've",
    "I'dve": "I'd've",
    "Im": "I'm",
    "Ive": "I've",
    "isnt": "isn't",
    "itd": "it'd",
    "itd've": "it'd've",
    "it'dve": "it'd've",
    "itll": "it'll",
    "let's": "let's",
    "maam": "ma'am",
    "mightnt": "mightn't",
    "mightnt've": "mightn't've",
    "mightn'tve": "mightn't've",
    "mightve": "might've",
    "mustnt": "mustn't",
    "mustve": "must've",
    "neednt": "needn't",
    "notve": "not've",
    "oclock": "o'clock",
    "oughtnt": "oughtn't",
    "ow's'at": "'ow's'at",
    "'ows'at": "'ow's'at",
    "'ow'sat": "'ow's'at",
    "shant": "shan't",
    "shed've": "she'd've",
    "she'dve": "she'd've",
    "she's": "she's",
    "shouldve": "should've",
    "shouldnt": "shouldn't",
    "shouldnt've": "shouldn't've",
    "shouldn'tve": "shouldn't've",
    "somebody'd": "somebodyd",
    "somebodyd've": "somebody'd've",
    "somebody'dve": "somebody'd've",
    "somebodyll": "somebody'll",
    "somebodys": "somebody's",
    "someoned": "someone'd",
    "someoned've": "someone'd've",
    "someone'dve": "someone'd've",
    "someonell": "someone'll",
    "someones": "someone's",
    "somethingd": "something'd",
    "somethingd've": "something'd've",
    "something'dve": "something'd've",
    "somethingll": "something'll",
    "thats": "that's",
    "thered": "there'd",
    "thered've": "there'd've",
    "there'dve": "there'd've",
    "therere": "there're",
    "theres": "there's",
    "theyd": "they'd",
    "theyd've": "they'd've",
    "they'dve": "they'd've",
    "theyll": "they'll",
    "theyre": "they're",
    "theyve": "they've",
    "twas": "'twas",
    "wasnt": "wasn't",
    "wed've": "we'd've",
    "we'dve": "we'd've",
    "weve": "we've",
    "werent": "weren't",
    "whatll": "what'll",
    "whatre": "what're",
    "whats": "what's",
    "whatve": "what've",
    "whens": "when's",
    "whered": "where'd",
    "wheres": "where's",
    "whereve": "where've",
    "whod": "who'd",
    "whod've": "who'd've",
    "who'dve": "who'd've",
    "wholl": "who'll",
    "whos": "who's",
    "whove": "who've",
    "whyll": "why'll",
    "whyre": "why're",
    "whys": "why's",
    "wont": "won't",
    "wouldve": "would've",
    "wouldnt": "wouldn't",
    "wouldnt've": "wouldn't've",
    "wouldn'tve": "wouldn't've",
    "yall": "y'all",
    "yall'll": "y'all'll",
    "y'allll": "y'all'll",
    "yall'd've": "y'all'd've",
    "y'alld've": "y'all'd've",
    "y'all'dve": "y'all'd've",
    "youd": "you'd",
    "youd've": "you'd've",
    "you'dve": "you'd've",
    "youll": "you'll",
    "youre": "you're",
    "youve": "you've",
}

_DIGIT_COMMA_DIGIT = re.compile(r"\d,\d")
#: Equivalent to the official ``(?!<=\d)(\.)(?!\d)``: its "lookbehind" is a lookahead for the text "<=" and a digit,
#: which never matches at a period, so only "not followed by a digit" remains.
_PERIOD_NOT_BEFORE_DIGIT = re.compile(r"\.(?!\d)")
#: The official call is ``periodStrip.sub("", text, re.UNICODE)``: re.UNICODE (32) lands in ``count``.
_MAX_PERIODS_REMOVED = int(re.UNICODE)


def clean_whitespace(text: str) -> str:
    """Newlines and tabs become spaces, then leading and trailing whitespace goes (the official first step)."""
    return text.replace("\n", " ").replace("\t", " ").strip()


def process_punctuation(text: str) -> str:
    """The official ``processPunctuation``: delete or space out 21 marks, then delete periods not before a digit.

    A mark is deleted when the *original* text has it next to a space ("yes !" -> "yes ") or contains a
    digit-comma-digit anywhere ("1,000" -> "1000"); otherwise it becomes a space ("t-shirt" -> "t shirt"). At most
    32 periods are deleted.
    """
    glue_everything = _DIGIT_COMMA_DIGIT.search(text) is not None
    out = text
    for mark in PUNCTUATION:
        delete = glue_everything or f"{mark} " in text or f" {mark}" in text
        out = out.replace(mark, "" if delete else " ")
    return _PERIOD_NOT_BEFORE_DIGIT.sub("", out, count=_MAX_PERIODS_REMOVED)


def process_digit_article(text: str) -> str:
    """The official ``processDigitArticle``: lower-case, number words to digits, no articles, contractions expanded."""
    words = [NUMBER_WORDS.get(word, word) for word in text.lower().split()]
    return " ".join(CONTRACTIONS.get(word, word) for word in words if word not in ARTICLES)


def normalize_answer(text: str) -> str:
    """Whitespace cleanup, punctuation, then digit/article processing: the full official answer normalisation.

    This is what the official script applies to both sides when the annotators disagree; use it to build answer
    vocabularies and to normalise model outputs.
    """
    return _processed(clean_whitespace(text))


def comparison_forms(prediction: str, answers: Sequence[str]) -> tuple[str, list[str]]:
    """The prediction and ground-truth answers exactly as the official script compares them.

    Whitespace is cleaned on both sides; when the cleaned answers are not all identical both sides are also normalised
    (:func:`normalize_answer`), when they are identical nothing else is done.
    """
    truths = [clean_whitespace(answer) for answer in answers]
    guess = clean_whitespace(prediction)
    if _differ(truths):
        truths = [_processed(answer) for answer in truths]
        guess = _processed(guess)
    return guess, truths


def answers_differ(answers: Sequence[str]) -> bool:
    """Whether the official script normalises this question: its whitespace-cleaned answers are not all identical.

    When they differ, answers and prediction are compared in :func:`normalize_answer` form; otherwise as given (after
    :func:`clean_whitespace`).
    """
    return _differ([clean_whitespace(answer) for answer in answers])


def _differ(cleaned: Sequence[str]) -> bool:
    return len(set(cleaned)) > 1


@functools.lru_cache(maxsize=1 << 16)
def _processed(text: str) -> str:
    """Punctuation then digit/article processing, memoised: VQA answers repeat across questions."""
    return process_digit_article(process_punctuation(text))
