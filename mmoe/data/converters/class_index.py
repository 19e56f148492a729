"""The class index of a classification split: ``classes.json``, kept in the split folder beside its shards.

```
{"classes": [{"index": 0, "wnid": "n01440764", "name": "tench"}, {"index": 1, "wnid": "n01443537", ...}, ...]}
```

A sample's ``cls`` is the ``index`` of its class. ``wnid`` is the class's folder name (ImageNet's WordNet id, or the
folder name of any ImageFolder tree); ``name`` is the human-readable name where one is known (Kaggle's
``LOC_synset_mapping.txt``), else the ``wnid`` again. Classes read from folders are numbered as torchvision's
``ImageFolder`` numbers them: folder names sorted, which for ImageNet's synset folders is the standard 0..999 order.
An evaluation split is labelled with its training split's index, so that the two agree on every label.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mmoe.data.converters.common import ConversionError, field, json_text, list_field, load_json, read_lines

#: The class index file in a classification split folder.
CLASSES_FILE = "classes.json"


@dataclass(frozen=True)
class ClassIndex:
    """Classes in index order: ``wnids[i]`` and ``names[i]`` are class ``i``'s."""

    wnids: tuple[str, ...]
    names: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.wnids) != len(self.names):
            raise ValueError(f"ClassIndex: {len(self.wnids)} wnids but {len(self.names)} names")

    @classmethod
    def of_folders(cls, folders: Sequence[str]) -> ClassIndex:
        """The classes of an ImageFolder tree: its folder names sorted, each its own name."""
        wnids = tuple(sorted(folders))
        return cls(wnids, wnids)

    def __len__(self) -> int:
        return len(self.wnids)

    def index_of(self) -> dict[str, int]:
        """wnid -> class index."""
        return {wnid: index for index, wnid in enumerate(self.wnids)}

    def to_json(self) -> dict[str, list[dict[str, object]]]:
        return {
            "classes": [
                {"index": index, "wnid": wnid, "name": name}
                for index, (wnid, name) in enumerate(zip(self.wnids, self.names, strict=True))
            ]
        }

    def text(self) -> str:
        """The text of ``classes.json``."""
        return json_text(self.to_json())


def classes_file(path: str | os.PathLike) -> Path:
    """The ``classes.json`` a path names: the file itself, or the one in a split folder."""
    path = Path(path)
    return path / CLASSES_FILE if path.is_dir() else path


def read_classes(path: str | os.PathLike) -> ClassIndex:
    """A ``classes.json`` (a split folder's, or the file itself): each entry's ``index`` its position, each ``wnid``
    a distinct non-empty string; a bad entry is a ConversionError naming the file, the entry and the field."""
    path = classes_file(path)
    entries = list_field(load_json(path), "classes", f"{path}")
    if not entries:
        raise ConversionError(f"{path}: field 'classes' is empty: a class index needs at least one class")
    wnids, names = [], []
    for position, entry in enumerate(entries):
        where = f"{path}: classes[{position}]"
        index = field(entry, "index", int, where)
        if isinstance(index, bool) or index != position:
            raise ConversionError(f"{where}: field 'index' = {json.dumps(index)}, expected {position} (its position)")
        wnid = field(entry, "wnid", str, where)
        if not wnid or wnid in wnids:
            raise ConversionError(f"{where}: field 'wnid' = {wnid!r} is empty or repeats an earlier class")
        wnids.append(wnid)
        names.append(field(entry, "name", str, where))
    return ClassIndex(tuple(wnids), tuple(names))


def read_synset_mapping(path: str | os.PathLike) -> ClassIndex:
    """Kaggle's ``LOC_synset_mapping.txt`` (``n01440764 tench, Tinca tinca`` per line): class ``i`` is line ``i + 1``'s
    wnid, its name the rest of the line (the wnid where the line has nothing more)."""
    path = Path(path)
    wnids: list[str] = []
    names: list[str] = []
    for number, line in enumerate(read_lines(path), start=1):
        if not line.strip():
            continue
        wnid, _, name = line.strip().partition(" ")
        if wnid in wnids:
            raise ConversionError(f"{path}:{number}: wnid {wnid!r} is listed twice (first on an earlier line)")
        wnids.append(wnid)
        names.append(name.strip() or wnid)
    if not wnids:
        raise ConversionError(f"{path}: no '<wnid> <name>' lines (Kaggle's LOC_synset_mapping.txt lists one a line)")
    return ClassIndex(tuple(wnids), tuple(names))


def class_index_option(classes: str | None, synsets: str | None) -> ClassIndex | None:
    """The class index ``--classes`` (a classes.json or a split folder holding one) or ``--synsets``
    (LOC_synset_mapping.txt) names; None where neither is given. Both is a ConversionError."""
    if classes and synsets:
        raise ConversionError("give --classes or --synsets, not both (each is a whole class index)")
    if classes:
        return read_classes(classes)
    return read_synset_mapping(synsets) if synsets else None
