"""The text vocabulary that mmoe's tokenizer writes and its backbones embed: open_clip's byte-level BPE ids, then a
padding and a mask id.

Ids 0..49405 are BPE tokens and 49406 / 49407 open_clip's start / end of text (its 49,408 ids); mmoe appends
``PAD_ID`` = 49408 and ``MASK_ID`` = 49409, so a backbone's text embedding has ``VOCAB_SIZE`` = 49410 rows.
"""

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
