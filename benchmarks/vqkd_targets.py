"""What BEiT v2's VQ-KD targets cost on this machine, and where the codes are faster to compute.

The tokenizer has the released shape (ViT-B/16 encoder, 768 wide, 12 blocks, 8,192 codes of 32 dimensions); its
weights are random at a trained network's scale (linears ~ 1 / sqrt(fan in)), which changes no timing. Cases (one
JSON line each):

* ``per_image``: seconds per image of :meth:`VQKDTokenizer.encode` in fp32 on batches of ``--batch``, at the patch
  grids of the base configs (14 x 14, 224 px) and of the tiny configs (4 x 4, 64 px), with ``--threads`` torch
  threads; the closed-form FLOPs per image (:func:`mmoe.model.vqkd.vqkd_cost`) and the GFLOP/s they imply.
* ``codebook_per_image``: the same for the k-means patch codebook the configs name by default
  (:class:`mmoe.tasks.visual_codebook.PatchCodebook`, 512 codes over 4 x 4-pooled patches), at the base grid.
* ``where``: seconds per training step of the tiny configs' shape (the tiny backbone's forward and backward on 32
  images of 64 px, an 8,192-way MIM head) with the codes of each batch computed in the task (the main process, after
  the batch arrives, ``--threads`` threads) or in the loader (the DataLoader workers, ``--workers`` of one thread
  each), over ``--steps`` steps from the loader's start.
* ``bf16_agreement``: the share of codes that stay the same when the encoder runs under a bf16 autocast (CPU), on
  random images, at the base grid.

Run: ``.venv/bin/python benchmarks/vqkd_targets.py [--batch 8] [--rounds 3] [--threads 2] [--workers 2]``
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mmoe.model import MultiwayConfig, MultiwayTransformer
from mmoe.model.vqkd import VQKDShape, VQKDTokenizer, vqkd_cost
from mmoe.tasks.visual_codebook import PatchCodebook

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import interleaved_medians  # noqa: E402

#: The released tokenizer, ``vqkd_encoder_base_decoder_3x768x12_clip``.
RELEASED = VQKDShape(dim=768, depth=12, mlp_dim=3072, patch_size=16, grid=14, code_dim=32, num_codes=8192)


def trained_scale_(tokenizer: VQKDTokenizer, seed: int = 0) -> VQKDTokenizer:
    """Random weights at a trained network's scale, and unit codebook rows."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, value in tokenizer.named_parameters():
            noise = torch.randn(value.shape, generator=generator)
            if value.dim() >= 2 and name.endswith("weight"):
                value.copy_(noise / math.sqrt(value[0].numel()))
            elif name.endswith(("pos_embed", "cls_token")):
                value.copy_(0.5 * noise)
            else:
                value.copy_((1.0 if "norm" in name and name.endswith("weight") else 0.0) + 0.1 * noise)
        tokenizer.codebook.copy_(F.normalize(torch.randn(tokenizer.codebook.shape, generator=generator), dim=-1))
    return tokenizer.eval().requires_grad_(False)


def images(count: int, side: int, seed: int) -> torch.Tensor:
    """Smooth random pictures in [0, 1]: coloured blobs from a coarse noise field, bicubic-upsampled."""
    generator = torch.Generator().manual_seed(seed)
    coarse = torch.rand(count, 3, 7, 7, generator=generator)
    return F.interpolate(coarse, size=side, mode="bicubic", align_corners=False).clamp(0, 1)


def per_image_case(grid: int, batch: int, rounds: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    tokenizer = trained_scale_(VQKDTokenizer(RELEASED, grid))
    pixels = images(batch, tokenizer.image_size, seed=1)
    seconds = interleaved_medians([lambda: tokenizer.encode(pixels)], rounds, warmup=1)[0] / batch
    flops = vqkd_cost(RELEASED, grid)["flops_per_image"]
    return {"case": "per_image", "grid": grid, "image_size": tokenizer.image_size, "batch": batch,
            "threads": threads, "seconds_per_image": round(seconds, 4), "gflops_per_image": round(flops / 1e9, 2),
            "gflops_per_s": round(flops / seconds / 1e9, 1)}  # fmt: skip


def codebook_case(batch: int, rounds: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    codebook = PatchCodebook(torch.rand(512, 3 * 4 * 4), patch_size=16, pool=4)
    pixels = images(batch, 224, seed=1)
    seconds = interleaved_medians([lambda: codebook.encode(pixels)], rounds, warmup=1)[0] / batch
    return {"case": "codebook_per_image", "grid": 14, "image_size": 224, "batch": batch, "threads": threads,
            "seconds_per_image": round(seconds, 4)}  # fmt: skip


class Batches(torch.utils.data.Dataset):
    """``count`` batches of 32 tiny-config images (64 px), codes computed in ``__getitem__`` when a tokenizer is
    given: the loader's side."""

    def __init__(self, count: int, tokenizer: VQKDTokenizer | None) -> None:
        self.count, self.tokenizer = count, tokenizer

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        pixels = images(32, 64, seed=index)
        return pixels, None if self.tokenizer is None else self.tokenizer.encode(pixels)


def where_case(where: str, steps: int, threads: int, workers: int) -> dict:
    torch.set_num_threads(threads if where == "task" else 1)
    tokenizer = trained_scale_(VQKDTokenizer(RELEASED, grid=4))
    backbone = MultiwayTransformer(MultiwayConfig.preset("tiny"))
    head = nn.Linear(backbone.config.dim, RELEASED.num_codes)
    dataset = Batches(steps, tokenizer if where == "loader" else None)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers if where == "loader" else 0)
    start = time.perf_counter()  # from the loader's start to the last step: workers' start-up and all waits count
    for pixels, codes in loader:
        if codes is None:
            codes = tokenizer.encode(pixels)
        logits = head(backbone(image=pixels * 2 - 1).image_hidden[:, 1:])
        F.cross_entropy(logits.flatten(0, 1), codes.flatten()).backward()
    seconds = (time.perf_counter() - start) / steps
    return {"case": "where", "where": where, "threads": threads if where == "task" else 1,
            "workers": workers if where == "loader" else 0, "batch": 32, "steps": steps,
            "seconds_per_step": round(seconds, 3)}  # fmt: skip


def bf16_case(batch: int) -> dict:
    tokenizer = trained_scale_(VQKDTokenizer(RELEASED))
    pixels = images(batch, tokenizer.image_size, seed=2)
    exact = tokenizer.encode(pixels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reduced = tokenizer.encode(pixels)
    return {"case": "bf16_agreement", "grid": tokenizer.grid, "codes": exact.numel(),
            "same_share": round(float((exact == reduced).float().mean()), 4)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8, help="images per batch of the per-image case")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12, help="timed steps of the where case")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the main process")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers computing codes in the loader")
    parser.add_argument("--grids", type=int, nargs="+", default=[14, 4])
    args = parser.parse_args()
    for grid in args.grids:
        print(json.dumps(per_image_case(grid, args.batch, args.rounds, args.threads)), flush=True)
    print(json.dumps(codebook_case(args.batch, args.rounds, args.threads)), flush=True)
    for where in ("task", "loader"):
        print(json.dumps(where_case(where, args.steps, args.threads, args.workers)), flush=True)
    torch.set_num_threads(args.threads)
    print(json.dumps(bf16_case(args.batch)), flush=True)


if __name__ == "__main__":
    main()
