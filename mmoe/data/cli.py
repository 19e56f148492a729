"""``mmoe data``: convert datasets to shards, and build the synthetic default corpus.

```
mmoe data convert vqav2 --questions Q.json [--annotations A.json] --images DIR --out OUT [--answer-vocab answers.json]
    [--holdout-images 1000 --holdout-out REST [--seed 0]]
mmoe data convert vqav2 --parquet F.parquet [...] --split validation|testdev|test|train --out OUT [--answer-vocab A]
mmoe data answers --annotations train.json [val.json ...] --out answers.json [--min-answer-count 9]
mmoe data convert coco-captions (--annotations captions_*.json | --karpathy dataset_coco.json --split S) --images DIR --out OUT
    [--text-tokenizer beit3.spm]
mmoe data convert coco-captions --parquet F.parquet [...] --split S --out OUT [--test-images 5000]
mmoe data convert flickr30k --karpathy dataset_flickr30k.json --split S (--images DIR | --parquet F.parquet [...]) --out OUT
    [--text-tokenizer beit3.spm]
mmoe data convert nocaps --annotations nocaps_val_4500_captions.json|nocaps_test_image_info.json --images DIR --out OUT
mmoe data convert nlvr2 (--data dev.json --images DIR | --parquet F.parquet [...]) --out OUT
mmoe data convert images --images DIR --out OUT [--name images]
mmoe data convert tsv --tsv pairs.tsv --images DIR --out OUT [--name pairs]
mmoe data convert text --text corpus.txt [more.txt ...] --out OUT [--name text]
mmoe data convert imagenet (--images DIR [--val-solution CSV | --devkit DIR ...] --out OUT | --shards DIR)  (cli_imagenet)
mmoe data convert pairs | captions | vqa --table T.csv|.jsonl|.json --images DIR --out OUT   (mmoe.data.cli_own)
mmoe data check-overlap TRAIN EVAL [--strict]
mmoe data synth --out DIR [--size tiny|small|medium|large] [--seed 0] [--shards] [--workers N]
mmoe data index DIR [--min-side 64]
```

``--parquet`` reads the benchmark's HF ``datasets`` parquet files (one split, in the order given) instead of the
official files, into the same shards (:mod:`mmoe.data.converters.parquet`): the images are inside the rows, so
``--images`` does not apply; the converters import pyarrow only then. Each ``convert`` prints its manifest (JSON) on
stdout; skipped images go to stderr. Bad options or input files give
one line on stderr and exit status 2 (nothing is written); a failure while writing (e.g. a full disk) gives one
line and exit status 1, and the split folder keeps what it held.
"""  # noqa: E501

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from mmoe.atomic import write_text_atomic
from mmoe.data.answers import ANSWERS_FILE
from mmoe.data.cli_imagenet import add_imagenet_source, convert_imagenet
from mmoe.data.cli_own import OWN_SOURCES, add_overlap_command, add_own_sources, convert_own, overlap_command
from mmoe.data.converters import (
    ConversionError,
    convert_coco_captions,
    convert_images,
    convert_karpathy,
    convert_nlvr2,
    convert_text,
    convert_tsv,
    convert_vqav2,
)
from mmoe.data.converters.common import check_shard_size, json_text
from mmoe.data.converters.nocaps import convert_nocaps
from mmoe.data.converters.staging import OutputFolderError, output_folder
from mmoe.data.converters.vqav2 import answer_vocab_of
from mmoe.data.shards import check_shard_name
from mmoe.data.tokenizer import TextTokenizer
from mmoe.io import positive_int


def _common(parser: argparse.ArgumentParser, name_default: str | None = None, out_required: bool = True) -> None:
    parser.add_argument("--out", required=out_required, help="output folder for this split's shards and manifest.json")
    parser.add_argument("--shard-size", type=int, default=1000, help="samples per shard (default 1000)")
    hint = f"(default {name_default})" if name_default else "(default: dataset and split, e.g. vqav2-val2014)"
    parser.add_argument("--name", default=name_default, help=f"shard name prefix {hint}")


def _text_tokenizer(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--text-tokenizer",
        help="SentencePiece model (BEiT-3's beit3.spm) whose ids caption_tokens.json lists; default open_clip's BPE",
    )


def _parquet(group: argparse._MutuallyExclusiveGroup, what: str) -> None:
    group.add_argument("--parquet", nargs="+", metavar="FILE", help=f"HF datasets parquet files of one split ({what})")


