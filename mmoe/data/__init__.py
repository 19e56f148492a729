"""Data for mmoe: tokenizer, BEiT-3 masks, webdataset shards and the streams reading them, converters from the
benchmarks' original files, the synthetic default corpus, and Lightning DataModules."""

from mmoe.data.masking import MaskingConfig
from mmoe.data.tokenizer import EOT_ID, MASK_ID, PAD_ID, SOT_ID, VOCAB_SIZE, TextTokenizer

__all__ = ["EOT_ID", "MASK_ID", "PAD_ID", "SOT_ID", "VOCAB_SIZE", "MaskingConfig", "TextTokenizer"]
