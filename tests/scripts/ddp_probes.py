"""Two-process CPU DDP validation with the zero-shot probes, used by tests/tasks/test_zero_shot_probes.py (launched
as a script: Lightning's DDP launcher re-runs it once per rank).

Usage: python tests/scripts/ddp_probes.py OUT_DIR CODEBOOK CORPUS
Each rank writes OUT_DIR/rank{r}.json with the probe values its validation returned and whether it probed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch

from mmoe.data.datamodules import PretrainDataModule
from mmoe.model import MultiwayConfig
from mmoe.process_exit import freeze_at_exit
from mmoe.tasks.pretraining import MaskedPretraining


def main() -> None:
    out, codebook, corpus = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    torch.set_num_threads(1)  # two processes share the machine's cores
    L.seed_everything(0)
    task = MaskedPretraining(MultiwayConfig.preset("test"), visual_codebook=codebook, probe_pairs=2)
    data = PretrainDataModule(
        pair_shards=str(corpus / "shards" / "pretrain-pairs"),
        val_pair_shards=str(corpus / "shards" / "coco-karpathy-val"),
        image_size=32,
        batch_size=2,
        crop_scale=None,
        num_workers=0,
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
    )  # fmt: skip
    metrics = trainer.validate(task, data, verbose=False)[0]
    logged = {name: value for name, value in metrics.items() if name.startswith("val/probe/")}
    record = {"probes": logged, "probing": task.probing, "loss": metrics["val/loss"]}
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    freeze_at_exit()  # as the mmoe command does: each rank's shutdown skips the objects alive at exit
    main()
