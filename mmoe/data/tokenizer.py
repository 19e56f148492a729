"""Text tokenizers: open_clip's byte-level BPE (the CLIP vocabulary that ships inside the ``open_clip_torch`` wheel) by
default, or a SentencePiece model from a local file with XLM-R's ids (BEiT-3's ``beit3.spm``).

Ids of the default (:data:`mmoe.vocabulary.OPEN_CLIP_IDS`): BPE tokens, open_clip's start / end of text, mmoe's pad
and mask. Ids of a SentencePiece model as XLM-R's tokenizer (which BEiT-3 uses) numbers them: ``<s>`` 0, ``<pad>``
1, ``</s>`` 2, ``<unk>`` 3, the model's piece p as p + 1, and ``<mask>`` = pieces + 1, so ``beit3.spm``'s 64,000
pieces give 64,002 ids. A sequence is ``[start] + tokens + [end]``, truncated to ``max_length`` with the end token
kept, right-padded with the pad id; the padding mask is True at padding.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from mmoe.vocabulary import EOT_ID, MASK_ID, NUM_BPE_TOKENS, OPEN_CLIP_IDS, PAD_ID, SOT_ID, VOCAB_SIZE, TextIds

__all__ = [
    "CAPTION_MAX_TEXT_LENGTH",
    "DEFAULT_MAX_TEXT_LENGTH",
    "EOT_ID",
    "MASK_ID",
    "NUM_BPE_TOKENS",
    "PAD_ID",
    "SOT_ID",
    "SPECIAL_IDS",
    "VOCAB_SIZE",
    "TextTokenizer",
    "token_ids_of",
]

#: Longest text in tokens, start and end included, where neither a config nor a checkpoint says (BEiT-3's
#: ``num_max_bpe_tokens`` for questions and sentences).
DEFAULT_MAX_TEXT_LENGTH = 64
#: Longest caption in tokens: BEiT-3's captioning recipe, and the captions the routing figures and the claims study's
#: analysis tokenise (shorter than :data:`DEFAULT_MAX_TEXT_LENGTH` on purpose: COCO captions fit, padding costs).
CAPTION_MAX_TEXT_LENGTH = 32

SPECIAL_IDS = OPEN_CLIP_IDS.special
#: XLM-R's ids before and after the SentencePiece pieces (fairseq's dictionary order).
XLMR_START, XLMR_PAD, XLMR_END, XLMR_UNK = 0, 1, 2, 3


@functools.lru_cache(maxsize=1)
def _open_clip_bpe():
    """One open_clip ``SimpleTokenizer`` per process (reading the vocabulary takes ~0.3 s)."""
    from open_clip.tokenizer import SimpleTokenizer

    bpe = SimpleTokenizer()
    if (bpe.sot_token_id, bpe.eot_token_id, len(bpe.encoder)) != (SOT_ID, EOT_ID, NUM_BPE_TOKENS + 2):
        raise RuntimeError(
            f"open_clip's tokenizer changed: start={bpe.sot_token_id}, end={bpe.eot_token_id}, "
            f"vocabulary={len(bpe.encoder)}; mmoe expects {SOT_ID}, {EOT_ID}, {NUM_BPE_TOKENS + 2}"
        )
    return bpe


class OpenClipVocabulary:
    """open_clip's BPE with mmoe's pad and mask ids."""

    ids = OPEN_CLIP_IDS

    def load(self) -> None:
        _open_clip_bpe()

    def encode(self, text: str) -> list[int]:
        return _open_clip_bpe().encode(text)

    def decode(self, ids: list[int]) -> str:
        return _open_clip_bpe().decode(ids).strip()

    def piece(self, token_id: int) -> str:
        return _open_clip_bpe().decoder[token_id].replace("</w>", "")


@functools.lru_cache(maxsize=4)
def _sentencepiece(path: str):
    """One SentencePiece processor per model file and process."""
    import sentencepiece

    try:
        return sentencepiece.SentencePieceProcessor(model_file=path)
    except (RuntimeError, OSError) as error:
        raise ValueError(
            f"text tokenizer {path} is not a SentencePiece model ({' '.join(str(error).split())})"
        ) from None


class SentencePieceVocabulary:
    """A SentencePiece model numbered as XLM-R's tokenizer (see the module docstring)."""

    def __init__(self, path: str) -> None:
        self.path = path
        pieces = _sentencepiece(path).get_piece_size()
        self.ids = TextIds(
            start=XLMR_START,
            end=XLMR_END,
            pad=XLMR_PAD,
            mask=pieces + 1,
            size=pieces + 2,
            random_low=XLMR_UNK,
            random_high=pieces + 1,
        )

    def __getstate__(self) -> dict:  # DataLoader workers load the model themselves
        return {"path": self.path, "ids": self.ids}

    def __setstate__(self, state: dict) -> None:
        self.path, self.ids = state["path"], state["ids"]

    def load(self) -> None:
        _sentencepiece(self.path)

    def encode(self, text: str) -> list[int]:
        processor = _sentencepiece(self.path)
        unk = processor.unk_id()
        return [XLMR_UNK if piece == unk else piece + 1 for piece in processor.encode(text)]

    def decode(self, ids: list[int]) -> str:
        return _sentencepiece(self.path).decode([token - 1 for token in ids if token > XLMR_UNK]).strip()

    def piece(self, token_id: int) -> str:
        if token_id == XLMR_UNK:
            return "<unk>"
        return _sentencepiece(self.path).id_to_piece(token_id - 1).replace("\u2581", "")


