"""webdataset shards that already carry ``cls`` (an ImageNet conversion made elsewhere) as a classification split, read
in place: ``mmoe data convert imagenet --shards DIR`` checks every sample and writes ``manifest.json`` and
``classes.json`` beside the tars, which it does not rewrite.

Each sample must hold an image member (``jpg``, ``png``, ...) and a ``cls`` member whose text is a class index of the
given class index (the training split's ``classes.json``, or ``LOC_synset_mapping.txt``). Only the member headers and
the ``cls`` members are read: an image that cannot be decoded is counted and skipped when a run reads it
(:mod:`mmoe.data.accounting`), as in any split. A sample without its members, a ``cls`` that is not a whole number or
is out of range, and a tar cut short stop the index with one line naming the tar and the sample; nothing is written.
"""

from __future__ import annotations

import os
import tarfile
from pathlib import Path
from typing import Any

from mmoe.atomic import write_json_atomic, write_text_atomic
from mmoe.data.converters.class_index import CLASSES_FILE, ClassIndex
from mmoe.data.converters.common import ConversionError
from mmoe.data.converters.image_digests import is_image_entry
from mmoe.data.converters.imagenet import default_name
from mmoe.data.converters.provenance import provenance
from mmoe.data.img2dataset import check_replaceable_index, shard_tars
from mmoe.data.img2dataset_records import tar_groups
from mmoe.data.shards import MANIFEST, Manifest

#: The manifest's ``format`` of a folder of shards indexed in place.
CLASS_SHARDS_FORMAT = "webdataset-cls"
#: A ``cls`` member larger than this is not a class index.
_MAX_CLS_BYTES = 64


def _label(archive: tarfile.TarFile, member: tarfile.TarInfo | None, where: str, classes: ClassIndex) -> int:
    """The class index a sample's ``cls`` member holds, checked against ``classes``."""
    if member is None:
        raise ConversionError(f"{where}: no .cls member (each sample needs its class index)")
    text = archive.extractfile(member).read(_MAX_CLS_BYTES + 1).decode("utf-8", "replace").strip()
    if not text.isdigit() or member.size > _MAX_CLS_BYTES:
        raise ConversionError(f"{where}: cls = {text[:20]!r} is not a class index (a whole number)")
    label = int(text)
    if label >= len(classes):
        raise ConversionError(
            f"{where}: cls {label} is out of range: the class index has {len(classes)} classes "
            f"(0 to {len(classes) - 1})"
        )
    return label


def _check_replaceable(folder: Path, classes_text: str) -> None:
    """The folder holds no manifest of another kind and no other class index."""
    check_replaceable_index(folder, CLASS_SHARDS_FORMAT, "an index of shards with cls")
    written = folder / CLASSES_FILE
    if written.exists() and written.read_text() != classes_text:
        raise ConversionError(f"{written}: holds another class index; it is left as it is")


def index_class_shards(folder: str | os.PathLike, classes: ClassIndex, classes_from: str) -> Manifest:
    """Checks every sample of the ``*.tar`` files in ``folder`` and writes its ``manifest.json`` and ``classes.json``;
    returns the manifest."""
    folder = Path(folder)
    tars = shard_tars(folder)
    _check_replaceable(folder, classes.text())
    per_class = [0] * len(classes)
    shard_samples = []
    for tar in tars:
        cuts: dict[str, str] = {}
        count = 0
        for key, members, archive in tar_groups(tar, cuts):
            where = f"{tar}: sample {key!r}"
            if not any(is_image_entry(extension) for extension in members):
                raise ConversionError(f"{where}: no image member (members: {', '.join(sorted(members))})")
            per_class[_label(archive, members.get("cls"), where, classes)] += 1
            count += 1
        if cuts:
            raise ConversionError(f"{tar}: {cuts[tar.name]}; the tar is incomplete")
        shard_samples.append(count)
    extra: dict[str, Any] = {
        "format": CLASS_SHARDS_FORMAT,
        "source": {"shards": str(folder), "classes": classes_from},
        **provenance([classes_from], "every sample of every .tar in the folder, read in place"),
        "classes": len(classes),
        "images_per_class": per_class,
    }
    files = [tar.name for tar in tars]
    manifest = Manifest(
        default_name(folder), sum(shard_samples), 0, len(tars), files, shard_samples, [], [CLASSES_FILE], extra
    )
    write_text_atomic(folder / CLASSES_FILE, classes.text())
    write_json_atomic(folder / MANIFEST, manifest.to_json())
    return manifest
