"""Small Lightning callbacks of mmoe runs started from Python (the demo, the claims study)."""

from __future__ import annotations

import time

import lightning as L


class StepProgress(L.Callback):
    """Prints one line every ``every_n_steps`` training steps (and at the last): step, loss and elapsed time.

    Args:
        label: what is training (printed first).
        every_n_steps: steps between lines.
    """

    def __init__(self, label: str = "train", every_n_steps: int = 50) -> None:
        self.label = label
        self.every_n_steps = every_n_steps
        self._start = time.perf_counter()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step
        if step % self.every_n_steps and step != trainer.max_steps:
            return
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        elapsed = time.perf_counter() - self._start
        print(f"    {self.label}: step {step}/{trainer.max_steps}  loss {float(loss):.3f}  {elapsed:.0f} s", flush=True)
