"""Classification split folders written here (shards with an image and ``cls`` per sample, ``classes.json`` beside
them) and a tiny fit's config over them: shared by the classification tests."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
from PIL import Image

from mmoe.data.shards import ShardWriter
from mmoe.model import MoEPlan, MultiwayConfig
from mmoe.runtime.checkpoint import config_to_dict

#: Three classes a tiny model tells apart at once: the image's colour.
CLASSES = [
    ("n00000001", "red", (220, 30, 30)),
    ("n00000002", "green", (30, 200, 30)),
    ("n00000003", "blue", (30, 30, 220)),
]
BACKBONE = MultiwayConfig.preset("test", moe=MoEPlan(num_experts=4, every=2))


def png(colour: tuple[int, int, int], seed: int, size: int = 32) -> bytes:
    """A ``size``-px PNG of ``colour`` with a little noise."""
    noise = np.random.default_rng(seed).integers(-20, 20, (size, size, 3))
    pixels = np.clip(np.array(colour) + noise, 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def write_split(folder: Path, name: str, per_class: int, seed: int = 0) -> Path:
    """A classification split of ``per_class`` images of each of :data:`CLASSES`; keys ``<name>_<i>``."""
    with ShardWriter(folder, name, max_count=16) as writer:
        for i in range(per_class * len(CLASSES)):
            label = i % len(CLASSES)
            writer.write({"__key__": f"{name}_{i:04d}", "png": png(CLASSES[label][2], seed + i), "cls": str(label)})
    entries = [{"index": i, "wnid": wnid, "name": name} for i, (wnid, name, _) in enumerate(CLASSES)]
    (folder / "classes.json").write_text(json.dumps({"classes": entries}))
    return folder


def fit_config(root: Path, train: Path, val: Path, steps: int = 4, **model: object) -> dict:
    """A tiny classification fit over the splits ``train`` / ``val`` (prediction on ``val``), its run folder under
    ``root``; ``model`` arguments over the defaults."""
    model_args = {
        "backbone": config_to_dict(BACKBONE),
        "classes": str(train / "classes.json"),
        "head_init_scale": 1.0,
        "optimizer": {"warmup_steps": 1, "learning_rate": 1e-3},
    } | model
    data_args = {"train_shards": str(train), "val_shards": str(val), "test_shards": str(val), "batch_size": 6,
                 "eval_batch_size": 8, "num_workers": 0, "augmentation": {"auto_augment": None, "re_prob": 0.0},
                 "crop_scale": None}  # fmt: skip
    trainer = {"max_steps": steps, "accelerator": "cpu", "logger": False, "enable_progress_bar": False,
               "val_check_interval": steps, "check_val_every_n_epoch": None, "default_root_dir": str(root)}  # fmt: skip
    return {
        "seed_everything": 0,
        "trainer": trainer,
        "model": {"class_path": "mmoe.tasks.classification.ImageClassificationFineTuning", "init_args": model_args},
        "data": {"class_path": "mmoe.data.datamodules.ClassificationDataModule", "init_args": data_args},
    }
