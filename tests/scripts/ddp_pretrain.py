"""Two-process CPU DDP pre-training run used by tests/tasks/test_pretraining_run.py (launched as a script:
Lightning's DDP launcher re-runs it once per rank).

Usage: python tests/scripts/ddp_pretrain.py OUT_DIR CODEBOOK SHARDS
Each rank writes OUT_DIR/rank{r}.json with the sample keys it trained on, its local expert counts, and a checksum
of its final weights.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger

from mmoe.data.batches import step_batches
from mmoe.data.datamodules import PretrainDataModule
from mmoe.model import MoEPlan, MultiwayConfig
from mmoe.process_exit import freeze_at_exit
from mmoe.runtime.optimizer import PRETRAINING_OPTIMIZER
from mmoe.runtime.routing_callback import RoutingStatsCallback
from mmoe.tasks.pretraining import MaskedPretraining


class Recorder(L.Callback):
    """Remembers what this rank saw and routed."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.counts: dict[str, list[int]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        for single in step_batches(batch):
            self.keys.extend(single["key"])
        for record in outputs["routing"]:
            name = f"layer{record.layer}/{record.modality}"
            previous = self.counts.get(name, [0] * record.expert_counts.numel())
            self.counts[name] = [a + b for a, b in zip(previous, record.expert_counts.tolist(), strict=True)]


def main() -> None:
    out, codebook, shards = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.set_num_threads(1)  # two processes share the machine's cores
    L.seed_everything(0)
    backbone = MultiwayConfig.preset("test", max_text_positions=32, moe=MoEPlan(num_experts=4, every=1, heads=2))
    optimizer = dataclasses.replace(PRETRAINING_OPTIMIZER, warmup_steps=1)
    task = MaskedPretraining(backbone, visual_codebook=codebook, optimizer=optimizer)
    data = PretrainDataModule(
        pair_shards=shards,
        image_size=32,
        patch_size=16,
        batch_size=4,
        num_workers=0,
        max_text_length=32,
        batches_per_epoch=4,
        seed=0,
    )
    recorder = Recorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_find_unused_parameters_true",  # a pair-only step leaves the MIM head unused
        max_steps=4,
        log_every_n_steps=2,
        callbacks=[recorder, RoutingStatsCallback(every_n_steps=4, save_dir=out)],
        logger=CSVLogger(out, name="logs", version=0),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(task, datamodule=data)
    checksum = sum(float(p.double().sum()) * (i + 1) for i, p in enumerate(task.parameters()))
    rank = trainer.global_rank
    (out / f"rank{rank}.json").write_text(
        json.dumps({"keys": recorder.keys, "counts": recorder.counts, "checksum": checksum})
    )


if __name__ == "__main__":
    freeze_at_exit()  # as the mmoe command does: each rank's shutdown skips the objects alive at exit
    main()
