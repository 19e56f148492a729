"""A discrete visual codebook learned from the training images, the masked-image-modeling targets.

BEiT-3 predicts the visual tokens of a pre-trained tokenizer (BEiT v2's VQ-KD) for masked patches. No such tokenizer
can be downloaded here, so mmoe learns its own: every 16-px patch is summarised by an ``pool x pool`` average of its
pixels (colour and coarse layout, ``3 * pool^2`` numbers) and assigned to the nearest of K centroids found by k-means
over patches of the training images (``mmoe tokenizer fit``). Targets stay discrete, so masked image modeling is a
K-way classification with a perplexity, like the text objectives.

Trade-off: pixel k-means codes capture colour, brightness and edges, not semantics; they make MIM learnable on small
data but teach less than a semantic teacher. Where open_clip weights are on disk, the pre-training task can instead
regress a teacher's patch features (``teacher_checkpoint``).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mmoe.data.decoders import ImageDecoder
from mmoe.data.loader import EpochDataLoader
from mmoe.data.shards import resolve_shards
from mmoe.data.streams import ShardStream
from mmoe.data.transforms import eval_transform
from mmoe.io import check_output_path, report_error, writing_output
from mmoe.model.config import MultiwayConfig
from mmoe.runtime.checkpoint import atomic_save
from mmoe.safe_load import load_checkpoint_file

CODEBOOK_FORMAT = "mmoe-visual-codebook"


class PatchCodebook(nn.Module):
    """Nearest-centroid visual tokens of image patches.

    Args:
        centroids: (K, 3 * pool^2) k-means centroids of pooled patches.
        patch_size: patch side in pixels (the backbone's).
        pool: each patch is average-pooled to ``pool x pool`` before matching.
    """

    def __init__(self, centroids: torch.Tensor, patch_size: int, pool: int) -> None:
        super().__init__()
        if patch_size % pool:
            raise ValueError(f"PatchCodebook pool={pool} must divide patch_size={patch_size}")
        self.patch_size, self.pool = patch_size, pool
        self.register_buffer("centroids", centroids.float())

    @property
    def size(self) -> int:
        return self.centroids.shape[0]

    def patch_features(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) -> (B, N, 3 * pool^2), patches in row-major order as the backbone's patch embedding."""
        grid = images.shape[-1] // self.patch_size
        pooled = F.adaptive_avg_pool2d(images.float(), grid * self.pool)  # (B, 3, grid*pool, grid*pool)
        batch, channels = pooled.shape[:2]
        patches = pooled.view(batch, channels, grid, self.pool, grid, self.pool).permute(0, 2, 4, 1, 3, 5)
        return patches.reshape(batch, grid * grid, channels * self.pool * self.pool)

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) -> (B, N) long visual token ids."""
        features = self.patch_features(images)  # float32 whatever the run's precision, like the centroids used here
        centroids = self.centroids.to(features.device, features.dtype)  # a bf16-true run casts the buffer to bf16
        distances = torch.cdist(features, centroids[None].expand(features.shape[0], -1, -1))
        return distances.argmin(-1)

    def save(self, path: str | Path) -> None:
        atomic_save(
            {
                "format": CODEBOOK_FORMAT,
                "centroids": self.centroids.cpu(),
                "patch_size": self.patch_size,
                "pool": self.pool,
            },
            path,
        )

    @classmethod
    def load(cls, path: str | Path) -> PatchCodebook:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"visual codebook {path} does not exist (make one with `mmoe tokenizer fit`)")
        state = load_checkpoint_file(path, "visual codebook", "an mmoe visual codebook written by mmoe tokenizer fit")
        if state.get("format") != CODEBOOK_FORMAT:
            raise ValueError(f"{path} is not an mmoe visual codebook (expected format {CODEBOOK_FORMAT!r})")
        return cls(state["centroids"], state["patch_size"], state["pool"])


def fit_codebook(
    images: Iterable[torch.Tensor],
    size: int = 512,
    patch_size: int = 16,
    pool: int = 4,
    max_patches: int = 200_000,
    iterations: int = 25,
    seed: int = 0,
) -> PatchCodebook:
    """k-means (k-means++ seeding, Lloyd iterations) over pooled patches of ``images``.

    Args:
        images: batches (B, 3, H, W) of training images, normalised as the model sees them.
        size: number of codes K.
        patch_size: the backbone's patch size.
        pool: pooled patch side (features are ``3 * pool^2`` numbers).
        max_patches: patches sampled for fitting (the first ones seen, up to this many).
        iterations: Lloyd iterations.
        seed: seeds the k-means++ draws.
    """
    probe = PatchCodebook(torch.zeros(1, 3 * pool * pool), patch_size, pool)
    chunks, total = [], 0
    for batch in images:
        features = probe.patch_features(batch).reshape(-1, 3 * pool * pool)
        chunks.append(features)
        total += features.shape[0]
        if total >= max_patches:
            break
    if not chunks:
        raise ValueError("fit_codebook got no images")
    data = torch.cat(chunks)[:max_patches]
    if data.shape[0] < size:
        raise ValueError(f"fit_codebook needs at least size={size} patches, got {data.shape[0]}")
    generator = torch.Generator().manual_seed(seed)
    centroids = _kmeans_plus_plus(data, size, generator)
    for _ in range(iterations):
        assignment = torch.cdist(data, centroids).argmin(-1)
        sums = torch.zeros_like(centroids).index_add_(0, assignment, data)
        counts = torch.bincount(assignment, minlength=size).float()
        empty = counts == 0
        centroids = torch.where(empty[:, None], centroids, sums / counts.clamp_min(1)[:, None])
        if empty.any():  # re-seed empty clusters on random patches
            picks = torch.randint(0, data.shape[0], (int(empty.sum()),), generator=generator)
            centroids[empty] = data[picks]
    return PatchCodebook(centroids, patch_size, pool)


def eval_image_batches(
    spec: str | Sequence[str], image_size: int, batch_size: int = 64, num_workers: int = 0
) -> Iterator[torch.Tensor]:
    """Image tensors (B, 3, image_size, image_size) from any shards holding images (image-only, pairs, VQA, captions),
    with the evaluation transform, in shard order: what a codebook is fitted on."""
    stream = ShardStream(
        resolve_shards(spec),
        ImageDecoder(eval_transform(image_size), min_side=image_size),
        collate=lambda items, rng: torch.stack([item["image"] for item in items]),
        batch_size=batch_size,
        name="images",
    )
    yield from EpochDataLoader(stream, batch_size=None, num_workers=num_workers)


def _kmeans_plus_plus(data: torch.Tensor, size: int, generator: torch.Generator) -> torch.Tensor:
    first = torch.randint(0, data.shape[0], (1,), generator=generator)
    centroids = [data[first]]
    nearest = torch.cdist(data, centroids[0]).squeeze(1).square()
    for _ in range(1, size):
        probabilities = nearest / nearest.sum() if nearest.sum() > 0 else torch.full_like(nearest, 1 / len(nearest))
        pick = torch.multinomial(probabilities, 1, generator=generator)
        centroids.append(data[pick])
        nearest = torch.minimum(nearest, torch.cdist(data, data[pick]).squeeze(1).square())
    return torch.cat(centroids)


#: The tiny preset: the backbone of the tiny configs, whose images the default codebook is fit to.
TINY = MultiwayConfig.preset("tiny")


def tokenizer_command(argv: Sequence[str]) -> int:
    """``mmoe tokenizer fit --data SHARDS --out codebook.pt``: learn the visual codebook (MIM targets)."""
    parser = argparse.ArgumentParser(prog="mmoe tokenizer", description=tokenizer_command.__doc__)
    sub = parser.add_subparsers(dest="action", required=True)
    fit = sub.add_parser("fit", help="k-means visual codebook over patches of training images")
    fit.add_argument("--data", required=True, nargs="+", help="shard files, directories or brace patterns with images")
    fit.add_argument("--out", required=True, help="codebook file to write")
    fit.add_argument("--size", type=int, default=512, help="number of visual tokens K")
    fit.add_argument(
        "--image-size",
        type=int,
        default=TINY.image_size,
        help=f"image side the backbone sees (default {TINY.image_size}, the tiny configs')",
    )
    fit.add_argument(
        "--patch-size", type=int, default=TINY.patch_size, help=f"the backbone's patch side (default {TINY.patch_size})"
    )
    fit.add_argument("--pool", type=int, default=4, help="patches are average-pooled to pool x pool")
    fit.add_argument("--max-patches", type=int, default=200_000)
    fit.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(list(argv))

    try:
        result = fit_codebook_file(
            args.data, args.out, args.size, args.image_size, args.patch_size, args.pool, args.max_patches, args.seed
        )
    except (FileNotFoundError, ValueError) as error:
        return report_error("tokenizer fit", error)
    print(json.dumps(result))
    return 0


def fit_codebook_file(
    data: Sequence[str | Path],
    out: str | Path,
    size: int = 512,
    image_size: int = TINY.image_size,
    patch_size: int = TINY.patch_size,
    pool: int = 4,
    max_patches: int = 200_000,
    seed: int = 0,
) -> dict:
    """``mmoe tokenizer fit``: :func:`fit_codebook` over the images of the shards ``data`` (resized to
    ``image_size``), saved whole to ``out``; returns what was written. FileNotFoundError / ValueError on bad input,
    before anything is written."""
    check_output_path(out)
    batches = eval_image_batches([str(path) for path in data], image_size=image_size, batch_size=64)
    codebook = fit_codebook(batches, size, patch_size, pool, max_patches=max_patches, seed=seed)
    with writing_output(out):
        codebook.save(out)
    return {"codebook": str(out), "size": codebook.size, "patch_size": patch_size}
