"""ReMoE's L1 coefficient in training (Wang et al., 2025): after each optimiser step, one model-wide move by
alpha^sign(S_target - S), S the step's share of zero gates over its micro-batches and layers, the same in every
router, saved in the checkpoint; the task adds the weighted penalty to its objective and logs it. With
``relu_l1_per_router`` each router moves by its own S."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from mmoe.model import MoEPlan, MultiwayConfig
from mmoe.tasks.pretraining import MaskedPretraining
from tests.tasks.test_pretraining import BACKBONE, codebook_path, make_batches  # noqa: F401 (fixture)


class RecordUse(L.Callback):
    """(used choices, non-padding tokens) of every micro-batch's routing records, keyed by (layer, modality)."""

    def __init__(self) -> None:
        self.batches: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        counts = {
            (r.layer, r.modality): (int(r.expert_counts.sum()), int(r.token_mask.sum())) for r in outputs["routing"]
        }
        self.batches.append(counts)


@pytest.mark.parametrize("per_router", [False, True])
def test_coefficient_moves_once_per_step_from_the_steps_sparsity(codebook_path, tmp_path, per_router):  # noqa: F811
    torch.manual_seed(0)
    initial, alpha, experts, top_k = 1e-3, 1.5, 4, 1
    plan = MoEPlan(
        num_experts=experts, top_k=top_k, every=1, router="linear", gate="relu", renormalize=False,
        relu_l1_initial=initial, relu_l1_multiplier=alpha, relu_l1_per_router=per_router,
    )  # fmt: skip
    task = MaskedPretraining(MultiwayConfig(**BACKBONE, moe=plan), codebook_path, balance_coefficient=0.0)
    closed = task.backbone.layers[0].ffn[0].router  # layer 0's image router: every gate ReLU(0) = 0, no gradient
    torch.nn.init.zeros_(closed.scorer.weight)
    recorder = RecordUse()
    quiet = dict.fromkeys(("logger", "enable_checkpointing", "enable_progress_bar", "enable_model_summary"), False)
    steps = dict(max_steps=3, accumulate_grad_batches=2)  # two micro-batches per optimiser step
    trainer = L.Trainer(**steps, **quiet, accelerator="cpu", default_root_dir=tmp_path, callbacks=[recorder])
    trainer.fit(task, DataLoader(make_batches(6), batch_size=None, shuffle=False))
    assert len(recorder.batches) == 6

    keys = sorted({key for batch in recorder.batches for key in batch})
    expected, moves = dict.fromkeys(keys, initial), []
    for step in range(3):  # two micro-batches per optimiser step
        micro = recorder.batches[2 * step : 2 * step + 2]
        sparsities = {}
        for key in {key for batch in micro for key in batch}:  # a micro-batch may hold one modality only
            used = sum(batch.get(key, (0, 0))[0] for batch in micro)
            tokens = sum(batch.get(key, (0, 0))[1] for batch in micro)
            sparsities[key] = 1 - used / (tokens * experts)
        if per_router:  # each router by its own sparsity; one unseen this step stays
            step_moves = {key: alpha if own < 1 - top_k / experts else 1 / alpha for key, own in sparsities.items()}
        else:
            sparsity = sum(sparsities.values()) / len(sparsities)
            step_moves = dict.fromkeys(keys, alpha if sparsity < 1 - top_k / experts else 1 / alpha)
        moves.extend(step_moves.values())
        expected = {key: value * step_moves.get(key, 1.0) for key, value in expected.items()}
    assert alpha in moves  # dense at the start: the coefficient rises
    routers = {(slot.index, slot.modality): slot.layer.router for slot in task.backbone.moe_layers()}
    assert len(routers) > 1 and set(keys) <= set(routers)
    for key in keys:
        torch.testing.assert_close(float(routers[key].relu_l1_coefficient), expected[key], rtol=1e-6, atol=0)
    if per_router:  # the closed router's lambda fell while the dense ones' rose: a model-wide one moves them alike
        assert expected[(0, "vision")] < initial < expected[(0, "language")]
    state = task.state_dict()
    torch.testing.assert_close(
        float(state["backbone.layers.0.ffn.0.router.relu_l1_coefficient"]), expected[(0, "vision")], rtol=1e-6, atol=0
    )
    assert "train/relu_l1_loss" in trainer.callback_metrics