def _vqav2_source(sources: argparse._SubParsersAction) -> None:
    vqa = sources.add_parser("vqav2", help="VQAv2 questions (+ annotations) and COCO images, or parquet")
    which = vqa.add_mutually_exclusive_group(required=True)
    which.add_argument("--questions", help="v2_OpenEnded_mscoco_<subtype>_questions.json")
    _parquet(which, "lmms-lab/VQAv2; with --split")
    vqa.add_argument("--split", help="with --parquet: validation, testdev, test, train (or val2014, test-dev2015, ...)")
    vqa.add_argument("--annotations", help="v2_mscoco_<subtype>_annotations.json (absent for test splits)")
    vqa.add_argument("--images", help="COCO image folder (images in it or in <subtype>/); with --questions")
    vqa.add_argument("--answer-vocab", help=f"{ANSWERS_FILE} written by the training split (other annotated splits)")
    vqa.add_argument("--min-answer-count", type=int, default=9, help="vocabulary threshold when building (9)")
    vqa.add_argument(
        "--holdout-images", type=int, default=0, help="hold out this many random images (BEiT-3: 1000 of val2014)"
    )
    vqa.add_argument("--holdout-out", help="folder of the held-out split (its shards are named <name>-rest)")
    vqa.add_argument("--seed", type=int, default=0, help="seeds the held-out images' choice (0)")
    _common(vqa)


def _caption_sources(sources: argparse._SubParsersAction) -> None:
    coco = sources.add_parser("coco-captions", help="COCO captions (official file or Karpathy split)")
    which = coco.add_mutually_exclusive_group(required=True)
    which.add_argument("--annotations", help="captions_<subtype>.json")
    which.add_argument("--karpathy", help="dataset_coco.json (with --split)")
    _parquet(which, "Karpathy records with images, a row per image or per sentence; with --split")
    coco.add_argument("--split", help="Karpathy split(s): train, restval, val, test; e.g. train,restval")
    coco.add_argument("--images", help="COCO image folder; with --annotations or --karpathy")
    coco.add_argument(
        "--test-images", type=positive_int, default=5000, help="with --parquet: images the test split must hold (5000)"
    )
    _text_tokenizer(coco)
    _common(coco)

    flickr = sources.add_parser("flickr30k", help="Flickr30K captions (Karpathy split, for retrieval)")
    flickr.add_argument("--karpathy", help="dataset_flickr30k.json (required: it chooses the split's images)")
    flickr.add_argument("--split", required=True, help="Karpathy split(s): train, val, test")
    which = flickr.add_mutually_exclusive_group(required=True)
    which.add_argument("--images", help="the Flickr30K image folder (flickr30k-images)")
    _parquet(which, "lmms-lab/flickr30k: images matched to --karpathy by filename")
    _text_tokenizer(flickr)
    _common(flickr)

    nocaps = sources.add_parser("nocaps", help="NoCaps val captions or test image info (each image's domain)")
    nocaps.add_argument("--annotations", required=True, help="nocaps_val_4500_captions.json or test image info")
    nocaps.add_argument("--images", required=True, help="the image folder (images in it or in its val/ or test/)")
    _text_tokenizer(nocaps)
    _common(nocaps)


def _other_sources(sources: argparse._SubParsersAction) -> None:
    nlvr2 = sources.add_parser("nlvr2", help="NLVR2 JSON lines and images, or parquet")
    which = nlvr2.add_mutually_exclusive_group(required=True)
    which.add_argument("--data", help="train.json, dev.json or test1.json")
    _parquet(which, "identifier, sentence, label, left_image, right_image")
    nlvr2.add_argument("--images", help="with --data: folder searched recursively for <split>-<set>-<pair>-img*.png")
    _common(nlvr2)

    images = sources.add_parser("images", help="an image folder (image-only pre-training samples)")
    images.add_argument("--images", required=True, help="folder, searched recursively")
    _common(images, "images")

    tsv = sources.add_parser("tsv", help="image<TAB>caption lines (pre-training pairs)")
    tsv.add_argument("--tsv", required=True, help="the TSV file")
    tsv.add_argument("--images", required=True, help="folder the image paths are relative to")
    _common(tsv, "pairs")

    text = sources.add_parser("text", help="text files, one sample per non-empty line")
    text.add_argument("--text", required=True, nargs="+", help="one or more text files")
    _common(text, "text")


def _synth_command(commands: argparse._SubParsersAction) -> None:
    synth = commands.add_parser("synth", help="generate the synthetic corpus in the benchmarks' formats")
    synth.add_argument("--out", required=True, help="corpus root, laid out as data/README.md documents")
    synth.add_argument("--size", choices=("tiny", "small", "medium", "large"), default="small", help="(small)")
    synth.add_argument("--seed", type=int, default=0, help="generator seed (0)")
    for field in (
        "train_images",
        "val_images",
        "test_images",
        "questions_per_image",
        "nlvr2_train_sets",
        "nlvr2_eval_sets",
        "texts",
        "image_size",
    ):
        synth.add_argument(f"--{field.replace('_', '-')}", type=int, help="override the size preset")
    synth.add_argument("--shards", action="store_true", help="also convert every split into OUT/shards/<name>/")
    synth.add_argument(
        "--workers",
        type=positive_int,
        default=os.cpu_count() or 1,
        help="processes writing and converting splits at once; the files are the same for any count (CPU cores)",
    )


