"""The three ways ``mmoe infer`` reads its input: one input, a folder of images, a converted shard split."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from mmoe.atomic import write_text_atomic
from mmoe.data.samples import CorruptSampleError
from mmoe.data.shards import expected_samples, resolve_shards
from mmoe.data.streams import ShardStream
from mmoe.infer.load import FineTuned, InferError
from mmoe.infer.routing import draw_routing_map, routing_of
from mmoe.io import one_line

#: Image files read from a folder.
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")


def options_of(args: argparse.Namespace) -> dict:
    """The parsed options as a dict (dest -> value), what the task's ``infer`` reads."""
    return vars(args)


def text_of(model: FineTuned, args: argparse.Namespace) -> str | None:
    option = model.task.infer_text
    return None if option is None else getattr(args, option)


def folder_images(folder: Path) -> list[Path]:
    images = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not images:
        raise InferError(f"--image {folder} holds no image ({', '.join(IMAGE_SUFFIXES)})")
    return images


def run_folder(model: FineTuned, args: argparse.Namespace) -> dict:
    """Every readable image of the folder ``--image`` with the same text: the task's ``folder_entry`` of each, in
    ``--out`` (whole or absent)."""
    from tqdm import tqdm

    if args.out is None:
        raise InferError(f"--image {args.image} is a folder: give --out for the results file")
    text, results, unreadable = text_of(model, args), [], 0
    for path in tqdm(folder_images(Path(args.image)), desc="mmoe infer", unit="image", file=sys.stderr):
        try:
            image = model.image(path)
        except InferError as error:
            unreadable += 1
            print(f"mmoe infer: skipped: {error}", file=sys.stderr)
            continue
        result, _ = model.task.infer(image[None].to(model.device), text, model.text, options_of(args))
        results.append(model.task.folder_entry(path, result, text))
    if not results:
        raise InferError(f"--image {args.image}: no image could be read")
    write_text_atomic(args.out, json.dumps(results) + "\n")
    return {"results_file": str(args.out), "images": len(results), "unreadable_skipped": unreadable}


def single_batch(item: dict, device: torch.device) -> dict:
    """A batch of one decoded sample, as the task's collator would give it: tensors and token ids gain a batch
    dimension (one sample has no padding), every other field becomes a one-element list."""
    batch = {}
    for key, value in item.items():
        if isinstance(value, torch.Tensor):
            batch[key] = value[None].to(device)
        elif key == "text_ids":
            batch[key] = torch.tensor([value], device=device)
        else:
            batch[key] = [value]
    return batch


@torch.no_grad()
def run_shards(model: FineTuned, args: argparse.Namespace) -> dict:
    """Every sample of the split ``--shards``, decoded by the task's prediction decoder: the task's prediction
    entries in its predictions file ``--out``, as ``mmoe predict`` writes it; corrupt samples skipped and counted."""
    from tqdm import tqdm

    if args.out is None:
        raise InferError(f"--shards {args.shards}: give --out for the results file")
    try:
        shards = resolve_shards(args.shards)
    except (FileNotFoundError, ValueError) as error:
        raise InferError(f"--shards: {one_line(error)}") from None
    decode = model.task.prediction_decoder(model.image_size, model.tokenizer)
    entries, corrupt = [], 0
    total = sum(expected_samples(shards).values()) or None
    stream = ShardStream(shards, decode=lambda raw: raw, rank=0, world_size=1)  # every sample, also under torchrun
    for sample in tqdm(stream, total=total, desc="mmoe infer", file=sys.stderr):
        try:
            item = decode(sample)
        except CorruptSampleError as error:
            corrupt += 1
            print(f"mmoe infer: skipped: {error}", file=sys.stderr)
            continue
        entries += model.task.prediction_entries(single_batch(item, model.device))
    if not entries:
        raise InferError(f"--shards {args.shards}: no sample could be read")
    model.task.write_predictions(entries, args.out)  # atomically, one entry per sample, as `mmoe predict`
    return {"results_file": str(args.out), "samples": len(entries), "corrupt_skipped": corrupt}


def run_single(model: FineTuned, args: argparse.Namespace) -> dict:
    """One input (the task's image options and text): the task's result, with ``--routing`` its expert map and the
    experts of the routed text's tokens."""
    images = torch.stack([model.image(getattr(args, option)) for option in model.task.infer_images])
    result, routed_text = model.task.infer(images.to(model.device), text_of(model, args), model.text, options_of(args))
    if args.routing:
        if model.task.backbone.config.moe is None:
            raise InferError(f"--routing {args.routing}: the checkpoint's backbone is dense (no MoE layer)")
        tokens, records, image_len = routing_of(model, images, routed_text)
        title = f"{model.task.name}: distinct experts per patch"
        draw_routing_map(model, images, records, image_len, title, args.routing)
        result.update(tokens, routing_map=str(args.routing))
    return result
