"""Expert-parallel training run used by tests/moe/test_expert_parallel.py (a script: Lightning's DDP launcher re-runs it
once per rank).

Usage: python tests/scripts/expert_parallel_fit.py OUT_DIR DEVICES EXPERT_PARALLEL STEPS [RESUME_CKPT] [--fsdp]

``--fsdp`` trains with Lightning's ModelParallelStrategy (FSDP2 through ``BackboneTask.configure_model``) instead of
DDP, and saves a single-file (consolidated) checkpoint.

A tiny BackboneTask (mean squared hidden state of a MoE backbone, balance coefficient 0 so that the objective is the
global batch's) trains STEPS steps on 16 fixed images, batch 8 per step in all: DEVICES processes with 8 / DEVICES
each (an unshuffled DistributedSampler: together they see the same 8 images as one process). Rank 0 writes
OUT_DIR/final.pt (the task's full state dict) and OUT_DIR/last.ckpt (a Lightning checkpoint).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import lightning as L
import torch

from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer
from mmoe.process_exit import freeze_at_exit
from mmoe.runtime.optimizer import PRETRAINING_OPTIMIZER
from mmoe.tasks.base import BackboneTask, StepLosses


class SquaredHidden(BackboneTask):
    def __init__(self, expert_parallel: int) -> None:
        # eps 1e-3: Adam's first steps are about lr x sign(g); a large eps keeps float noise in tiny gradients from
        # flipping them between the runs compared.
        optimizer = dataclasses.replace(
            PRETRAINING_OPTIMIZER, warmup_steps=1, learning_rate=1e-2, weight_decay=0.0, eps=1e-3
        )
        super().__init__("sum", optimizer)
        self.save_hyperparameters({"balance_coefficient": 0.0, "balance_reduce": "sum"})
        plan = MoEPlan(num_experts=4, top_k=2, every=1, expert_parallel=expert_parallel)
        config = MultiwayConfig.preset("test", moe=plan)
        self.backbone = MultiwayTransformer(config)
        self.store_configs()

    def step_losses(self, batch) -> StepLosses:
        output = self.backbone(image=batch[0])
        return StepLosses(output.hidden.pow(2).mean(), {}, output.routing, batch[0].shape[0])


def strategy(devices: int, fsdp: bool):
    if fsdp:
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(
            data_parallel_size=devices, tensor_parallel_size=1, save_distributed_checkpoint=False
        )
    return "ddp_find_unused_parameters_true" if devices > 1 else "auto"  # images leave the text FFNs unused


def main() -> None:
    fsdp = "--fsdp" in sys.argv
    argv = [argument for argument in sys.argv if argument != "--fsdp"]
    out, devices, expert_parallel, steps = Path(argv[1]), int(argv[2]), int(argv[3]), int(argv[4])
    resume = argv[5] if len(argv) > 5 else None
    torch.set_num_threads(1)
    L.seed_everything(0)
    images = torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    dataset = torch.utils.data.TensorDataset(images)
    # Rank r reads images r, r + DEVICES, ... in order: one step's images over the ranks are the single process's.
    rank = int(os.environ.get("LOCAL_RANK", 0))
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=devices, rank=rank, shuffle=False)
    loader = torch.utils.data.DataLoader(dataset, batch_size=8 // devices, sampler=sampler)
    task = SquaredHidden(expert_parallel)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy(devices, fsdp),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(task, loader, ckpt_path=resume)
    trainer.save_checkpoint(out / "last.ckpt")  # every rank: the gathering of experts is a collective
    if fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(task, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = task.state_dict()
    if trainer.is_global_zero:
        torch.save(state, out / "final.pt")


if __name__ == "__main__":
    freeze_at_exit()  # as the mmoe command does: each rank's shutdown skips the objects alive at exit
    main()
