"""Two-process CPU DDP run stopped by a signal that only global rank 0 receives, used by tests/tasks/test_preemption.py
(launched as a script: Lightning's DDP launcher re-runs it once per rank).

Usage: python tests/scripts/ddp_preempt.py OUT_DIR CODEBOOK SHARDS
Rank 0 sends itself SIGUSR2 in the middle of step 1; each rank writes OUT_DIR/rank{r}.json with the global step it
stopped at and its exit code before it exits with that code.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from mmoe.data.datamodules import PretrainDataModule
from mmoe.model import MoEPlan, MultiwayConfig
from mmoe.process_exit import freeze_at_exit
from mmoe.runtime.optimizer import PRETRAINING_OPTIMIZER
from mmoe.runtime.preemption import Preemption
from mmoe.tasks.pretraining import MaskedPretraining


class SignalRankZero(L.Callback):
    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if trainer.global_rank == 0 and trainer.global_step == 1:
            signal.raise_signal(signal.SIGUSR2)


def main() -> None:
    out, codebook, shards = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.set_num_threads(1)
    L.seed_everything(0)
    backbone = MultiwayConfig.preset("test", max_text_positions=32, moe=MoEPlan(num_experts=4, every=1, heads=2))
    task = MaskedPretraining(
        backbone, visual_codebook=codebook, optimizer=dataclasses.replace(PRETRAINING_OPTIMIZER, warmup_steps=1)
    )
    data = PretrainDataModule(
        pair_shards=shards, image_size=32, patch_size=16, batch_size=4, num_workers=0, max_text_length=32,
        batches_per_epoch=8, seed=0,
    )  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_find_unused_parameters_true",
        max_steps=8,
        callbacks=[Preemption(signals=["SIGUSR2"]), SignalRankZero(), ModelCheckpoint(dirpath=out / "checkpoints")],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    code = 0
    try:
        trainer.fit(task, datamodule=data)
    except SystemExit as stopped:
        code = stopped.code
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({"step": trainer.global_step, "code": code}))
    sys.exit(code)


if __name__ == "__main__":
    freeze_at_exit()  # as the mmoe command does: each rank's shutdown skips the objects alive at exit
    main()
