"""A text head over part of the vocabulary: the ``output_vocab`` file (the token ids of a corpus' texts, e.g. the
``caption_tokens.json`` the caption converters write) and the map from a token id to the head's class.

Captioning's head and pre-training's MLM head take one; a synthetic corpus uses a few dozen of the tokenizer's
49,408 ids, and a head over those alone is both faster and learns the words' frequencies within a few steps
(``tasks/captioning/README.md``, docs/tutorials/demo_details.md). BEiT-3 predicts over the whole vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mmoe.io import read_json
from mmoe.vocabulary import OPEN_CLIP_IDS, TextIds


def load_output_vocab(
    path: str | Path, vocab_size: int, text_ids: TextIds = OPEN_CLIP_IDS, need_end: bool = True
) -> list[int]:
    """The token ids of ``caption_tokens.json``: a JSON list of distinct ids in [0, vocab_size), none of the start, pad
    and mask ids (``text_ids``: the tokenizer's), holding the end token when ``need_end`` (a caption head must be able
    to end a caption; an MLM head never predicts it)."""
    ids = read_json(
        path, "output vocabulary", written_by="the caption converters write caption_tokens.json next to the shards"
    )
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"output vocabulary {path}: expected a JSON list of integer token ids")
    bad = [i for i in ids if not 0 <= i < vocab_size or i in (text_ids.start, text_ids.pad, text_ids.mask)]
    if bad:
        raise ValueError(
            f"output vocabulary {path}: ids {bad[:5]} are outside [0, {vocab_size}) or the start / pad / mask ids"
        )
    if len(set(ids)) != len(ids):
        raise ValueError(f"output vocabulary {path}: an id appears more than once")
    if need_end and text_ids.end not in ids:
        raise ValueError(
            f"output vocabulary {path}: the end-of-text id {text_ids.end} is missing (captions could not end)"
        )
    return sorted(ids)


def class_index(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(vocab_size,) head class of each token id: k for ``ids[k]``, -1 for an id the head does not predict."""
    index = torch.full((vocab_size,), -1, dtype=torch.long)
    index[ids] = torch.arange(len(ids))
    return index


def classes_of(index: torch.Tensor, token_ids: torch.Tensor, option: str, decode) -> torch.Tensor:
    """The head classes of ``token_ids`` under ``index`` (:func:`class_index`); an id the head does not predict is a
    ValueError naming the first ids and their words (``decode``: ids -> text) and ``option``, the file's option."""
    classes = index[token_ids]
    if bool((classes < 0).any()):
        missing = sorted(set(token_ids[classes < 0].tolist()))
        words = [decode([i]) for i in missing[:5]]
        raise ValueError(f"token ids {missing[:5]} ({words}) are not in {option}: build it from the training texts")
    return classes
