"""Retrieval: embedding throughput of the dual encoder, and the chunked R@K evaluation at COCO 5K test size.

* ``embed``: images and texts per second through :class:`mmoe.tasks.retrieval.RetrievalFineTuning`'s image-only and
  text-only passes (inference, no gradients), for the tiny retrieval config's backbone (192 wide, 4 layers, 64 px,
  X-MoE) or BEiT-3 base's shape (768 wide, 12 layers, 384 px, X-MoE); median of the rounds.
* ``chunked_eval``: image -> text and text -> image ranks (:mod:`mmoe.metrics.retrieval`) of 5,000 images against
  25,000 captions (5 each) of width 768, random unit vectors, per ``--chunks`` value; seconds and the peak memory the
  ranking adds over the embeddings (CPU: the peak resident size after resetting it, Linux's ``clear_refs``, each case
  in its own process; CUDA: the allocator's peak). A chunk of 25,000 holds the whole similarity matrix.

Output: one JSON line per case, ``{"benchmark": "embed", "shape", "modality", "batch", "items_per_s"}`` and
``{"benchmark": "chunked_eval", "images", "captions", "dim", "chunk", "seconds", "peak_extra_mib"}``.

Run: ``.venv/bin/python benchmarks/retrieval.py [--shape tiny|base] [--device cpu|cuda] [--chunks 256 1024 25000]
[--images 5000 --captions-per-image 5 --dim 768] [--rounds 3]``
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from mmoe.metrics.retrieval import image_to_text_ranks, text_to_image_ranks
from mmoe.model import MoEPlan, MultiwayConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import interleaved_medians  # noqa: E402

SHAPES = {
    "tiny": dict(dim=192, depth=4, num_heads=3, ffn_dim=768, image_size=64, max_text_positions=64),
    "base": dict(dim=768, depth=12, num_heads=12, ffn_dim=3072, image_size=384, max_text_positions=64),
}


def embedding_throughput(shape: str, batch: int, rounds: int, device: str) -> list[dict]:
    # Imported here: each chunked case's fresh process imports this module, and need not pay for Lightning.
    from mmoe.tasks.retrieval import RetrievalFineTuning

    torch.manual_seed(0)
    backbone = MultiwayConfig(**SHAPES[shape], moe=MoEPlan(num_experts=8, every=2))
    model = RetrievalFineTuning(backbone=backbone).eval().to(device)
    size = backbone.image_size
    images = torch.randn(batch, 3, size, size, device=device)
    texts = torch.randint(3, 1000, (batch, 32), device=device)

    @torch.no_grad()
    def embed_images() -> None:
        model.embed_images(images)

    @torch.no_grad()
    def embed_texts() -> None:
        model.embed_texts(texts)

    medians = interleaved_medians([embed_images, embed_texts], rounds, device)
    return [
        {"benchmark": "embed", "shape": shape, "modality": modality, "batch": batch,
         "items_per_s": round(batch / seconds, 1)}
        for modality, seconds in zip(("image", "text"), medians, strict=True)
    ]  # fmt: skip


def status_mib(field: str) -> float:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in MiB."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024  # kB


def reset_peak_rss() -> None:
    """Sets the process's peak resident size (``VmHWM``) to its current one (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def chunked_eval(images: int, per_image: int, dim: int, chunk: int, device: str) -> dict:
    """One case (on the CPU in a fresh process: freed memory of an earlier case would hide this one's)."""
    generator = torch.Generator().manual_seed(0)
    image_ND = F.normalize(torch.randn(images, dim, generator=generator), dim=-1)
    caption_image_M = torch.arange(images).repeat_interleave(per_image)
    caption_MD = torch.randn(images * per_image, dim, generator=generator).mul_(2)
    for start in range(0, len(caption_MD), 1000):
        caption_MD[start : start + 1000].add_(image_ND[caption_image_M[start : start + 1000]])
    caption_MD.div_(caption_MD.norm(dim=-1, keepdim=True))
    image_ND, caption_MD, caption_image_M = image_ND.to(device), caption_MD.to(device), caption_image_M.to(device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() / 2**20
    else:
        reset_peak_rss()
        before = status_mib("VmRSS")
    start = time.perf_counter()
    image_ranks = image_to_text_ranks(image_ND, caption_MD, caption_image_M, chunk)
    caption_ranks = text_to_image_ranks(image_ND, caption_MD, caption_image_M, chunk)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() / 2**20 - before
    else:
        extra = status_mib("VmHWM") - before
    seconds = time.perf_counter() - start
    assert image_ranks.min() >= 1 and caption_ranks.min() >= 1
    return {"benchmark": "chunked_eval", "device": device, "images": images, "captions": images * per_image,
            "dim": dim, "chunk": chunk, "seconds": round(seconds, 3), "peak_extra_mib": round(extra, 1)}  # fmt: skip


def chunked_eval_in_process(queue, *args) -> None:
    queue.put(chunked_eval(*args))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--images", type=int, default=5000)
    parser.add_argument("--captions-per-image", type=int, default=5)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--chunks", type=int, nargs="+", default=[256, 1024, 25000])
    parser.add_argument("--skip-embed", action="store_true", help="only the chunked evaluation")
    args = parser.parse_args()

    if not args.skip_embed:
        for line in embedding_throughput(args.shape, args.batch, args.rounds, args.device):
            print(json.dumps(line), flush=True)
    context = multiprocessing.get_context("spawn")
    for chunk in args.chunks:
        case = (args.images, args.captions_per_image, args.dim, chunk, args.device)
        if args.device.startswith("cuda"):
            result = chunked_eval(*case)
        else:
            queue = context.Queue()
            process = context.Process(target=chunked_eval_in_process, args=(queue, *case))
            process.start()
            result = queue.get()
            process.join()
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
