"""The cost of logging routing statistics (RoutingStatsCallback, mmoe.runtime.routing_logging) as a share of the step.

Trains the tiny pre-training backbone (``configs/pretrain/tiny.yaml`` with a MoE part, ``xmoe`` by default: 4
layers, 192 wide, 64-px images, 8 experts every other layer) on random batches of the tiny config's shape (32 images
and 32 texts of 40 tokens) with ``Trainer.fit``, a TensorBoard and a CSV logger (what ``mmoe fit`` gives a run
folder), once per tier. Within each run it times the callback's hooks (the per-batch accumulation and each window's
reduction, scalars, heatmap, histograms and sub-token maps) against the training time around them, so both numbers
come from the same steps. Prints one JSON line per tier::

    {"tier", "steps", "every_n_steps", "train_s", "callback_s", "step_s", "share"}

with ``share = callback_s / (train_s - callback_s)``, then ``{"summary": {tier: share}, "target": 0.03}``. The
step predicts 15% of the text tokens through one vocabulary-wide head (no image head, no masking), so it is lighter
than a real pre-training step and the share an upper bound of its.

Run: ``.venv/bin/python benchmarks/routing_logging.py [--steps 200] [--every 50] [--variant xmoe]``;
``--quick``: the tests' 2-layer backbone and a few steps (the smoke test).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
import yaml
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset

from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer
from mmoe.runtime.routing_callback import RoutingStatsCallback

ROOT = Path(__file__).resolve().parents[1]
TARGET_SHARE = 0.03


class TextPredictionTask(L.LightningModule):
    """The training tasks' contract (``{"loss", "routing"}``): the backbone on image-text pairs, 15% of the text
    tokens predicted through a vocabulary-wide head (an MLM head's cost), plus the balance losses."""

    def __init__(self, config: MultiwayConfig) -> None:
        super().__init__()
        self.backbone = MultiwayTransformer(config)
        self.head = torch.nn.Linear(config.dim, config.vocab_size)

    def training_step(self, batch, batch_idx):
        image, text = batch
        output = self.backbone(image=image, text=text)
        predicted = max(1, text.shape[1] * 15 // 100)  # MLM's share of the tokens
        logits = self.head(output.text_hidden[:, :predicted])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), text[:, :predicted].flatten())
        return {"loss": loss + 0.01 * sum(r.balance_loss for r in output.routing), "routing": output.routing}

    def validation_step(self, batch, batch_idx):
        return None  # the held-out images are what the callback keeps; no score

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class TimedRoutingStats(RoutingStatsCallback):
    """RoutingStatsCallback that adds up the seconds its training hooks take, and the training's seconds."""

    callback_s = 0.0
    train_s = 0.0

    def on_train_start(self, trainer, pl_module):
        self._started = time.perf_counter()

    def on_train_end(self, trainer, pl_module):
        self.train_s = time.perf_counter() - self._started
        super().on_train_end(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        start = time.perf_counter()
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.callback_s += time.perf_counter() - start


def tiny_config(variant: str) -> MultiwayConfig:
    """The tiny pre-training backbone with the MoE plan of ``configs/pretrain/tiny/<variant>.yaml``."""
    backbone = yaml.safe_load((ROOT / "configs/pretrain/tiny.yaml").read_text())["model"]["init_args"]["backbone"]
    part = yaml.safe_load((ROOT / f"configs/pretrain/tiny/{variant}.yaml").read_text())
    plan = MoEPlan(**part["model"]["init_args"]["backbone"]["moe"])
    return MultiwayConfig(**(backbone | {"moe": plan}))


def quick_case() -> tuple[MultiwayConfig, int, int, int]:
    """The smoke test's case: the tests' 2-layer backbone with 8 experts in each layer, 6 steps of 4, windows of 2."""
    plan = MoEPlan(num_experts=8, heads=2, every=1)
    return MultiwayConfig.preset("test", vocab_size=1000, moe=plan), 6, 2, 4


def run(tier: str, config: MultiwayConfig, steps: int, every: int, batch: int, out: Path) -> dict:
    torch.manual_seed(0)
    side, text = config.image_size, min(40, config.max_text_positions)
    data = TensorDataset(torch.randn(steps * batch, 3, side, side), torch.randint(0, 1000, (steps * batch, text)))
    held_out = DataLoader([{"image": image} for image in torch.randn(4, 3, side, side)], batch_size=4)
    callback = TimedRoutingStats(every_n_steps=every, tier=tier, save_dir=out)
    trainer = L.Trainer(
        max_steps=steps, logger=[TensorBoardLogger(out, name="tensorboard"), CSVLogger(out, name="csv")],
        callbacks=[callback], log_every_n_steps=every, check_val_every_n_epoch=2, num_sanity_val_steps=1,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
        devices=1,
    )  # fmt: skip
    trainer.fit(TextPredictionTask(config), DataLoader(data, batch_size=batch), held_out)
    share = callback.callback_s / (callback.train_s - callback.callback_s)
    return {
        "tier": tier,
        "steps": steps,
        "every_n_steps": every,
        "train_s": round(callback.train_s, 3),
        "callback_s": round(callback.callback_s, 4),
        "step_s": round((callback.train_s - callback.callback_s) / steps, 4),
        "share": round(share, 5),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", default="xmoe", help="the MoE part of configs/pretrain/tiny/")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=50, help="every_n_steps (the tiny config's 50)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="the tests' backbone, 6 steps of 4, a window of 2")
    args = parser.parse_args()
    if args.quick:
        config, steps, every, batch = quick_case()
    else:
        config, steps, every, batch = tiny_config(args.variant), args.steps, args.every, args.batch
    results = {}
    for tier in ("brief", "detailed"):
        with tempfile.TemporaryDirectory() as out:
            result = run(tier, config, steps, every, batch, Path(out))
        results[tier] = result["share"]
        print(json.dumps(result), flush=True)
    print(json.dumps({"summary": results, "target": TARGET_SHARE}))


if __name__ == "__main__":
    main()