def _index_command(commands: argparse._SubParsersAction) -> None:
    index = commands.add_parser("index", help="write the manifest of an img2dataset / DataComp shard folder")
    index.add_argument("folder", help="img2dataset's webdataset output: 00000.tar (+ 00000.parquet), ...")
    index.add_argument(
        "--min-side",
        type=int,
        default=None,
        help="leave out images whose smaller side is below this (64 pixels): the original image's side where "
        "img2dataset recorded it (original_width / original_height), else the stored one (width / height)",
    )


def _index(args: argparse.Namespace) -> dict:
    """``mmoe data index``: the manifest, without its per-sample exclusion lists (they stay in the file)."""
    from mmoe.data.img2dataset import DEFAULT_MIN_SIDE, index_folder
    from mmoe.data.img2dataset_records import MAX_SIDE

    min_side = DEFAULT_MIN_SIDE if args.min_side is None else args.min_side
    if not 0 <= min_side <= MAX_SIDE:
        raise ConversionError(f"--min-side must be a pixel count from 0 to {MAX_SIDE}, got {min_side}")
    manifest = index_folder(args.folder, min_side)
    return {key: value for key, value in manifest.items() if key != "excluded"}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmoe data", description="Build webdataset shards and the synthetic corpus.")
    commands = parser.add_subparsers(dest="command", required=True)

    convert = commands.add_parser("convert", help="convert a dataset's original files to shards")
    sources = convert.add_subparsers(dest="source", required=True)
    _vqav2_source(sources)

    answers = commands.add_parser("answers", help="one VQAv2 answer vocabulary over several annotation files")
    answers.add_argument("--annotations", required=True, nargs="+", help="v2_mscoco_<subtype>_annotations.json files")
    answers.add_argument("--out", required=True, help=f"{ANSWERS_FILE} to write (a JSON list; index = class label)")
    answers.add_argument("--min-answer-count", type=int, default=9, help="keep answers seen this often (9)")

    _caption_sources(sources)
    _other_sources(sources)
    add_imagenet_source(sources, _common)
    add_own_sources(sources, _common)
    add_overlap_command(commands)
    _synth_command(commands)
    _index_command(commands)
    return parser


def check_arguments(args: argparse.Namespace) -> None:
    """The options every converter shares, checked before any input file is read."""
    check_shard_size(args.shard_size)
    if args.name is not None:
        try:
            check_shard_name(args.name)
        except ValueError as error:
            raise ConversionError(f"--name: {error}") from None
    try:
        output_folder(args.out)
    except OutputFolderError as error:
        raise ConversionError(str(error)) from None


#: The sources that read parquet, and the options of their official files that ``--parquet`` excludes.
_OFFICIAL_ONLY = {
    "vqav2": ("images", "annotations", "holdout_images", "holdout_out"),
    "coco-captions": ("images",),
    "flickr30k": (),
    "nlvr2": ("images",),
}


def _tokenizer(args: argparse.Namespace) -> TextTokenizer:
    try:
        return TextTokenizer(sentencepiece=args.text_tokenizer)
    except (FileNotFoundError, ValueError) as error:
        raise ConversionError(f"--text-tokenizer: {error}") from None


def _convert_parquet(args: argparse.Namespace):
    """``--parquet``: the benchmark's HF parquet files into the shards of its official files."""
    from mmoe.data.converters.parquet_captions import convert_flickr30k_parquet, convert_karpathy_parquet
    from mmoe.data.converters.parquet_nlvr2 import convert_nlvr2_parquet
    from mmoe.data.converters.parquet_vqav2 import convert_vqav2_parquet

    options = vars(args)
    for option in _OFFICIAL_ONLY[args.source]:
        if options[option]:
            flag = "--" + option.replace("_", "-")
            raise ConversionError(f"{flag} does not apply to --parquet (the parquet rows hold the images and answers)")
    if args.source == "nlvr2":
        return convert_nlvr2_parquet(args.parquet, args.out, args.shard_size, args.name)
    if not args.split:
        raise ConversionError(f"{args.source} --parquet needs --split (the split whose rows to convert)")
    if args.source == "vqav2":
        return convert_vqav2_parquet(
            args.parquet, args.split, args.out, args.answer_vocab, args.min_answer_count, args.shard_size, args.name
        )
    if args.source == "flickr30k":
        return convert_flickr30k_parquet(
            args.parquet, args.karpathy, args.split, args.out, args.shard_size, args.name, _tokenizer(args)
        )
    return convert_karpathy_parquet(
        args.parquet, args.split, args.out, args.shard_size, args.name, _tokenizer(args), args.test_images
    )


