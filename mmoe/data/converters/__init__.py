"""Converters from the benchmarks' original files (VQAv2, COCO captions, Flickr30K, NLVR2, NoCaps), from ImageNet-1K's
folders (classification: :mod:`.imagenet`, :mod:`.imagenet_val`), from generic pre-training corpora, and from a user's
own image folder and table (:mod:`.own_data`), to webdataset shards with a ``manifest.json``.

A benchmark converter is a reader and a builder. One reader per source checks its whole input and yields one typed
record per sample (:mod:`.records`: ``VQAQuestion``, ``NLVR2Pair``, ``CaptionedImage``) beside where its image comes
from: the official files (:mod:`.vqav2`, :mod:`.nlvr2`, :mod:`.coco`, :mod:`.nocaps`), the HF ``datasets`` parquet
copies (:mod:`.parquet_vqav2`, :mod:`.parquet_nlvr2`, :mod:`.parquet_captions`, over :mod:`.parquet`; imported from
there, so that only a parquet conversion loads pyarrow) and a user's own table (:mod:`.own_data`). One builder per
benchmark turns the records into samples and writes the split (:mod:`.build_vqa`, :mod:`.build_nlvr2`,
:mod:`.build_captions`, over :func:`.common.write_split`), so a benchmark's shards are the same whatever source they
come from."""

from mmoe.data.converters.build_nlvr2 import image_names
from mmoe.data.converters.coco import convert_coco_captions, convert_karpathy
from mmoe.data.converters.common import ConversionError
from mmoe.data.converters.corpora import convert_images, convert_text, convert_tsv
from mmoe.data.converters.imagenet_val import convert_imagenet
from mmoe.data.converters.nlvr2 import convert_nlvr2
from mmoe.data.converters.own_data import convert_own_captions, convert_own_pairs, convert_own_vqa
from mmoe.data.converters.vqav2 import convert_vqav2

__all__ = [
    "ConversionError",
    "convert_coco_captions",
    "convert_imagenet",
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
