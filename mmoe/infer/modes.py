"""Two of the ways ``mmoe infer`` reads its input: one input, and a converted shard split (a folder of images:
:mod:`mmoe.infer.folder`)."""

from __future__ import annotations

import argparse
import sys

import torch

from mmoe.data.samples import CorruptSampleError
from mmoe.data.shards import expected_samples, resolve_shards
from mmoe.data.streams import ShardStream
from mmoe.infer.load import FineTuned, InferError
from mmoe.infer.results import Routed, ShardResults
from mmoe.infer.routing import draw_routing_map, routing_of
from mmoe.io import one_line, writing_output
from mmoe.tasks.inference import InferResult


def options_of(args: argparse.Namespace) -> dict:
    """The parsed options as a dict (dest -> value), what the spec's ``run`` reads."""
    return vars(args)


def text_of(args: argparse.Namespace) -> str | None:
    """The text of a single input: the value of the spec's ``text`` option (None for a task without one)."""
    option = args.spec.text
    return None if option is None else getattr(args, option)


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
def run_shards(model: FineTuned, args: argparse.Namespace) -> ShardResults:
    """Every sample of the split ``--shards``, decoded by the task's prediction decoder: the task's prediction
    entries in its predictions file ``--out``, as ``mmoe predict`` writes it; corrupt samples skipped and counted.
    The result's ``shortfall`` says how many samples the split's manifests hold that have no entry (corrupt, or
    lost from a damaged shard), None when none is missing or the manifests give no count."""
    from tqdm import tqdm

    if args.out is None:
        raise InferError(f"--shards {args.shards}: give --out for the results file")
    try:
        shards = resolve_shards(args.shards)
    except (FileNotFoundError, ValueError) as error:
        raise InferError(f"--shards: {one_line(error)}") from None
    decode = args.spec.shard_decoder(model.image_size, model.tokenizer)
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
    with writing_output(args.out):
        model.task.write_predictions(entries, args.out)  # atomically, one entry per sample, as `mmoe predict`
    shortfall = None
    if total is not None and len(entries) < total:
        missing = total - len(entries)
        shortfall = (
            f"results were written for {len(entries)} of the {total} samples the manifests of --shards {args.shards} "
            f"hold ({missing} missing: {corrupt} corrupt, {max(missing - corrupt, 0)} lost; see 'skipped' and 'lost' "
            "above)"
        )
    return ShardResults(str(args.out), len(entries), corrupt, shortfall)


def run_single(model: FineTuned, args: argparse.Namespace) -> InferResult:
    """One input (the spec's image options and text): the spec's result, with ``--routing`` its expert map and the
    experts of the routed text's tokens."""
    spec = args.spec
    images = torch.stack([model.image(getattr(args, option)) for option in spec.images])
    result, routed_text = spec.run(model.task, images.to(model.device), text_of(args), model.text, options_of(args))
    if args.routing:
        if model.task.backbone.config.moe is None:
            raise InferError(f"--routing {args.routing}: the checkpoint's backbone is dense (no MoE layer)")
        text_tokens, records, image_len = routing_of(model, images, routed_text)
        with writing_output(args.routing, "--routing"):
            draw_routing_map(model, images, records, image_len, args.routing)
        return Routed(result, text_tokens, str(args.routing))
    return result
