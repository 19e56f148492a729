"""An exponential moving average of a task's weights with timm's ``ModelEmaV3`` (BEiT-3's ``--model_ema``, DeiT's),
kept outside the task's module tree: the optimiser, the sharding, ``mmoe info`` and ``mmoe export`` see only the
trained weights, and the checkpoint carries the average beside them (``ema_state_dict``), so a resumed fit continues
it and ``mmoe predict --ckpt_path`` evaluates with it."""

from __future__ import annotations

from typing import Any

import torch
from timm.utils import ModelEmaV3
from torch import nn

#: The checkpoint entry holding the average.
EMA_KEY = "ema_state_dict"


class EmaWeights:
    """timm's ``ModelEmaV3`` of a module, made at its first use on the module's device (the trainer moves the task
    after building it), from an average a checkpoint held if one was loaded.

    Args:
        decay: the average's decay per optimiser step.
    """

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.average: ModelEmaV3 | None = None
        self.loaded: dict[str, torch.Tensor] | None = None

    def _made(self, module: nn.Module) -> ModelEmaV3:
        device = next(module.parameters()).device
        if self.average is not None and next(self.average.module.parameters()).device != device:
            self.loaded, self.average = self.average.module.state_dict(), None
        if self.average is None:
            self.average = ModelEmaV3(module, decay=self.decay)
            self.average.module.requires_grad_(False)
            if self.loaded is not None:
                self.average.module.load_state_dict(self.loaded)
                self.loaded = None
        return self.average

    def update(self, module: nn.Module) -> None:
        """One step of the average towards ``module``'s weights."""
        self._made(module).update(module)

    def averaged(self, module: nn.Module) -> nn.Module:
        """The averaged copy of ``module`` (in eval mode), on its device."""
        return self._made(module).module

    def save(self, checkpoint: dict[str, Any]) -> None:
        """Puts the average (or the one loaded and not yet used) into ``checkpoint``."""
        state = self.average.module.state_dict() if self.average is not None else self.loaded
        if state is not None:
            checkpoint[EMA_KEY] = {name: value.detach().cpu() for name, value in state.items()}

    def load(self, checkpoint: dict[str, Any]) -> None:
        """Takes the average ``checkpoint`` holds (none: the next use starts one from the weights then)."""
        state = checkpoint.get(EMA_KEY)
        self.average, self.loaded = None, dict(state) if isinstance(state, dict) else None
