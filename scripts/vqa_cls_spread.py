"""How much of the VQA task's vision CLS comes from the image and how much from the question, while it trains.

    .venv/bin/python scripts/vqa_cls_spread.py runs/demo/pretrain/mhmoe/backbone.pt --corpus runs/demo/data \
        --steps 150 [--prior-bias] [--learning-rate 2e-4]

A fixed batch of 32 training questions (``--batch-size``): the spread (mean squared distance from the batch mean of
the backbone's final vision CLS) of one question with the 32 images, and of one image with the 32 questions, every 25
steps of a plain AdamW loop (betas 0.9 / 0.98, weight decay 0.01, 30 warm-up steps, batches of the same size, seed 0)
over the task's loss;
``--steps 0`` only measures the backbone. One JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import torch

from mmoe.data.datamodules import VQADataModule
from mmoe.tasks.vqa import VQAFineTuning


def spread(x: torch.Tensor) -> float:
    return float((x - x.mean(0)).pow(2).sum(1).mean())


@torch.no_grad()
def cls_spreads(task: VQAFineTuning, batch: dict) -> dict:
    """Spread of the vision CLS over the batch's images (with its first question) and over its questions (with its
    first image)."""
    task.eval()
    images, texts, padding = batch["image"], batch["text_ids"], batch["text_padding_mask"]
    count = len(images)
    backbone = task.backbone
    over_images = backbone(
        image=images, text=texts[:1].expand(count, -1), text_padding_mask=padding[:1].expand(count, -1)
    )
    over_questions = backbone(image=images[:1].expand(count, -1, -1, -1), text=texts, text_padding_mask=padding)
    task.train()
    return {"over_images": spread(over_images.hidden[:, 0]), "over_questions": spread(over_questions.hidden[:, 0])}


def epochs(data: VQADataModule) -> Iterator[dict]:
    """The training batches, epoch after epoch."""
    while True:
        empty = True
        for batch in data.train_dataloader():
            empty = False
            yield batch
        if empty:
            raise SystemExit(f"vqa_cls_spread: the training shards give no full batch of {data.batch_size}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("backbone", type=Path)
    parser.add_argument("--corpus", type=Path, default=Path("runs/demo/data"))
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--prior-bias", action="store_true")
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    torch.manual_seed(0)
    vocab = str(args.corpus / "shards" / "vqav2-train2014" / "answers.json")
    task = VQAFineTuning(answer_vocab=vocab, backbone=None, pretrained=str(args.backbone), prior_bias=args.prior_bias)
    size = task.backbone.config.image_size
    data = VQADataModule(
        data_root=str(args.corpus), train_shards="shards/vqav2-train2014", image_size=size, answer_vocab=vocab,
        crop_scale=None, randaugment=False, batch_size=args.batch_size, num_workers=1,
    )  # fmt: skip
    data.setup("fit")
    batches = epochs(data)
    probe = next(batches)  # measured at every step, never trained on
    optimizer = torch.optim.AdamW(task.parameters(), lr=args.learning_rate, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 30))
    for step in range(args.steps + 1):
        record = {"step": step} | cls_spreads(task, probe)
        if step < args.steps:
            batch = next(batches)
            logits, _ = task(batch["image"], batch["text_ids"], batch["text_padding_mask"])
            loss = task.task_loss(logits, batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            warmup.step()
            record["loss"] = float(loss)
        if step % 25 == 0 or step == args.steps:
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