def _check_official(args: argparse.Namespace) -> None:
    """The options a conversion of the official files needs beside its input file."""
    if args.source == "flickr30k" and not args.karpathy:
        raise ConversionError("flickr30k needs --karpathy dataset_flickr30k.json")
    if args.source == "vqav2" and args.split:
        raise ConversionError("--split applies to --parquet only (a questions file names its split)")
    if args.source in _OFFICIAL_ONLY and not args.images:
        raise ConversionError(f"{args.source} needs --images DIR (or --parquet files holding the images)")


def _convert(args: argparse.Namespace):
    if args.source == "imagenet":
        return convert_imagenet(args, check_arguments)
    check_arguments(args)
    if args.source in _OFFICIAL_ONLY:
        if args.parquet:
            return _convert_parquet(args)
        _check_official(args)
    if args.source == "vqav2":
        return convert_vqav2(
            args.questions,
            args.images,
            args.out,
            args.annotations,
            args.answer_vocab,
            args.min_answer_count,
            args.shard_size,
            args.name,
            args.holdout_images,
            args.holdout_out,
            args.seed,
        )
    if args.source in ("coco-captions", "flickr30k"):
        tokenizer = _tokenizer(args)
        if args.karpathy:
            if not args.split:
                raise ConversionError("--karpathy needs --split (train, restval, val, test, or e.g. train,restval)")
            return convert_karpathy(
                args.karpathy, args.split, args.images, args.out, args.shard_size, args.name, tokenizer
            )
        if args.split:
            raise ConversionError("--split applies to --karpathy only")
        return convert_coco_captions(args.annotations, args.images, args.out, args.shard_size, args.name, tokenizer)
    if args.source == "nocaps":
        options = {"shard_size": args.shard_size, "name": args.name, "tokenizer": _tokenizer(args)}
        return convert_nocaps(args.annotations, args.images, args.out, **options)
    if args.source in OWN_SOURCES:
        return convert_own(args, _tokenizer)
    if args.source == "nlvr2":
        return convert_nlvr2(args.data, args.images, args.out, args.shard_size, args.name)
    if args.source == "images":
        return convert_images(args.images, args.out, args.shard_size, args.name)
    if args.source == "tsv":
        return convert_tsv(args.tsv, args.images, args.out, args.shard_size, args.name)
    return convert_text(args.text, args.out, args.shard_size, args.name)


def _synth(args: argparse.Namespace) -> dict:
    from mmoe.data.synth.corpus import SIZES

    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(SIZES[args.size])}
    sizes = {name: value for name, value in overrides.items() if value is not None}
    return synthesize_corpus(args.out, args.size, args.seed, sizes, args.shards, args.workers)


def synthesize_corpus(
    out: str | Path,
    size: str = "small",
    seed: int = 0,
    sizes: dict[str, int] | None = None,
    shards: bool = False,
    workers: int | None = None,
) -> dict:
    """``mmoe data synth``: the synthetic corpus of the ``size`` preset (with ``sizes`` replacing its fields) under
    ``out``, and with ``shards`` every split converted into ``out/shards``; returns the corpus summary (with the
    shards' sample counts). ``workers``: processes (None = the CPU count)."""
    from mmoe.data.synth.convert import convert_layout
    from mmoe.data.synth.corpus import SIZES, build_corpus
    from mmoe.data.synth.layout import CorpusLayout

    workers = workers or os.cpu_count() or 1
    summary = build_corpus(out, seed, dataclasses.replace(SIZES[size], **(sizes or {})), workers)
    if shards:
        manifests = convert_layout(out, CorpusLayout(Path(out)).shards, workers=workers)
        summary["shards"] = {name: m.samples for name, m in manifests.items()}
    return summary


def _answers(args: argparse.Namespace) -> dict:
    vocab = answer_vocab_of(args.annotations, args.min_answer_count)
    if not vocab:
        raise ConversionError(f"no answer is the multiple-choice answer of {args.min_answer_count} or more questions")
    write_text_atomic(args.out, json_text(vocab))
    return {"answers": len(vocab), "out": args.out, "annotations": list(args.annotations)}


def data_command(argv: Sequence[str]) -> int:
    """Runs ``mmoe data ...``; returns the exit status (2 for bad input, with the reason on stderr)."""
    parser = _parser()
    args = parser.parse_args(list(argv))
    if args.command == "check-overlap":
        return overlap_command(args)
    try:
        if args.command == "convert":
            result = _convert(args).to_json()
        elif args.command == "index":
            result = _index(args)
        else:
            result = _answers(args) if args.command == "answers" else _synth(args)
    except ConversionError as error:
        print(f"mmoe data {args.command}: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"mmoe data {args.command}: error: {error}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2))
    return 0
