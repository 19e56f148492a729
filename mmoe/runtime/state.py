"""Training state a checkpoint carries besides the weights: every process's random generators (exact resume) and
the optimiser states older or other-layout checkpoints need filled in or reshaped."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np
import torch


class OptimizedTask(Protocol):
    """What the optimiser-state fixes read of a task (:class:`mmoe.tasks.base.BackboneTask`)."""

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]: ...

    def optimizer_parameter_names(self) -> list[str]: ...


def reshape_scalar_states(task: OptimizedTask, checkpoint: dict[str, Any]) -> None:
    """Optimiser moments saved as 0-dim tensors for a parameter that is now (1,) (X-MoE's ``log_temperature`` was a
    scalar in older checkpoints) take the parameter's shape, so such a run resumes."""
    states = checkpoint.get("optimizer_states") or []
    if not states:
        return
    parameters = dict(task.named_parameters())
    names = task.optimizer_parameter_names()
    for optimizer_state in states:
        for index, state in optimizer_state.get("state", {}).items():
            if not isinstance(index, int) or index >= len(names) or parameters[names[index]].shape != (1,):
                continue
            for key, value in state.items():
                if key != "step" and isinstance(value, torch.Tensor) and value.dim() == 0:
                    state[key] = value.reshape(1)


def add_missing_optimizer_states(task: OptimizedTask, checkpoint: dict[str, Any]) -> None:
    """Index-keyed AdamW states (a run without FSDP) get zero moments at step 0 for the trainable parameters that
    never had a gradient (the state AdamW would start them with), so that the checkpoint also resumes under FSDP2,
    which loads every parameter's state strictly. Checkpoints written before this lack them and resume only without
    FSDP."""
    names = task.optimizer_parameter_names()
    parameters = dict(task.named_parameters())
    for optimizer_state in checkpoint.get("optimizer_states") or []:
        states = optimizer_state.get("state", {})
        if not all(isinstance(key, int) for key in states):
            continue  # already keyed by parameter name (a fully sharded run's checkpoint)
        for index, name in enumerate(names):
            if index not in states:
                zeros = torch.zeros(parameters[name].shape, dtype=torch.float32, device=parameters[name].device)
                states[index] = {"step": torch.tensor(0.0), "exp_avg": zeros, "exp_avg_sq": zeros.clone()}


def random_states() -> dict[str, Any]:
    """This process's random generator states (torch, CUDA, numpy's global, Python's), as plain values that
    ``torch.load(weights_only=True)`` reads back."""
    kind, keys, position, has_gauss, cached = np.random.get_state()
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached],
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_random_states(states: dict[str, Any]) -> None:
    """Puts back :func:`random_states`."""
    torch.set_rng_state(states["torch"])
    kind, keys, position, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    random.setstate(_as_tuples(states["python"]))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _as_tuples(value: Any) -> Any:
    """Python's random state with the tuples a checkpoint round trip may have turned into lists."""
    return tuple(_as_tuples(item) for item in value) if isinstance(value, list | tuple) else value
