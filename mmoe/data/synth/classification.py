"""The synthetic corpus's image classification data, in ImageNet's layouts: each COCO image's class is its top
object's colour and shape (``red-circle``: 6 colours x 4 shapes, 24 classes), the train2014 images in
``imagenet/train/<class>/`` and the val2014 images as ``imagenet/val/ILSVRC2012_val_<n>.JPEG`` with Kaggle's
``LOC_val_solution.csv`` (the top object's box) and ``LOC_synset_mapping.txt`` (every class, so that a class without a
training image keeps its index). ``mmoe data convert imagenet`` reads them as it reads ImageNet's.

The images are the ones the COCO part rendered, copied: no scene is drawn again.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmoe.data.synth.layout import CorpusLayout
from mmoe.data.synth.scenes import COLORS, ROWS, SHAPES, Scene

#: Every class, in index order (sorted, as ImageNet's WNIDs are).
CLASSES = tuple(sorted(f"{color}-{shape}" for color in COLORS for shape in SHAPES))


def class_of(scene: Scene) -> str:
    """The class of a scene: its top object's colour and shape (objects are listed top to bottom)."""
    top = scene.shapes[0]
    return f"{top.color}-{top.shape}"


@dataclass(frozen=True)
class RenderedImage:
    """A rendered corpus image: its id, file and scene."""

    image_id: int
    path: Path
    scene: Scene


def _top_box(scene: Scene, size: int) -> str:
    """``x_min y_min x_max y_max`` of the top object, in pixels, as :func:`mmoe.data.synth.scenes.render` draws it."""
    top = scene.shapes[0]
    radius = size * (0.095 if top.size == "small" else 0.15)
    cx, cy = top.x * size, (ROWS.index(top.row) + 0.5) * size / len(ROWS)
    return " ".join(str(round(value)) for value in (cx - radius, cy - radius, cx + radius, cy + radius))


def write_classification_files(
    layout: CorpusLayout, train: Sequence[RenderedImage], val: Sequence[RenderedImage], size: int
) -> dict[str, Any]:
    """Writes the train and val folders, the solution file and the class list; returns the chance levels of the val
    split (the corpus summary's ``chance`` entry ``classification_val``)."""
    for image in train:
        label = class_of(image.scene)
        target = layout.imagenet_images("train") / label / f"{label}_{image.image_id}.JPEG"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(image.path.read_bytes())
    val_folder = layout.imagenet_images("val")
    val_folder.mkdir(parents=True, exist_ok=True)
    rows = ["ImageId,PredictionString"]
    for number, image in enumerate(val, start=1):
        image_id = f"ILSVRC2012_val_{number:08d}"
        (val_folder / f"{image_id}.JPEG").write_bytes(image.path.read_bytes())
        rows.append(f"{image_id},{class_of(image.scene)} {_top_box(image.scene, size)}")
    layout.imagenet_val_solution.write_text("\n".join(rows) + "\n")
    layout.imagenet_synsets.write_text("".join(f"{label} {label.replace('-', ' ')}\n" for label in CLASSES))
    return classification_chance(train, val)


def classification_chance(train: Sequence[RenderedImage], val: Sequence[RenderedImage]) -> dict[str, Any]:
    """The val accuracy of always answering the most common training class (of those tied, the first in index order),
    and of a uniform random guess."""
    counts = Counter(class_of(image.scene) for image in train)
    majority = max(sorted(counts), key=counts.__getitem__)
    hits = sum(class_of(image.scene) == majority for image in val)
    return {
        "classes": len(CLASSES),
        "label": "the top object's colour and shape",
        "majority_class": majority,
        "accuracy_majority_class": round(hits / max(len(val), 1), 4),
        "accuracy_uniform": round(1 / len(CLASSES), 4),
    }
