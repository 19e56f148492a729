"""Tokens per second, MFU and the progress line (:mod:`mmoe.runtime.throughput`): the tokens a backbone pass reads, and
a tiny ``mmoe fit`` / ``mmoe validate`` started from Python whose logged numbers match a count made by hand from its
batches and FLOPs from :func:`mmoe.model.cost.backbone_cost`."""

from __future__ import annotations

import csv
import re

import lightning as L
import pytest
import torch
import yaml

from mmoe.config.launch import run_lightning
from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer
from mmoe.model.config import PRESETS
from mmoe.model.cost import backbone_cost
from mmoe.runtime.throughput import BackboneTokens, Throughput
from tests.cli_fixtures import small_shards

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

PEAK = 1e9


def test_a_backbone_pass_counts_patches_the_cls_token_and_unpadded_text():
    config = MultiwayConfig.preset("test")  # 32-px images, 16-px patches: 4 patches + CLS
    backbone = MultiwayTransformer(config)
    tokens = BackboneTokens(backbone)
    text = torch.randint(5, 100, (3, 6))
    padding = torch.tensor([[False] * 6, [False] * 4 + [True] * 2, [False] + [True] * 5])
    with torch.no_grad():
        backbone(image=torch.randn(3, 3, 32, 32), text=text, text_padding_mask=padding)
        assert tokens.take().tolist() == [11 + 9 + 6, 11**2 + 9**2 + 6**2]
        backbone(image=torch.randn(2, 3, 32, 32))
        backbone(text=text, text_padding_mask=padding)  # a text-only pass
        assert tokens.take().tolist() == [2 * 5 + 6 + 4 + 1, 2 * 5**2 + 6**2 + 4**2 + 1**2]
        backbone(torch.randn(1, 3, 32, 32), text[:1])  # positional arguments, no padding mask
        assert tokens.take().tolist() == [11, 121]
    assert tokens.take() is None
    tokens.close()
    with torch.no_grad():
        backbone(image=torch.randn(1, 3, 32, 32))
    assert tokens.take() is None  # the hook is gone


class HandCount(L.Callback):
    """Counts each training and validation batch's tokens by hand (a VQA batch is one pass over image + question)."""

    def __init__(self, vision_tokens: int) -> None:
        self.vision_tokens = vision_tokens
        self.train: list[tuple[int, int]] = []  # (tokens, sum of squared lengths) per step
        self.val: list[tuple[int, int]] = []

    def count(self, batch: dict) -> tuple[int, int]:
        lengths = self.vision_tokens + (~batch["text_padding_mask"]).sum(dim=1)
        return int(lengths.sum()), int(lengths.square().sum())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.train.append(self.count(batch))

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if not trainer.sanity_checking:
            self.val.append(self.count(batch))


def vqa_config(shards, root) -> dict:
    vocab = str(shards / "vqav2-train2014" / "answers.json")
    return {
        "trainer": {"max_steps": 4, "accelerator": "cpu", "default_root_dir": str(root), "enable_progress_bar": False,
                    "val_check_interval": 2, "check_val_every_n_epoch": None,
                    "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                               "init_args": {"save_dir": str(root), "name": "csv", "version": 0}}},
        "model": {"class_path": "mmoe.tasks.vqa.VQAFineTuning",
                  "init_args": {"answer_vocab": vocab, "backbone": PRESETS["test"] | {"moe": {"num_experts": 4}},
                                "optimizer": {"warmup_steps": 1}}},
        "data": {"class_path": "mmoe.data.datamodules.VQADataModule",
                 "init_args": {"train_shards": str(shards / "vqav2-train2014"),
                               "val_shards": str(shards / "vqav2-val2014"), "batch_size": 4, "eval_batch_size": 4,
                               "max_text_length": 32, "num_workers": 0}},
        "throughput": {"every_n_steps": 2, "peak_flops": PEAK},
    }  # fmt: skip


def test_logged_throughput_and_mfu_match_a_hand_count_and_the_eta_line_appears(tmp_path, capsys):
    shards = small_shards(tmp_path)
    config = tmp_path / "vqa.yaml"
    config.write_text(yaml.safe_dump(vqa_config(shards, tmp_path / "run")))
    backbone = MultiwayConfig.preset("test", moe=MoEPlan(num_experts=4))
    flops_per_token = backbone_cost(backbone, 1)["flops_per_token"]

    def training_flops(tokens: int, squared: int) -> float:  # 3 x (weights + attention scores 4 * depth * dim * L^2)
        return 3 * (flops_per_token * tokens + 4 * backbone.depth * backbone.dim * squared)

    hand = HandCount(vision_tokens=backbone.num_patches + 1)
    cli = run_lightning("fit", [config], callbacks=[hand])
    out = capsys.readouterr().out
    monitor = next(callback for callback in cli.trainer.callbacks if isinstance(callback, Throughput))
    assert monitor.every_n_steps == 2 and monitor.peak_flops == PEAK  # the CLI added it from the config section
    assert len(hand.train) == 4 and len(hand.val) % 2 == 0  # two validations of the same batches
    with open(tmp_path / "run" / "csv" / "version_0" / "metrics.csv") as handle:
        logged = {int(row["step"]): row for row in csv.DictReader(handle) if row.get("train/tokens_per_s")}
    assert sorted(logged) == [2, 4]
    for step, window in ((2, hand.train[:2]), (4, hand.train[2:])):
        tokens, squared = map(sum, zip(*window, strict=True))
        rate, mfu = float(logged[step]["train/tokens_per_s"]), float(logged[step]["train/mfu"])
        # MFU x peak / (tokens / s) = FLOPs per token: the window's time cancels out.
        assert mfu * PEAK / rate == pytest.approx(training_flops(tokens, squared) / tokens, rel=1e-9)
        line = re.search(rf"^mmoe fit: step {step}/4  loss \S+  ([\d,]+) tokens/s  MFU ([\d.]+)%  "
                         rf"elapsed \d:\d\d:\d\d  ETA \d:\d\d:\d\d$", out, re.MULTILINE)  # fmt: skip
        assert line, out
        assert int(line[1].replace(",", "")) == round(rate) and float(line[2]) == pytest.approx(100 * mfu, abs=0.006)
    trained = sum(tokens for tokens, _ in hand.train)  # the validation batches are not training's
    summary = re.search(rf"^mmoe fit: trained on {trained:,} tokens in ([\d.]+) s: ([\d,]+) tokens/s, MFU ", out,
                        re.MULTILINE)  # fmt: skip
    assert summary, out
    seconds, rate = float(summary[1]), int(summary[2].replace(",", ""))
    assert trained / (seconds + 0.005) - 1 <= rate <= trained / (seconds - 0.005) + 1  # seconds rounded to 0.01

    validated = run_lightning("validate", [config])
    out = capsys.readouterr().out
    evaluated = sum(tokens for tokens, _ in hand.val[: len(hand.val) // 2])  # the batches of one validation
    assert re.search(rf"^mmoe validate: evaluated {evaluated:,} tokens in [\d.]+ s: [\d,]+ tokens/s", out, re.M), out
    assert any(isinstance(callback, Throughput) for callback in validated.trainer.callbacks)


def test_bad_settings_are_refused_naming_the_option():
    with pytest.raises(ValueError, match="throughput.every_n_steps"):
        Throughput(every_n_steps=0)
    with pytest.raises(ValueError, match="throughput.peak_flops"):
        Throughput(peak_flops=0.0)
