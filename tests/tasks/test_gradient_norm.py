"""One gradient-norm pass per optimiser step (:mod:`mmoe.runtime.gradient_norm`): the non-finite check's norm is reused
by norm clipping, which skips the multiply by one, and a fit ends with the weights of Lightning's own clipping, bit for
bit, with clipped and unclipped steps."""

from __future__ import annotations

import statistics

import lightning as L
import pytest
import torch

from mmoe.model import MoEPlan, MultiwayConfig
from mmoe.runtime.gradient_norm import MeasuredNorm, clip_coefficient, clip_to_measured_norm
from mmoe.runtime.non_finite import NonFiniteGuard
from mmoe.runtime.optimizer import OptimizerConfig
from mmoe.tasks.nlvr2 import NLVR2FineTuning

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

STEPS = 8


def gradients(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in ((64, 32), (32,), (7, 5, 3))]


def test_clipping_with_the_measured_norm_is_torchs_clip_grad_norm():
    for max_norm in (0.5, 5.0, 1e4):  # clipped hard, clipped a little, not clipped
        parameters = [torch.nn.Parameter(torch.zeros_like(grad)) for grad in gradients()]
        expected = [torch.nn.Parameter(torch.zeros_like(grad)) for grad in gradients()]
        for parameter, reference, grad in zip(parameters, expected, gradients(), strict=True):
            parameter.grad, reference.grad = grad.clone(), grad.clone()
        torch.nn.utils.clip_grad_norm_(expected, max_norm)
        measured = MeasuredNorm.of([parameter.grad for parameter in parameters])
        clip_to_measured_norm(parameters, max_norm, measured.total)
        for parameter, reference in zip(parameters, expected, strict=True):
            assert torch.equal(parameter.grad, reference.grad), max_norm


def test_a_step_that_needs_no_clipping_leaves_the_gradients_untouched():
    parameters = [torch.nn.Parameter(torch.zeros_like(grad)) for grad in gradients()]
    for parameter, grad in zip(parameters, gradients(), strict=True):
        parameter.grad = grad
    grads = [parameter.grad for parameter in parameters]
    measured = MeasuredNorm.of(grads)
    total = float(measured.total)
    clip_to_measured_norm(parameters, total * 2, measured.total)
    assert measured.is_of(grads)  # no multiply by one: no gradient changed in place


@pytest.mark.parametrize("scale", [0.01, 1.0, 100.0])
def test_the_coefficient_is_one_exactly_where_torchs_clipping_changes_nothing(scale):
    """Near ``max_norm = norm`` torch's ``max_norm / (norm + 1e-6)`` in the norm's dtype decides: the skip follows it
    there too (with small norms the 1e-6 clips a step whose norm is just below ``max_norm``)."""
    grads = [grad * scale for grad in gradients()]
    total = torch.nn.utils.get_total_norm(grads)
    for relative in (-1e-4, -3e-6, -1e-6, -1e-7, 0.0, 1e-7, 1e-6, 3e-6, 1e-4):
        max_norm = float(total) * (1 + relative)
        parameters = [torch.nn.Parameter(torch.zeros_like(grad)) for grad in grads]
        for parameter, grad in zip(parameters, grads, strict=True):
            parameter.grad = grad.clone()
        torch.nn.utils.clip_grad_norm_(parameters, max_norm)
        unchanged = all(torch.equal(p.grad, grad) for p, grad in zip(parameters, grads, strict=True))
        assert (clip_coefficient(max_norm, total) == 1.0) == unchanged, (scale, relative)


def test_a_gradient_changed_dropped_or_replaced_makes_the_measurement_stale():
    grads = gradients()
    measured = MeasuredNorm.of(grads)
    assert measured.is_of(grads) and measured.is_of(list(grads))
    assert not measured.is_of(grads[:2])  # a gradient set to None in between
    assert not measured.is_of([grads[0], grads[1], grads[2].clone()])
    assert not measured.is_of([grads[1], grads[0], grads[2]])
    grads[1].mul_(1.0)  # the same values, but written in place
    assert not measured.is_of(grads)


def nlvr2_batch(seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {
        "image_left": torch.randn(4, 3, 32, 32, generator=generator),
        "image_right": torch.randn(4, 3, 32, 32, generator=generator),
        "text_ids": torch.randint(3, 110, (4, 6), generator=generator),
        "text_padding_mask": torch.zeros(4, 6, dtype=torch.bool),
        "label": torch.tensor([1, 0, 1, 0]),
    }


class LightningClipping(NLVR2FineTuning):
    """The task with Lightning's own clipping (``torch.nn.utils.clip_grad_norm_``), the reference."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        L.LightningModule.configure_gradient_clipping(self, optimizer, gradient_clip_val, gradient_clip_algorithm)


class Calls:
    """Counts the fused norm passes and the fused multiplies over the gradients while it is entered."""

    def __init__(self, monkeypatch) -> None:
        self.norms = self.multiplies = 0
        norm, multiply = torch._foreach_norm, torch._foreach_mul_

        def counted_norm(*args, **kwargs):
            self.norms += 1
            return norm(*args, **kwargs)

        def counted_multiply(*args, **kwargs):
            self.multiplies += 1
            return multiply(*args, **kwargs)

        monkeypatch.setattr(torch, "_foreach_norm", counted_norm)
        monkeypatch.setattr(torch, "_foreach_mul_", counted_multiply)


def fit(task_class: type, clip: float | None, monkeypatch) -> tuple[dict, list[float], Calls]:
    """``STEPS`` steps of a tiny MoE NLVR2 task on four fixed batches; its weights, each step's gradient norm before
    clipping, and the fused norm and multiply calls of the fit."""
    torch.manual_seed(0)
    backbone = MultiwayConfig.preset("test", vocab_size=120, moe=MoEPlan(num_experts=4, every=1))
    optimizer = OptimizerConfig(learning_rate=3e-3, warmup_steps=0, total_steps=STEPS)
    task = task_class(backbone=backbone, optimizer=optimizer)
    norms: list[float] = []

    class RecordNorm(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

    batches = [nlvr2_batch(seed) for seed in range(4)]
    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=clip,
                        callbacks=[NonFiniteGuard(), RecordNorm()])  # fmt: skip
    calls = Calls(monkeypatch)
    trainer.fit(task, loader)
    monkeypatch.undo()
    return {name: value.detach().clone() for name, value in task.state_dict().items()}, norms, calls


def test_a_fit_with_clipping_ends_with_lightnings_weights_bit_for_bit_in_one_norm_pass_a_step(monkeypatch):
    _, norms, _ = fit(LightningClipping, None, monkeypatch)
    clip = statistics.median(norms)  # about half the steps clipped
    reference, reference_norms, reference_calls = fit(LightningClipping, clip, monkeypatch)
    weights, _, calls = fit(NLVR2FineTuning, clip, monkeypatch)
    clipped = sum(norm > clip for norm in reference_norms)
    assert 0 < clipped < STEPS, reference_norms
    assert weights.keys() == reference.keys()
    assert all(torch.equal(weights[name], reference[name]) for name in reference)
    assert reference_calls.norms == 2 * STEPS and calls.norms == STEPS  # the guard's pass and the clipping's, or one
    assert reference_calls.multiplies - calls.multiplies == STEPS - clipped  # no multiply by one
    unclipped, _, _ = fit(NLVR2FineTuning, None, monkeypatch)
    assert not all(torch.equal(unclipped[name], reference[name]) for name in reference)  # the clipping did act
