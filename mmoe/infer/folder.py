"""``mmoe infer <task> --image FOLDER --out results.json``: every image of a folder with the same text, one results
entry each, every entry naming its file.

Captioning entries also carry COCO's integer ``image_id``: a folder of numbered files (``000000391895.jpg``) keeps
the numbers, so ``mmoe eval caption`` scores the file against COCO's references. Names that are not distinct numbers
(``000001.jpg``, ``000001.png`` and ``1.jpg`` are all 1; ``cat.jpg`` has none) get ids 1, 2, ... in file order
instead, said in one stderr line; the ``file`` of each entry still tells them apart.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mmoe.atomic import write_text_atomic
from mmoe.infer.images import folder_images
from mmoe.infer.load import FineTuned, InferError
from mmoe.infer.modes import options_of, text_of
from mmoe.infer.results import FolderResults
from mmoe.io import writing_output


def run_folder(model: FineTuned, args: argparse.Namespace) -> FolderResults:
    """Every readable image of the folder ``--image`` with the same text: ``{"file": <name in the folder>, ...the
    spec's folder_entry}`` per image, in ``--out`` (whole or absent)."""
    from tqdm import tqdm

    if args.out is None:
        raise InferError(f"--image {args.image} is a folder: give --out for the results file")
    folder = Path(args.image)
    spec = args.spec
    text, results, unreadable = text_of(args), [], 0
    for path in tqdm(folder_images(folder), desc="mmoe infer", unit="image", file=sys.stderr):
        try:
            image = model.image(path)
        except InferError as error:
            unreadable += 1
            print(f"mmoe infer: skipped: {error}", file=sys.stderr)
            continue
        result, _ = spec.run(model.task, image[None].to(model.device), text, model.text, options_of(args))
        results.append({"file": path.relative_to(folder).as_posix(), **spec.folder_entry(path, result, text)})
    if not results:
        raise InferError(f"--image {args.image}: no image could be read")
    renumbered = number_in_file_order(results)
    if renumbered:
        print(f"mmoe infer: {renumbered}", file=sys.stderr)
    with writing_output(args.out):
        write_text_atomic(args.out, json.dumps(results) + "\n")
    return FolderResults(str(args.out), len(results), unreadable)


def number_in_file_order(entries: list[dict]) -> str | None:
    """Gives ``entries`` (in file order) the ``image_id``s 1, 2, ... unless theirs are distinct integers already;
    returns what was done and why (None when the ids were kept, or the entries have none)."""
    ids = [entry["image_id"] for entry in entries if "image_id" in entry]
    if not ids:
        return None
    file_of: dict[int, str] = {}
    reason = None
    for entry in entries:
        image_id, name = entry.get("image_id"), entry["file"]
        if not isinstance(image_id, int):
            reason = f"{name} is not numbered"
        elif image_id in file_of:
            reason = f"{file_of[image_id]} and {name} are both {image_id}"
        else:
            file_of[image_id] = name
            continue
        break
    if reason is None:
        return None
    for number, entry in enumerate(entries, start=1):
        entry["image_id"] = number
    return (
        f"image ids 1 to {len(entries)} given in file order, since the file names are not distinct numbers "
        f'({reason}); each entry\'s "file" names its image'
    )
