"""Captioning training step: the whole-vocabulary head (BEiT-3) against an ``output_vocab`` head.

One tiny captioning model per head size, the backbones identical, timed in one process, interleaved round by round,
median of the rounds. A step is forward + backward of the masked-token loss (label-smoothed cross-entropy) on one
batch: 64 px images, 32-token captions with about half the positions masked, fp32. The restricted head predicts the
ids of the synthetic corpus's training captions (``--output-vocab``; default: the ids of 2,000 synthetic captions,
about a hundred).

Output: one JSON line per head ``{"head", "classes", "step_s"}``, then ``{"comparison": "full_head_step /
output_vocab_step", "ratio"}``.

Run: ``.venv/bin/python benchmarks/caption_head.py [--rounds 7] [--backbone xmoe|dense|mhmoe] [--output-vocab FILE]``
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from mmoe.data.converters.build_captions import CAPTION_TOKENS_FILE, write_caption_tokens
from mmoe.data.synth.language import captions
from mmoe.data.synth.scenes import sample_scene
from mmoe.data.tokenizer import MASK_ID, TextTokenizer
from mmoe.model import MoEPlan, MultiwayConfig
from mmoe.tasks.captioning import CaptioningFineTuning

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import interleaved_medians  # noqa: E402

BACKBONES = {
    "dense": None,
    "xmoe": MoEPlan(num_experts=8, every=2),
    "mhmoe": MoEPlan(num_experts=8, every=2, heads=4),
}


def synthetic_captions(count: int) -> list[str]:
    rng = np.random.default_rng(0)
    return [caption for _ in range(count) for caption in captions(sample_scene(rng), rng, 1)]


def masked_caption_batch(texts: list[str], batch: int, image_size: int, generator: torch.Generator) -> dict:
    """A captioning training batch: ``batch`` random images and the first ``batch`` of ``texts`` as 32-token captions,
    about half their positions masked (never the first, never padding)."""
    image = torch.randn(batch, 3, image_size, image_size, generator=generator)
    targets, padding = TextTokenizer(32)(texts[:batch], length=32)
    text_mask = (torch.rand(targets.shape, generator=generator) < 0.5) & ~padding
    text_mask[:, 0] = False
    return {
        "image": image,
        "text_ids": torch.where(text_mask, MASK_ID, targets),
        "text_padding_mask": padding,
        "text_targets": targets,
        "text_mask": text_mask,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--backbone", choices=sorted(BACKBONES), default="xmoe")
    parser.add_argument("--output-vocab", help="caption_tokens.json; default: ids of 2,000 synthetic captions")
    args = parser.parse_args()

    texts = synthetic_captions(2000)
    with tempfile.TemporaryDirectory() as tmp:
        vocab = args.output_vocab
        if vocab is None:
            write_caption_tokens(tmp, texts)
            vocab = str(Path(tmp) / CAPTION_TOKENS_FILE)
        backbone = MultiwayConfig(
            dim=192, depth=4, num_heads=3, ffn_dim=768, image_size=64, max_text_positions=64,
            moe=BACKBONES[args.backbone],
        )  # fmt: skip
        torch.manual_seed(0)
        full = CaptioningFineTuning(backbone=backbone)
        small = CaptioningFineTuning(backbone=backbone, output_vocab=vocab)
    small.backbone.load_state_dict(full.backbone.state_dict())

    batch = masked_caption_batch(texts, args.batch, 64, torch.Generator().manual_seed(0))

    def step(model: CaptioningFineTuning):
        def run() -> None:
            model.zero_grad(set_to_none=True)
            logits, _ = model.forward_batch(batch)
            model.task_loss(logits, batch).backward()

        return run

    models = {"full_vocabulary": full, "output_vocab": small}
    medians = interleaved_medians([step(m) for m in models.values()], args.rounds)
    for (name, model), seconds in zip(models.items(), medians, strict=True):
        print(json.dumps({"head": name, "backbone": args.backbone, "classes": model.head.out_features,
                          "step_s": round(seconds, 4)}))  # fmt: skip
    print(json.dumps({"comparison": "full_head_step / output_vocab_step", "ratio": round(medians[0] / medians[1], 2)}))


if __name__ == "__main__":
    main()
