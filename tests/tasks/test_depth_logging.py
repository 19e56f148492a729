"""The image patches' depth (Mixture-of-Depths) in the routing logger: the mean and the histogram of the layers a
patch ran, per window, equal to a recount of the backbone outputs, in TensorBoard and in ``routing_stats.json``; a
MoD backbone with dense FFNs logs it too."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing import event_accumulator
from torch.utils.data import DataLoader, TensorDataset

from mmoe.model import DepthRouting, MoEPlan, MultiwayConfig, MultiwayTransformer
from mmoe.runtime.depth_logging import mean_depth
from mmoe.runtime.routing_callback import RoutingStatsCallback
from mmoe.runtime.routing_logging import metric_key_bound

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

STEPS, EVERY = 4, 2


class DepthTask(L.LightningModule):
    """The training tasks' contract over a depth-routed test backbone; keeps every batch's patch depths."""

    def __init__(self, moe: MoEPlan | None) -> None:
        super().__init__()
        routing = DepthRouting(capacity=0.3, every=1)
        config = MultiwayConfig.preset("test", vocab_size=100, image_size=64, depth_routing=routing, moe=moe)
        self.backbone = MultiwayTransformer(config)
        self.depths: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        image, text = batch
        out = self.backbone(image=image, text=text)
        self.depths.append(out.image_depth[:, 1:].detach().clone())
        return {"loss": out.hidden.square().mean(), "routing": out.routing}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def fit(root: Path, moe: MoEPlan | None) -> DepthTask:
    torch.manual_seed(0)
    train = TensorDataset(torch.randn(STEPS * 3, 3, 64, 64), torch.randint(0, 100, (STEPS * 3, 6)))
    callback = RoutingStatsCallback(every_n_steps=EVERY, save_dir=root, tier="detailed", map_images=0)
    trainer = L.Trainer(
        max_steps=STEPS,
        logger=TensorBoardLogger(root, name="tb", version=0),
        callbacks=[callback],
        log_every_n_steps=EVERY,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    task = DepthTask(moe)
    trainer.fit(task, DataLoader(train, batch_size=3))
    return task


@pytest.mark.parametrize("moe", [None, MoEPlan(num_experts=4, router="linear", every=2)], ids=["dense", "moe"])
def test_patch_depths_are_logged_per_window_as_recounted(tmp_path, moe):
    task = fit(tmp_path, moe)
    depth = task.backbone.config.depth
    windows = json.loads((tmp_path / "routing_stats.json").read_text())["windows"]
    assert len(windows) == STEPS // EVERY
    sizes = {event_accumulator.HISTOGRAMS: 0, event_accumulator.SCALARS: 0}
    events = event_accumulator.EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance=sizes)
    events.Reload()
    scalars = events.Scalars("routing/patch_depth")
    histograms = events.Histograms("routing/patch_depth")
    assert len(scalars) == len(histograms) == len(windows)
    for index, window in enumerate(windows):
        recount = torch.cat(task.depths[index * EVERY : (index + 1) * EVERY]).reshape(-1)
        expected = torch.bincount(recount, minlength=depth + 1)
        assert window["patch_depth"] == expected.tolist()
        # Capacity 0.3 in every layer: a patch runs from 0 to every layer, and some skip some.
        assert 0 < expected[:depth].sum() and expected.sum() == recount.numel()
        assert scalars[index].value == pytest.approx(float(recount.double().mean()), rel=1e-6)
        assert mean_depth(expected) == pytest.approx(float(recount.double().mean()))
        assert np.asarray(histograms[index].histogram_value.bucket).tolist() == expected.tolist()
    assert bool(windows[0]["loads"]) == (moe is not None)  # MoE loads beside the depths where there are experts
    tags = events.Tags()
    logged = [tag for kind in ("scalars", "histograms", "images") for tag in tags[kind] if tag.startswith("routing/")]
    bound = metric_key_bound(len(windows[0]["loads"]), "detailed", depth_routed=True)
    # The bound, but for the sub-token maps (no held-out images here); a dense backbone logs the depth's two alone.
    assert len(logged) == (bound - 1 if moe is not None else 2)
