"""VQA answers: the official answer normalisation, the answer vocabulary and soft targets.

Behaviour follows the official evaluation (GT-Vision-Lab/VQA ``vqaEval.py``, latest commit), quirks included:

* a predicted answer is normalised with the punctuation rule, then lower-cased, number words (``none``, ``zero`` ..
  ``ten``) turned into digits, articles dropped and contractions restored;
* human answers get the punctuation rule only, and only when the 10 answers are not all identical;
* the period rule removes at most 32 periods (the official call passes ``re.UNICODE`` = 32 as the ``count``).

An answer matched by m of the 10 annotators scores the mean over the ten leave-one-out subsets of ``min(1, m'/3)``:
0.3, 0.6, 0.9 and 1.0 for m = 1, 2, 3 and >= 4. These are the soft targets of VQA fine-tuning (BEiT-3, ViLT).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence

_PUNCTUATION = list(';/[]"{}()=+\\_-><@`,?!')  # the official list, in its order
_COMMA_BETWEEN_DIGITS = re.compile(r"(\d)(,)(\d)")
# The official pattern reads "(?!<=\d)" (a look-ahead, not a look-behind): it removes every period not followed by a
# digit.
_PERIOD = re.compile(r"(?!<=\d)(\.)(?!\d)")
_NUMBER_WORDS = {
    "none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4",
    "five": "5", "six": "6", "seven": "7", "eight": "8", "nine": "9", "ten": "10",
}  # fmt: skip
_ARTICLES = frozenset({"a", "an", "the"})
# The official contraction table, written as "as typed=restored" pairs (keys with capitals never match: the text is
# lower-cased first; "somebody'd" -> "somebodyd" is in the official table as written).
_CONTRACTION_PAIRS = """
aint=ain't arent=aren't cant=can't couldve=could've couldnt=couldn't couldn'tve=couldn't've couldnt've=couldn't've
didnt=didn't doesnt=doesn't dont=don't hadnt=hadn't hadnt've=hadn't've hadn'tve=hadn't've hasnt=hasn't
havent=haven't hed=he'd hed've=he'd've he'dve=he'd've hes=he's howd=how'd howll=how'll hows=how's Id've=I'd've
I'dve=I'd've Im=I'm Ive=I've isnt=isn't itd=it'd itd've=it'd've it'dve=it'd've itll=it'll let's=let's maam=ma'am
mightnt=mightn't mightnt've=mightn't've mightn'tve=mightn't've mightve=might've mustnt=mustn't mustve=must've
neednt=needn't notve=not've oclock=o'clock oughtnt=oughtn't ow's'at='ow's'at 'ows'at='ow's'at 'ow'sat='ow's'at
shant=shan't shed've=she'd've she'dve=she'd've she's=she's shouldve=should've shouldnt=shouldn't
shouldnt've=shouldn't've shouldn'tve=shouldn't've somebody'd=somebodyd somebodyd've=somebody'd've
somebody'dve=somebody'd've somebodyll=somebody'll somebodys=somebody's someoned=someone'd someoned've=someone'd've
someone'dve=someone'd've someonell=someone'll someones=someone's somethingd=something'd
somethingd've=something'd've something'dve=something'd've somethingll=something'll thats=that's thered=there'd
thered've=there'd've there'dve=there'd've therere=there're theres=there's theyd=they'd theyd've=they'd've
they'dve=they'd've theyll=they'll theyre=they're theyve=they've twas='twas wasnt=wasn't wed've=we'd've
we'dve=we'd've weve=we've werent=weren't whatll=what'll whatre=what're whats=what's whatve=what've whens=when's
whered=where'd wheres=where's whereve=where've whod=who'd whod've=who'd've who'dve=who'd've wholl=who'll whos=who's
whove=who've whyll=why'll whyre=why're whys=why's wont=won't wouldve=would've wouldnt=wouldn't
wouldnt've=wouldn't've wouldn'tve=wouldn't've yall=y'all yall'll=y'all'll y'allll=y'all'll yall'd've=y'all'd've
y'alld've=y'all'd've y'all'dve=y'all'd've youd=you'd youd've=you'd've you'dve=you'd've youll=you'll youre=you're
youve=you've
"""
_CONTRACTIONS = dict(pair.split("=", 1) for pair in _CONTRACTION_PAIRS.split())


def process_punctuation(text: str) -> str:
    """The official punctuation rule: a mark next to a space (or any mark in a text with a digit-comma-digit) is
    deleted, any other is replaced by a space; then periods not followed by a digit are removed (at most 32)."""
    out = text
    delete_all = _COMMA_BETWEEN_DIGITS.search(text) is not None
    for mark in _PUNCTUATION:
        if delete_all or mark + " " in text or " " + mark in text:
            out = out.replace(mark, "")
        else:
            out = out.replace(mark, " ")
    return _PERIOD.sub("", out, count=32)


def process_digit_article(text: str) -> str:
    """Lower-case, number words to digits, articles dropped, contractions restored, single spaces."""
    words = [_NUMBER_WORDS.get(word, word) for word in text.lower().split()]
    words = [_CONTRACTIONS.get(word, word) for word in words if word not in _ARTICLES]
    return " ".join(words)


def normalize_answer(answer: str) -> str:
    """How the official evaluation normalises a predicted answer; the answer vocabulary holds answers in this form."""
    answer = answer.replace("\n", " ").replace("\t", " ").strip()
    return process_digit_article(process_punctuation(answer))


def answer_accuracy(matches: int, annotators: int = 10) -> float:
    """Official accuracy of an answer given by ``matches`` of ``annotators`` humans: the mean over the leave-one-out
    subsets of ``min(1, matches_in_subset / 3)`` (0.3 / 0.6 / 0.9 / 1.0 for 1 / 2 / 3 / >= 4 of 10)."""
    if annotators <= 0 or not 0 <= matches <= annotators:
        raise ValueError(f"need 0 <= matches <= annotators, annotators > 0; got {matches} of {annotators}")
    left_in = min(1.0, (matches - 1) / 3) if matches else 0.0
    left_out = min(1.0, matches / 3)
    return (matches * left_in + (annotators - matches) * left_out) / annotators


def answer_scores(answers: Sequence[str]) -> dict[str, float]:
    """Official accuracy of every answer string a prediction could match, from the 10 human answers.

    The keys are the human answers as the official evaluation compares them (punctuation rule applied when the
    answers differ); a prediction p scores ``scores[normalize_answer(p)]``, 0 when absent.
    """
    compared = list(answers) if len(set(answers)) <= 1 else [process_punctuation(a) for a in answers]
    return {answer: answer_accuracy(count, len(compared)) for answer, count in Counter(compared).items()}


def soft_targets(answers: Sequence[str], vocab: dict[str, int]) -> tuple[list[int], list[float]]:
    """Class labels and soft scores of one question for an answer vocabulary (answer -> label); answers outside the
    vocabulary are left out. Labels are sorted."""
    pairs = sorted((vocab[answer], score) for answer, score in answer_scores(answers).items() if answer in vocab)
    return [label for label, _ in pairs], [score for _, score in pairs]


def build_answer_vocab(multiple_choice_answers: Iterable[str], min_count: int = 9) -> list[str]:
    """The answer vocabulary: normalised ``multiple_choice_answer`` strings seen at least ``min_count`` times (9 in
    ViLT and BEiT-3), most frequent first, ties alphabetical. The list index is the class label."""
    counts = Counter(normalize_answer(answer) for answer in multiple_choice_answers)
    kept = [(answer, count) for answer, count in counts.items() if count >= min_count and answer]
    return [answer for answer, _ in sorted(kept, key=lambda item: (-item[1], item[0]))]
