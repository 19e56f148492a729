"""Caption decoding: beam search with the image's keys and values computed once against running the whole sequence at
every step.

One tiny captioning model (4 layers, 192 wide, X-MoE every second layer, as ``configs/finetune/captioning_tiny.yaml``)
per image size and head (BEiT-3's whole vocabulary, and the ``output_vocab`` head over the ids of 2,000 synthetic
captions, as the demo's), its matrices drawn at std 0.2 so that decoding runs its full length; a batch of images
decoded with 3 beams to 24 tokens, both ways, in one process, interleaved round by round, median of the rounds; the
two ways' captions compared. At 64 px the image is 17 tokens, at 224 px (BEiT-3's captioning fine-tuning size
before 480) 197.

Output: one JSON line per image size and head ``{"image_size", "image_tokens", "head", "classes", "whole_s",
"cached_s", "ratio": whole_s / cached_s, "same_captions"}``.

Run: ``.venv/bin/python benchmarks/caption_decode.py [--rounds 5] [--sizes 64 224] [--batch 16] [--preset tiny]``
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
from pathlib import Path

import torch

from mmoe.data.converters.build_captions import CAPTION_TOKENS_FILE, write_caption_tokens
from mmoe.model import MoEPlan, MultiwayConfig
from mmoe.tasks.captioning import CaptioningFineTuning

sys.path.insert(0, str(Path(__file__).resolve().parent))
from caption_head import synthetic_captions  # noqa: E402
from timing import interleaved_medians  # noqa: E402


def captioner(image_size: int, preset: str = "tiny", output_vocab: str | None = None) -> CaptioningFineTuning:
    torch.manual_seed(0)
    backbone = MultiwayConfig.preset(preset, image_size=image_size, moe=MoEPlan(num_experts=8, every=2))
    task = CaptioningFineTuning(backbone=backbone, num_beams=3, max_length=24, output_vocab=output_vocab)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in task.parameters():
            if parameter.dim() >= 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return task.eval()


def whole_sequence(task: CaptioningFineTuning) -> CaptioningFineTuning:
    """``task`` decoding as before the image's keys and values were kept: the whole sequence at every step."""
    task.backbone.routes_each_token_alone = lambda: False  # an instance attribute over the method
    return task


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 224])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--preset", choices=("tiny", "test"), default="tiny", help="the backbone shape")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        write_caption_tokens(tmp, synthetic_captions(2000))
        heads = {"whole_vocabulary": None, "output_vocab": str(Path(tmp) / CAPTION_TOKENS_FILE)}
        for size in args.sizes:
            for head, vocab in heads.items():
                cached = captioner(size, args.preset, vocab)
                whole = whole_sequence(captioner(size, args.preset, vocab))
                image = torch.randn(args.batch, 3, size, size, generator=torch.Generator().manual_seed(0))
                same = torch.equal(cached.generate(image).tokens, whole.generate(image).tokens)
                runs = [functools.partial(task.generate, image) for task in (whole, cached)]
                medians = interleaved_medians(runs, args.rounds, warmup=1)
                print(json.dumps({"image_size": size, "image_tokens": 1 + cached.backbone.config.num_patches,
                                  "head": head, "classes": cached.head.out_features, "whole_s": round(medians[0], 4),
                                  "cached_s": round(medians[1], 4), "ratio": round(medians[0] / medians[1], 2),
                                  "same_captions": same}))  # fmt: skip


if __name__ == "__main__":
    main()
