"""``mmoe data convert imagenet``: ImageNet-1K's folders, or any ImageFolder tree, as a classification split.

```
mmoe data convert imagenet --images train/ --out OUT [--synsets LOC_synset_mapping.txt | --classes classes.json]
    [--seed 0]
mmoe data convert imagenet --images val/ (--val-solution LOC_val_solution.csv
    | --devkit ILSVRC2012_devkit_t12 --devkit-synsets ids.txt) --classes TRAIN/classes.json --out OUT
```

The converters are :mod:`mmoe.data.converters.imagenet` (class folders) and :mod:`mmoe.data.converters.imagenet_val`
(the flat validation folder's labels); the class index is :mod:`mmoe.data.converters.class_index`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

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
    from mmoe.data.converters.class_index import class_index_option, classes_file
    from mmoe.data.converters.common import ConversionError, images_folder
    from mmoe.data.converters.imagenet import convert_classification
    from mmoe.data.converters.imagenet_val import devkit_labels, solution_labels

    classes = class_index_option(args.classes, args.synsets)
    classes_from = str(classes_file(args.classes)) if args.classes else args.synsets or ""
    root = images_folder(args.images)
    labels, seed = None, args.seed
    if args.devkit_synsets and not args.devkit:
        raise ConversionError("--devkit-synsets applies to --devkit only")
    if args.devkit or args.val_solution:
        if classes is None:
            raise ConversionError("a flat folder's labels need the training split's --classes (or --synsets)")
        if args.devkit and not args.devkit_synsets:
            raise ConversionError(
                "--devkit needs --devkit-synsets FILE: the WNID of each ILSVRC2012_ID, which the devkit keeps in "
                "data/meta.mat, a MATLAB file mmoe does not read (data/README.md shows how to write the file)"
            )
        if args.devkit:
            labels = devkit_labels(root, Path(args.devkit), Path(args.devkit_synsets), classes, classes_from)
        else:
            labels = solution_labels(root, Path(args.val_solution), classes, classes_from)
        seed = None
    extra_files = [classes_from] if classes_from else []
    return convert_classification(
        root, args.out, labels, classes, classes_from, seed, args.shard_size, args.name, extra_files
    )
