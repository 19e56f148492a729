"""Converters from the benchmarks' original files (VQAv2, COCO captions, Flickr30K, NLVR2) and from generic
pre-training corpora, and from a user's own image folder and table (:mod:`.own_data`), to webdataset shards with a
``manifest.json``.

The benchmarks' HF ``datasets`` parquet copies convert to the same shards through :mod:`.parquet_vqav2`,
:mod:`.parquet_captions` and :mod:`.parquet_nlvr2` (over :mod:`.parquet`); they are imported from there, so that only
a parquet conversion loads pyarrow."""

from mmoe.data.converters.coco import convert_coco_captions, convert_karpathy
from mmoe.data.converters.common import ConversionError
from mmoe.data.converters.corpora import convert_images, convert_text, convert_tsv
from mmoe.data.converters.nlvr2 import convert_nlvr2, image_names
from mmoe.data.converters.own_data import convert_own_captions, convert_own_pairs, convert_own_vqa
from mmoe.data.converters.vqav2 import convert_vqav2

__all__ = [
    "ConversionError",
    "convert_coco_captions",
    "convert_images",
    "convert_karpathy",
    "convert_nlvr2",
    "convert_own_captions",
    "convert_own_pairs",
    "convert_own_vqa",
    "convert_text",
    "convert_tsv",
    "convert_vqav2",
    "image_names",
]
