"""``mmoe data convert imagenet``: ImageNet-1K's folders, or any ImageFolder tree, as a classification split.

```
mmoe data convert imagenet --images train/ --out OUT [--synsets LOC_synset_mapping.txt | --classes classes.json]
    [--seed 0]
mmoe data convert imagenet --images val/ (--val-solution LOC_val_solution.csv
    | --devkit ILSVRC2012_devkit_t12 --devkit-synsets ids.txt) --classes TRAIN/classes.json --out OUT
```

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
    parser.add_argument("--images", required=True, help="class folders (train/n01440764/...), or the flat val folder")
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
    common(parser)


def convert_imagenet(args: argparse.Namespace) -> Manifest:
    """Runs ``convert imagenet``."""
    from mmoe.data.converters.imagenet_val import convert_imagenet as convert

    return convert(
        args.images,
        args.out,
        classes=args.classes,
        synsets=args.synsets,
        val_solution=args.val_solution,
        devkit=args.devkit,
        devkit_synsets=args.devkit_synsets,
        seed=args.seed,
        shard_size=args.shard_size,
        name=args.name,
    )
