"""``mmoe data convert imagenet``: ImageNet-1K's folders, or any ImageFolder tree, as a classification split.

```
mmoe data convert imagenet --images train/ --out OUT [--synsets LOC_synset_mapping.txt | --classes classes.json]
    [--seed 0]
mmoe data convert imagenet --images val/ (--val-solution LOC_val_solution.csv
    | --devkit ILSVRC2012_devkit_t12 --devkit-synsets ids.txt) --classes TRAIN/classes.json --out OUT
mmoe data convert imagenet --shards DIR (--classes classes.json | --synsets LOC_synset_mapping.txt)
```

``--shards`` reads webdataset shards that already carry ``cls`` in place (:mod:`mmoe.data.converters.imagenet_shards`):
it writes ``manifest.json`` and ``classes.json`` beside the tars and rewrites nothing.

The converter is :func:`mmoe.data.converters.imagenet_val.convert_imagenet` (class folders:
:mod:`mmoe.data.converters.imagenet`; the flat validation folder's labels: :mod:`mmoe.data.converters.imagenet_val`);
the class index is :mod:`mmoe.data.converters.class_index`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from mmoe.data.shards import Manifest


def add_imagenet_source(sources: argparse._SubParsersAction, common: Callable[..., None]) -> None:
    """The ``convert imagenet`` parser; ``common`` adds ``--out``, ``--shard-size`` and ``--name``."""
    parser = sources.add_parser("imagenet", help="ImageNet-1K train / val folders, or any ImageFolder tree")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--images", help="class folders (train/n01440764/...), or the flat val folder")
    source.add_argument(
        "--shards", help="webdataset shards carrying cls, indexed in place (with --classes or --synsets)"
    )
    labels = parser.add_mutually_exclusive_group()
    labels.add_argument("--val-solution", help="Kaggle's LOC_val_solution.csv labelling the flat folder")
    labels.add_argument(
        "--devkit", help="ILSVRC2012_devkit_t12 (or its validation ground-truth file); with --devkit-synsets"
    )
    parser.add_argument("--devkit-synsets", help="the WNID of ILSVRC2012_ID i on line i (from the devkit's meta.mat)")
    index = parser.add_mutually_exclusive_group()
    index.add_argument("--classes", help="the training split's classes.json (or its folder): the labels' class index")
    index.add_argument("--synsets", help="Kaggle's LOC_synset_mapping.txt: the class index, with names")
    parser.add_argument("--seed", type=int, default=0, help="seeds the order class folders' images are written in (0)")
    common(parser, out_required=False)


#: The options that do not apply to ``--shards`` (nothing is written but the index).
_NOT_WITH_SHARDS = ("out", "val_solution", "devkit", "devkit_synsets", "name")


def _index_shards(args: argparse.Namespace) -> Manifest:
    from mmoe.data.converters.class_index import class_index_option, classes_file
    from mmoe.data.converters.common import ConversionError
    from mmoe.data.converters.imagenet_shards import index_class_shards

    given = [option for option in _NOT_WITH_SHARDS if getattr(args, option)]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise ConversionError(f"{flag} does not apply to --shards (the shards are indexed in place, in {args.shards})")
    classes = class_index_option(args.classes, args.synsets)
    if classes is None:
        raise ConversionError("--shards needs the class index its cls values count in: --classes or --synsets")
    return index_class_shards(args.shards, classes, str(classes_file(args.classes)) if args.classes else args.synsets)


def convert_imagenet(args: argparse.Namespace, check_arguments: Callable[[argparse.Namespace], None]) -> Manifest:
    """Runs ``convert imagenet``; ``check_arguments`` checks the options every converter shares."""
    from mmoe.data.converters.common import ConversionError
    from mmoe.data.converters.imagenet_val import convert_imagenet as convert

    if args.shards:
        return _index_shards(args)
    if not args.out:
        raise ConversionError("--images needs --out (the split folder to write)")
    check_arguments(args)
    options = ("classes", "synsets", "val_solution", "devkit", "devkit_synsets", "seed", "shard_size", "name")
    return convert(args.images, args.out, **{option: getattr(args, option) for option in options})