class TextTokenizer:
    """Tokenizer with truncation and padding: open_clip's BPE with mmoe's pad / mask ids, or a SentencePiece model.

    Picklable and cheap to copy: the BPE tables and SentencePiece models are loaded once per process, so DataLoader
    workers do not receive them through pickling.

    Args:
        max_length: longest sequence in tokens, start and end of text included (BEiT-3:
            :data:`DEFAULT_MAX_TEXT_LENGTH`; captioning: :data:`CAPTION_MAX_TEXT_LENGTH`).
        sentencepiece: a SentencePiece model file (BEiT-3's ``beit3.spm``) numbered with XLM-R's ids; None = open_clip's
            BPE.

    Raises:
        FileNotFoundError: ``sentencepiece`` does not exist.
        ValueError: it is not a SentencePiece model.
    """

    def __init__(self, max_length: int = DEFAULT_MAX_TEXT_LENGTH, sentencepiece: str | Path | None = None) -> None:
        if max_length < 2:
            raise ValueError(f"TextTokenizer.max_length must be >= 2 (start and end of text), got {max_length!r}")
        self.max_length = max_length
        if sentencepiece is None:
            self.vocabulary = OpenClipVocabulary()
        else:
            path = Path(sentencepiece)
            if not path.is_file():
                raise FileNotFoundError(f"text tokenizer {path} does not exist (a SentencePiece model, e.g. beit3.spm)")
            self.vocabulary = SentencePieceVocabulary(str(path))

    def load(self) -> None:
        """Reads the vocabulary's tables now if this process has not (each process reads them once, on first use):
        DataLoader workers forked after it inherit them instead of each reading them (about 0.3 s for the BPE)."""
        self.vocabulary.load()

    @property
    def ids(self) -> TextIds:
        """The vocabulary's special ids and size."""
        return self.vocabulary.ids

    def encode(self, text: str) -> list[int]:
        """Ids of one text: start, tokens (truncated), end; at most ``max_length`` ids."""
        tokens = self.vocabulary.encode(text)[: self.max_length - 2]
        return [self.ids.start, *tokens, self.ids.end]

    def token_string(self, token_id: int) -> str:
        """One id as readable text: ``<start>`` / ``<end>`` / ``<pad>`` / ``<mask>``, or its token without the
        word-boundary mark."""
        ids = self.ids
        special = {ids.start: "<start>", ids.end: "<end>", ids.pad: "<pad>", ids.mask: "<mask>"}
        if token_id in special:
            return special[token_id]
        return self.vocabulary.piece(token_id)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Text of a sequence of ids; stops at the end of text and leaves out start, pad and mask."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        kept, special = [], self.ids.special
        for token in ids:
            if token == self.ids.end:
                break
            if token not in special:
                kept.append(token)
        return self.vocabulary.decode(kept)

    def pad(self, sequences: Sequence[Sequence[int]], length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-pads id lists into a batch.

        Args:
            sequences: id lists, each at most ``max_length`` long.
            length: pad to this length; None = the longest sequence of the batch.

        Returns:
            ``ids`` (B, T) long and ``padding_mask`` (B, T) bool, True = padding.
        """
        longest = max((len(s) for s in sequences), default=0)
        length = longest if length is None else length
        if longest > length:
            raise ValueError(f"a sequence of {longest} ids does not fit in length {length}")
        ids = torch.full((len(sequences), length), self.ids.pad, dtype=torch.long)
        padding = torch.ones((len(sequences), length), dtype=torch.bool)
        for row, sequence in enumerate(sequences):
            ids[row, : len(sequence)] = torch.as_tensor(sequence, dtype=torch.long)
            padding[row, : len(sequence)] = False
        return ids, padding

    def __call__(self, texts: str | Sequence[str], length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Encodes and pads texts: ``ids`` (B, T) and ``padding_mask`` (B, T), True = padding."""
        if isinstance(texts, str):
            texts = [texts]
        return self.pad([self.encode(text) for text in texts], length)


def token_ids_of(texts: Iterable[str], tokenizer: TextTokenizer | None = None) -> list[int]:
    """The sorted ids the texts use, untruncated, plus the end-of-text id: the output vocabulary a captioning head
    needs to write every training caption (see :class:`mmoe.tasks.captioning.CaptioningFineTuning`)."""
    tokenizer = tokenizer or TextTokenizer()
    ids = {tokenizer.ids.end}
    for text in texts:
        ids.update(tokenizer.vocabulary.encode(text))
    return sorted(ids)
