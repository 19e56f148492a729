"""The ``mmoe data`` commands of a user's own data and of contamination checks.

```
mmoe data convert pairs --table T.csv|.jsonl|.json --images DIR --out OUT [--name pairs]
mmoe data convert captions --table T.csv|.jsonl|.json --images DIR --out OUT [--name captions] [--text-tokenizer spm]
mmoe data convert vqa --table T.csv|.jsonl --images DIR --out OUT [--answer-vocab answers.json] [--split NAME]
mmoe data check-overlap TRAIN EVAL [--strict]
```

The converters are :mod:`mmoe.data.converters.own_data`; ``check-overlap`` prints one JSON report on stdout and one
summary line on stderr (:mod:`mmoe.data.overlap`), and with ``--strict`` exits with status 2 when the splits share an
image.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from mmoe.data.shards import Manifest
from mmoe.io import INPUT_ERROR_EXIT, report_error

#: The ``convert`` sources of a user's own table.
OWN_SOURCES = ("pairs", "captions", "vqa")
_TABLE_HELP = "CSV (with a header), JSON lines, or an LLaVA-style JSON list; image paths relative to --images"


def add_own_sources(sources: argparse._SubParsersAction, common: Callable[..., None]) -> None:
    """The ``convert pairs | captions | vqa`` parsers; ``common`` adds ``--out``, ``--shard-size`` and ``--name``."""
    for source, what, default in (
        ("pairs", "your image-caption rows as pre-training pairs (one sample per row)", "pairs"),
        ("captions", "your image-caption rows as a captioning / retrieval split (one sample per image)", "captions"),
        ("vqa", "your image-question-answers rows as a VQA split", "vqa"),
    ):
        parser = sources.add_parser(source, help=what)
        parser.add_argument("--table", required=True, help=_TABLE_HELP)
        parser.add_argument("--images", required=True, help="the image folder (paths must stay inside it)")
        if source == "captions":
            parser.add_argument("--text-tokenizer", help="SentencePiece model whose ids caption_tokens.json lists")
        if source == "vqa":
            parser.add_argument("--answer-vocab", help="the training split's answers.json (else built)")
            parser.add_argument("--min-answer-count", type=int, default=9, help="vocabulary threshold (9)")
            parser.add_argument("--split", default="own", help="the samples' data_subtype (own)")
        common(parser, default)


def convert_own(args: argparse.Namespace, tokenizer: Callable[[argparse.Namespace], object]) -> Manifest:
    """Runs ``convert pairs | captions | vqa``."""
    from mmoe.data.converters.own_data import convert_own_captions, convert_own_pairs, convert_own_vqa

    if args.source == "pairs":
        return convert_own_pairs(args.table, args.images, args.out, args.shard_size, args.name)
    if args.source == "captions":
        return convert_own_captions(args.table, args.images, args.out, args.shard_size, args.name, tokenizer(args))
    return convert_own_vqa(
        args.table,
        args.images,
        args.out,
        args.answer_vocab,
        args.min_answer_count,
        args.shard_size,
        args.name,
        args.split,
    )


def add_overlap_command(commands: argparse._SubParsersAction) -> None:
    check = commands.add_parser("check-overlap", help="images an eval split shares with a train split")
    check.add_argument("train", help="the training split's folder")
    check.add_argument("eval", help="the evaluation split's folder")
    check.add_argument("--strict", action="store_true", help="exit with status 2 when any image is shared")


def overlap_command(args: argparse.Namespace) -> int:
    """``mmoe data check-overlap``: the JSON report on stdout, one summary line on stderr."""
    from mmoe.data.overlap import OverlapInputError, overlap_report, split_images, summary_line

    try:
        report = overlap_report(split_images(args.train), split_images(args.eval))
    except OverlapInputError as error:
        return report_error("data check-overlap", error)
    print(json.dumps(report, indent=2))
    print(f"mmoe data check-overlap: {summary_line(report)}", file=sys.stderr)
    return INPUT_ERROR_EXIT if args.strict and report["shared_images"] else 0
