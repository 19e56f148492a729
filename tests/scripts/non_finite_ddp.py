"""Two gloo processes where only rank 1's loss is NaN at step 2, used by tests/tasks/test_non_finite.py (a script:
Lightning's DDP launcher re-runs it once per rank).

Usage: python tests/scripts/non_finite_ddp.py ACTION OUT_DIR

Trains the expert-parallel test's tiny task 5 steps with ``NonFiniteGuard(action=ACTION)``; each rank R writes what
happened to it in ``OUT_DIR/rank<R>.txt``: ``stopped: <message>`` or ``skipped <steps>``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch

from mmoe.process_exit import freeze_at_exit
from mmoe.runtime.non_finite import NonFiniteGuard, NonFiniteTraining
from tests.scripts.expert_parallel_fit import SquaredHidden

BAD_STEP = 2


class NaNOnRank1(SquaredHidden):
    def step_losses(self, batch):
        step = super().step_losses(batch)
        if self.global_step == BAD_STEP and self.global_rank == 1:
            step.task_loss = step.task_loss * torch.tensor(float("nan"))
        return step


def main() -> None:
    torch.manual_seed(0)
    images = torch.randn(16, 3, 32, 32)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images), batch_size=4)
    guard = NonFiniteGuard(action=sys.argv[1])
    trainer = L.Trainer(max_steps=5, accelerator="cpu", devices=2, strategy="ddp_find_unused_parameters_true",
                        callbacks=[guard], logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False)  # fmt: skip
    try:
        trainer.fit(NaNOnRank1(expert_parallel=1), loader)
        outcome = f"skipped {guard.first_skipped}"
    except NonFiniteTraining as stopped:
        outcome = f"stopped: {stopped}"
    (Path(sys.argv[2]) / f"rank{trainer.global_rank}.txt").write_text(outcome)
    torch.distributed.barrier()  # rank 0 (the launcher) ends after rank 1 has written


if __name__ == "__main__":
    freeze_at_exit()  # as the mmoe command does: each rank's shutdown skips the objects alive at exit
    main()
