"""The text ids that mmoe's tokenizers write and its backbones embed.

The default vocabulary is open_clip's byte-level BPE: ids 0..49405 are BPE tokens and 49406 / 49407 its start / end
of text (its 49,408 ids); mmoe appends ``PAD_ID`` = 49408 and ``MASK_ID`` = 49409, so a backbone's text embedding
has ``VOCAB_SIZE`` = 49410 rows. BEiT-3's SentencePiece vocabulary (``beit3.spm``, XLM-R ids) is the other one
(:class:`TextIds` of :class:`mmoe.data.tokenizer.TextTokenizer`).
"""

from __future__ import annotations

from dataclasses import dataclass

#: open_clip's start / end of text ids.
SOT_ID = 49406
EOT_ID = 49407
#: Ids appended after open_clip's vocabulary.
PAD_ID = 49408
MASK_ID = 49409
#: Rows of a backbone's text embedding: open_clip's 49,408 ids + pad + mask.
VOCAB_SIZE = MASK_ID + 1
#: Plain BPE ids lie in [0, NUM_BPE_TOKENS): what random replacement in masked language modeling draws from.
NUM_BPE_TOKENS = SOT_ID
#: Unused rows a backbone's text embedding may have past its tokenizer's ids: BEiT-3's 64,010-row embedding holds
#: beit3.spm's 64,002 ids ("eight embeddings not used", microsoft/unilm#1318).
UNUSED_EMBEDDING_ROWS = 8


@dataclass(frozen=True)
class TextIds:
    """The special ids and the size of one text vocabulary.

    Attributes:
        start: start of text (open_clip ``<start_of_text>``, XLM-R ``<s>``).
        end: end of text.
        pad: padding.
        mask: the mask token of masked language modeling.
        size: number of ids (the text embedding needs at least this many rows).
        random_low: first id random replacement draws (masked language modeling's 10 %).
        random_high: one past the last id it draws.
    """

    start: int
    end: int
    pad: int
    mask: int
    size: int
    random_low: int
    random_high: int

    @property
    def special(self) -> frozenset[int]:
        return frozenset({self.start, self.end, self.pad, self.mask})

    def check_embedding(self, rows: int, what: str) -> None:
        """Refuses an embedding of ``rows`` rows that cannot hold these ids, or that was made for a larger vocabulary
        (more than :data:`UNUSED_EMBEDDING_ROWS` rows past them): one line naming ``what`` the tokenizer is."""
        if not self.size <= rows <= self.size + UNUSED_EMBEDDING_ROWS:
            raise ValueError(
                f"{what} has {self.size} ids, the backbone's text embedding {rows} rows: they belong to different "
                "vocabularies (a BEiT-3 backbone reads its beit3.spm; mmoe's default is open_clip's BPE, 49410 rows)"
            )


#: open_clip's BPE with mmoe's pad and mask.
OPEN_CLIP_IDS = TextIds(
    start=SOT_ID, end=EOT_ID, pad=PAD_ID, mask=MASK_ID, size=VOCAB_SIZE, random_low=0, random_high=NUM_BPE_TOKENS
)
