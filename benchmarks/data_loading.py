"""Data loading throughput: decoding image-text pair shards at 224 px, and the tiny pre-training loader.

Cases (one JSON line each):

* ``pairs_224``: samples/s of a full pass over pair shards (JPEG photos of ``--source`` pixels, COCO-like sizes),
  with the training transform (RandomResizedCrop 224 + flip), tokenisation, MVLM masks and batching (32), for 0, 1
  and 2 DataLoader workers; worker start-up is included; median over ``--rounds`` passes.
* ``tiny_pretrain_step``: milliseconds per training step of ``PretrainDataModule`` as configured by the tiny
  pre-training configs (joint image + text + pair batches of 32, 64 px, 40 tokens) over the synthetic corpus.

Run: ``.venv/bin/python benchmarks/data_loading.py [--samples 512] [--rounds 3]``
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from mmoe.data.collate import PretrainCollator
from mmoe.data.datamodules import PretrainDataModule
from mmoe.data.decoders import PairDecoder
from mmoe.data.shards import ShardWriter, resolve_shards
from mmoe.data.streams import ShardStream
from mmoe.data.synth.convert import convert_layout
from mmoe.data.synth.corpus import SynthSizes, build_corpus
from mmoe.data.synth.language import captions
from mmoe.data.synth.layout import PRETRAIN_IMAGE_SPLIT, PRETRAIN_PAIR_SPLIT, PRETRAIN_TEXT_SPLIT
from mmoe.data.synth.scenes import render, sample_scene
from mmoe.data.tokenizer import TextTokenizer
from mmoe.data.transforms import train_transform


def write_photo_shards(folder: Path, samples: int, width: int, height: int) -> list[str]:
    """Pair shards of noisy JPEG photos (quality 90) with captions: sizes and entropy like COCO images."""
    rng = np.random.default_rng(0)
    with ShardWriter(folder, "photos", max_count=128) as writer:
        for index in range(samples):
            scene = sample_scene(rng)
            image = render(scene, 96).resize((width, height), Image.BICUBIC)
            noisy = np.asarray(image, dtype=np.float32) + rng.normal(0, 12, size=(height, width, 3))
            buffer = io.BytesIO()
            Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)).save(buffer, format="JPEG", quality=90)
            writer.write({"__key__": f"{index:06d}", "jpg": buffer.getvalue(), "txt": captions(scene, rng, 1)[0]})
    return [str(folder / name) for name in writer.shards]


def pairs_case(shards: list[str], workers: int, rounds: int, image_size: int, batch_size: int) -> dict:
    tokenizer = TextTokenizer(64)
    grid = (image_size // 16, image_size // 16)
    stream = ShardStream(
        shards,
        PairDecoder(train_transform(image_size), tokenizer, min_side=int(np.ceil(image_size / np.sqrt(0.5)))),
        PretrainCollator("pair", grid, tokenizer=tokenizer),
        batch_size,
    )
    times, count = [], 0
    for _ in range(rounds + 1):  # the first pass warms file caches
        start = time.perf_counter()
        count = sum(batch["image"].shape[0] for batch in torch.utils.data.DataLoader(stream, None, num_workers=workers))
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times[1:])
    return {"case": "pairs_224", "workers": workers, "samples": count, "batch_size": batch_size,
            "seconds": round(seconds, 3), "samples_per_s": round(count / seconds, 1)}  # fmt: skip


def tiny_pretrain_case(shards: Path, workers: int, steps: int) -> dict:
    module = PretrainDataModule(
        image_shards=str(shards / PRETRAIN_IMAGE_SPLIT), text_shards=str(shards / PRETRAIN_TEXT_SPLIT),
        pair_shards=str(shards / PRETRAIN_PAIR_SPLIT), joint=True, batch_size=32, image_size=64, patch_size=16,
        max_text_length=40, batches_per_epoch=steps + 5, num_workers=workers,
    )  # fmt: skip
    iterator = iter(module.train_dataloader())
    start = time.perf_counter()
    for _ in range(5):  # start-up and warm-up
        next(iterator)
    startup = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        next(iterator)
    per_step = (time.perf_counter() - start) / steps
    del iterator  # stop its workers here, before a later case forks new ones
    gc.collect()
    return {"case": "tiny_pretrain_step", "workers": workers, "batches_per_step": 3, "batch_size": 32,
            "ms_per_step": round(1000 * per_step, 1), "first_5_steps_s": round(startup, 2)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=512, help="pair samples in the 224 px case")
    parser.add_argument("--source", default="640x480", help="stored photo size WxH (COCO: about 640x480)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="timed steps of the tiny pre-training loader")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    width, height = (int(v) for v in args.source.split("x"))
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        shards = write_photo_shards(root / "photos", args.samples, width, height)
        for workers in args.workers:
            print(json.dumps(pairs_case(shards, workers, args.rounds, 224, 32)), flush=True)
        build_corpus(root / "synth", sizes=SynthSizes(512, 3, 3, 1, 1, 1, 2048))
        convert_layout(root / "synth", root / "synth" / "shards", shard_size=128)
        assert resolve_shards(root / "synth" / "shards" / PRETRAIN_PAIR_SPLIT)
        for workers in args.workers:
            print(json.dumps(tiny_pretrain_case(root / "synth" / "shards", workers, args.steps)), flush=True)


if __name__ == "__main__":
    main()
