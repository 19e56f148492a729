"""Text tokenizer: open_clip's byte-level BPE (the CLIP vocabulary that ships inside the ``open_clip_torch`` wheel).

The ids (BPE tokens, open_clip's start / end of text, mmoe's pad and mask) are those of :mod:`mmoe.vocabulary`. A
sequence is ``[start] + tokens + [end]``, truncated to ``max_length`` with the end token kept, right-padded with
``PAD_ID``; the padding mask is True at padding.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import torch

from mmoe.vocabulary import EOT_ID, MASK_ID, NUM_BPE_TOKENS, PAD_ID, SOT_ID, VOCAB_SIZE

__all__ = ["EOT_ID", "MASK_ID", "NUM_BPE_TOKENS", "PAD_ID", "SOT_ID", "SPECIAL_IDS", "VOCAB_SIZE", "TextTokenizer"]

SPECIAL_IDS = frozenset({SOT_ID, EOT_ID, PAD_ID, MASK_ID})


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


class TextTokenizer:
    """open_clip BPE with mmoe's pad / mask ids, truncation and padding.

    Picklable and cheap to copy: the BPE tables are loaded lazily once per process, so DataLoader workers do not
    receive them through pickling.

    Args:
        max_length: longest sequence in tokens, start and end of text included (BEiT-3: 64; captioning: 32).
    """

    def __init__(self, max_length: int = 64) -> None:
        if max_length < 2:
            raise ValueError(f"TextTokenizer.max_length must be >= 2 (start and end of text), got {max_length!r}")
        self.max_length = max_length

    def encode(self, text: str) -> list[int]:
        """Ids of one text: start, BPE tokens (truncated), end; at most ``max_length`` ids."""
        tokens = _open_clip_bpe().encode(text)[: self.max_length - 2]
        return [SOT_ID, *tokens, EOT_ID]

    def token_string(self, token_id: int) -> str:
        """One id as readable text: ``<start>`` / ``<end>`` / ``<pad>`` / ``<mask>``, or its BPE token without the
        end-of-word mark."""
        special = {SOT_ID: "<start>", EOT_ID: "<end>", PAD_ID: "<pad>", MASK_ID: "<mask>"}
        if token_id in special:
            return special[token_id]
        return _open_clip_bpe().decoder[token_id].replace("</w>", "")

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Text of a sequence of ids; stops at the end of text and leaves out start, pad and mask."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        kept = []
        for token in ids:
            if token == EOT_ID:
                break
            if token not in SPECIAL_IDS:
                kept.append(token)
        return _open_clip_bpe().decode(kept).strip()

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
        ids = torch.full((len(sequences), length), PAD_ID, dtype=torch.long)
        for row, sequence in enumerate(sequences):
            ids[row, : len(sequence)] = torch.as_tensor(sequence, dtype=torch.long)
        return ids, ids == PAD_ID

    def __call__(self, texts: str | Sequence[str], length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Encodes and pads texts: ``ids`` (B, T) and ``padding_mask`` (B, T), True = padding."""
        if isinstance(texts, str):
            texts = [texts]
        return self.pad([self.encode(text) for text in texts], length)


def token_ids_of(texts: Iterable[str]) -> list[int]:
    """The sorted BPE ids the texts use, untruncated, plus the end-of-text id: the output vocabulary a captioning
    head needs to write every training caption (see :class:`mmoe.tasks.captioning.CaptioningFineTuning`)."""
    bpe = _open_clip_bpe()
    ids = {EOT_ID}
    for text in texts:
        ids.update(bpe.encode(text))
    return sorted(ids)
