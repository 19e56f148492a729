"""Loss-free balancing in training (Wang et al., 2024, Algorithm 1): the biases after a few optimiser steps equal the
hand computation from the steps' routing records, with gradient accumulation and no balance loss, and are logged and
checkpointed; biases that overflow stop the run before the step is saved."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from mmoe.model import MoEPlan, MultiwayConfig
from mmoe.runtime.non_finite import NonFiniteGuard, NonFiniteTraining
from mmoe.runtime.selection_bias import SelectionLoads
from mmoe.tasks.pretraining import MaskedPretraining
from tests.tasks.test_pretraining import BACKBONE, codebook_path, make_batches  # noqa: F401 (fixture)


class RecordLoads(L.Callback):
    """The expert counts of every micro-batch's routing records, keyed by (layer, modality)."""

    def __init__(self) -> None:
        self.batches: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batches.append({(r.layer, r.modality): r.expert_counts.clone() for r in outputs["routing"]})


def hand_step(load: torch.Tensor, rule: str) -> torch.Tensor:
    """One step's bias move per unit rate: the sign of each expert's load error (Wang et al., 2024) or its z-score
    (MoE-ViE), the loads' spread their root mean squared deviation."""
    error = load.mean() - load
    if rule == "sign":
        return torch.sign(error)
    spread = float(((load - load.mean()) ** 2).mean()) ** 0.5
    return error / spread if spread else torch.zeros_like(error)


@pytest.mark.parametrize("rule", ["sign", "z_score"])
def test_biases_follow_each_steps_load_error_by_the_update_rule(codebook_path, tmp_path, rule):  # noqa: F811
    torch.manual_seed(0)
    rate = 0.01
    plan = MoEPlan(num_experts=4, top_k=2, every=1, bias_update_rate=rate, bias_update_rule=rule)
    config = MultiwayConfig(**BACKBONE, moe=plan)
    task = MaskedPretraining(config, codebook_path, balance_coefficient=0.0)
    recorder = RecordLoads()
    trainer = L.Trainer(
        max_steps=3, accumulate_grad_batches=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", default_root_dir=tmp_path, callbacks=[recorder],
    )  # fmt: skip
    trainer.fit(task, DataLoader(make_batches(6), batch_size=None, shuffle=False))
    assert len(recorder.batches) == 6

    biases = {}
    for slot in task.backbone.moe_layers():
        key = (slot.index, slot.modality)
        expected = torch.zeros(4)
        for step in range(3):  # two micro-batches per optimiser step
            load = sum(
                batch.get(key, torch.zeros(4, dtype=torch.long)) for batch in recorder.batches[2 * step : 2 * step + 2]
            )
            expected += rate * hand_step(load.float(), rule)
        biases[key] = slot.layer.router.selection_bias
        torch.testing.assert_close(biases[key], expected, msg=str(key))
    assert any(bias.abs().sum() > 0 for bias in biases.values())
    spread = torch.stack([bias.max() - bias.min() for bias in biases.values()]).mean()
    torch.testing.assert_close(trainer.callback_metrics["train/selection_bias_spread"], spread)
    state = task.state_dict()
    torch.testing.assert_close(state["backbone.layers.0.ffn.0.router.selection_bias"], biases[(0, "vision")])


def test_shared_mode_with_a_vl_ffn_is_refused():
    from mmoe.model import MultiwayTransformer

    plan = MoEPlan(num_experts=4, every=1, mode="shared", bias_update_rate=0.01)
    backbone = MultiwayTransformer(MultiwayConfig.preset("test", moe=plan, vl_layers=1))
    with pytest.raises(ValueError, match="not told apart"):
        SelectionLoads(backbone)


def test_non_finite_biases_stop_the_run_before_that_step_is_saved(codebook_path, tmp_path):  # noqa: F811
    """A finite but huge rate: the biases reach +-inf within a few steps (and then NaN) while the loss stays finite."""
    torch.manual_seed(0)
    config = MultiwayConfig(**BACKBONE, moe=MoEPlan(num_experts=4, top_k=2, every=1, bias_update_rate=1e308))
    task = MaskedPretraining(config, codebook_path, balance_coefficient=0.0)
    checkpoints = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    trainer = L.Trainer(
        max_steps=6, logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
        default_root_dir=tmp_path, callbacks=[checkpoints, NonFiniteGuard(action="skip")],
    )  # fmt: skip
    with pytest.raises(NonFiniteTraining) as error:
        trainer.fit(task, DataLoader(make_batches(6), batch_size=None, shuffle=False))
    message = str(error.value)
    step = trainer.global_step - 1
    assert message.startswith(f"non-finite router selection biases after step {step} in MoE layer ")
    assert "\n" not in message and "model.backbone.moe.bias_update_rate" in message
    broken = [slot for slot in task.backbone.moe_layers() if not slot.layer.router.selection_bias.isfinite().all()]
    assert broken and all(f"MoE layer {slot.index} ({slot.modality})" in message for slot in broken)
    saved = sorted(tmp_path.glob("step=*.ckpt"))
    assert [path.name for path in saved] == [f"step={n}.ckpt" for n in range(1, step + 1)]  # not the broken step
    for path in saved:
        state = torch.load(path, weights_only=True)["state_dict"]
        assert all(value.isfinite().all() for key, value in state.items() if key.endswith("selection_bias"))
