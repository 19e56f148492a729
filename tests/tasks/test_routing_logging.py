"""Routing statistics in the training logger (mmoe.runtime.routing_logging through RoutingStatsCallback): TensorBoard's
event files read back with TensorBoard's own reader and checked against a recount of the routing records; the
bound on metric keys at 32 experts; CSV-only and logger-free runs; W&B in offline mode where wandb is installed."""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import time
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
import yaml
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from PIL import Image
from tensorboard.backend.event_processing import event_accumulator
from torch.utils.data import DataLoader, TensorDataset

from mmoe.metrics.routing import image_diversity_maps, record_key
from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer
from mmoe.routing.render import HEATMAP_TOP, colour, diversity_grid, joined, load_heatmap, utilisation
from mmoe.runtime.routing_callback import RoutingStatsCallback
from mmoe.runtime.routing_logging import LAYER_SCALARS, TILE_SIDE, first_images, image_pixels, metric_key_bound
from mmoe.viz.plots import activation_heatmap_figure

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

STEPS, EVERY, HELD_OUT = 4, 2, 3


class RoutingTask(L.LightningModule):
    """The training tasks' contract (``{"loss", "routing"}``) over a test backbone, and a validation loop."""

    def __init__(self, plan: MoEPlan) -> None:
        super().__init__()
        self.backbone = MultiwayTransformer(MultiwayConfig.preset("test", vocab_size=100, moe=plan))

    def training_step(self, batch, batch_idx):
        image, text = batch
        out = self.backbone(image=image, text=text)
        loss = out.hidden.square().mean() + 0.01 * sum(r.balance_loss for r in out.routing)
        return {"loss": loss, "routing": out.routing}

    def validation_step(self, batch, batch_idx):
        self.backbone(image=batch["image"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Recount(L.Callback):
    """The records of every training batch, summed per window of ``EVERY`` batches by key: the reference."""

    def __init__(self) -> None:
        self.windows: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx % EVERY == 0:
            self.windows.append({})
        window = self.windows[-1]
        for record in outputs["routing"]:
            key = record_key(record)
            window[key] = window.get(key, 0) + record.expert_counts.detach().clone()


def fit(root: Path, logger, tier: str = "detailed", experts: int = 8) -> tuple[RoutingTask, Recount, torch.Tensor]:
    torch.manual_seed(0)
    train = TensorDataset(torch.randn(STEPS * 4, 3, 32, 32), torch.randint(0, 100, (STEPS * 4, 6)))
    held_out = torch.randn(5, 3, 32, 32)
    validation = DataLoader([{"image": image} for image in held_out], batch_size=4)
    recount = Recount()
    callback = RoutingStatsCallback(every_n_steps=EVERY, save_dir=root, tier=tier, map_images=HELD_OUT)
    trainer = L.Trainer(
        max_steps=STEPS, logger=logger, callbacks=[callback, recount], log_every_n_steps=EVERY,
        val_check_interval=STEPS, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", devices=1,
    )  # fmt: skip
    task = RoutingTask(MoEPlan(num_experts=experts, heads=2, every=1))
    trainer.fit(task, DataLoader(train, batch_size=4), validation)
    return task, recount, held_out


def read_events(folder: Path) -> event_accumulator.EventAccumulator:
    sizes = {event_accumulator.IMAGES: 0, event_accumulator.HISTOGRAMS: 0, event_accumulator.SCALARS: 0}
    events = event_accumulator.EventAccumulator(str(folder), size_guidance=sizes)
    events.Reload()
    return events


def decoded(event) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(event.encoded_image_string)).convert("RGB"))


def test_tensorboard_gets_images_and_histograms_that_match_a_recount(tmp_path):
    task, recount, held_out = fit(tmp_path, TensorBoardLogger(tmp_path, name="tb", version=0))
    events = read_events(tmp_path / "tb" / "version_0")
    windows = json.loads((tmp_path / "routing_stats.json").read_text())["windows"]
    steps = [window["step"] for window in windows]
    assert steps == [2, 4] and len(recount.windows) == 2
    keys = list(recount.windows[0])
    assert keys == ["layer0/vision", "layer0/language", "layer1/vision", "layer1/language"]

    assert sorted(events.Tags()["images"]) == ["routing/load_heatmap", "routing/subtoken_maps"]
    for window, reference, image in zip(windows, recount.windows, events.Images("routing/load_heatmap"), strict=True):
        assert image.step == window["step"]
        # two panels (vision, language) of 2 layers x 8 experts, 16-px cells, an 8-px gap
        assert (image.width, image.height) == (2 * 8 * 16 + 8, 2 * 16)
        pixels = decoded(image)
        for key, counts in reference.items():
            layer, modality = int(key[5]), key.partition("/")[2]
            left = 0 if modality == "vision" else 8 * 16 + 8
            cells = pixels[layer * 16 + 8, left + 8 : left + 8 * 16 : 16]  # each cell's centre
            want = utilisation(counts.numpy())
            assert np.array_equal(cells, colour(want, HEATMAP_TOP)), key
    # the pixels mmoe viz shows for the same loads: its figure's panels, joined as the logger's image
    figure = activation_heatmap_figure({key: counts.clone() for key, counts in recount.windows[-1].items()})
    shown = [ax.get_images()[0].get_array() for ax in figure.axes if ax.get_images()]
    assert len(shown) == 2 and np.array_equal(decoded(image), joined(shown, gap=8, axis=1))
    for key in keys:
        histograms = events.Histograms(f"routing/{key}/expert_load")
        assert [h.step for h in histograms] == steps
        for histogram, reference in zip(histograms, recount.windows, strict=True):
            assert histogram.histogram_value.bucket == reference[key].tolist()
            assert histogram.histogram_value.bucket_limit == [e + 0.5 for e in range(8)]
        shares = events.Histograms(f"routing/{key}/utilisation")
        assert [sum(h.histogram_value.bucket) for h in shares] == [8, 8]  # one value per expert

    maps = events.Images("routing/subtoken_maps")
    assert [m.step for m in maps] == steps
    # HELD_OUT rows x (the image + 2 vision layers), 32-px tiles, 2-px gaps
    assert (maps[0].width, maps[0].height) == (3 * 32 + 2 * 2, HELD_OUT * 32 + (HELD_OUT - 1) * 2)
    task.backbone.eval()
    with torch.no_grad():
        output = task.backbone(image=held_out[:HELD_OUT])
    grid = {k: v.numpy() for k, v in image_diversity_maps(output.routing, output.image_len).items()}
    pixels = image_pixels(held_out[:HELD_OUT], TILE_SIDE)
    assert np.array_equal(decoded(maps[-1]), diversity_grid(pixels, grid, max_count=2))

    scalars = {tag for tag in events.Tags()["scalars"] if tag.startswith("routing/")}
    last = recount.windows[-1]["layer1/vision"]
    dead = events.Scalars("routing/layer1/vision/dead_experts")
    assert [s.step for s in dead] == [step - 1 for step in steps]  # Lightning's logging step: one lower
    assert dead[-1].value == float((last == 0).sum())
    busiest = events.Scalars("routing/layer1/vision/busiest_share")[-1].value
    assert busiest == pytest.approx(float(last.max() / last.sum()))
    assert len(scalars) == len(LAYER_SCALARS) * len(keys) + 1


@pytest.mark.parametrize("tier", ["brief", "detailed"])
def test_the_number_of_keys_does_not_grow_with_32_experts(tmp_path, tier):
    fit(tmp_path, TensorBoardLogger(tmp_path, name="tb", version=0), tier=tier, experts=32)
    tags = read_events(tmp_path / "tb" / "version_0").Tags()
    logged = [tag for kind in ("scalars", "images", "histograms") for tag in tags[kind] if tag.startswith("routing/")]
    assert len(logged) == metric_key_bound(4, tier) == (63 if tier == "detailed" else 50)  # < one per expert: 4 * 32
    assert sorted(tags["images"]) == (
        ["routing/load_heatmap", "routing/subtoken_maps"] if tier == "detailed" else ["routing/load_heatmap"]
    )
    assert bool(tags["histograms"]) == (tier == "detailed")


def test_a_csv_logger_gets_the_brief_scalars_and_no_logger_logs_nothing(tmp_path):
    _, recount, _ = fit(tmp_path / "csv", CSVLogger(tmp_path / "csv", name="logs", version=0))
    with open(tmp_path / "csv" / "logs" / "version_0" / "metrics.csv") as stream:
        rows = [row for row in csv.DictReader(stream) if row.get("routing/activation_ratio")]
    assert [int(row["step"]) for row in rows] == [1, 3]
    counts = recount.windows[-1]["layer0/language"]
    assert float(rows[-1]["routing/layer0/language/dead_experts"]) == float((counts == 0).sum())
    assert {name for name in rows[0] if name.startswith("routing/layer0/vision/")} == {
        f"routing/layer0/vision/{name}" for name in LAYER_SCALARS
    }
    fit(tmp_path / "none", logger=False)  # nothing to log to: the routing statistics file still comes
    assert json.loads((tmp_path / "none" / "routing_stats.json").read_text())["windows"]


def test_held_out_images_are_the_first_of_the_first_validation_batch():
    images = torch.randn(4, 3, 8, 8)
    assert torch.equal(first_images({"image": images, "text": torch.zeros(4, 3)}, 2), images[:2])
    assert torch.equal(first_images({"text": {}, "pair": {"image": images}}, 3), images[:3])  # a joint batch
    assert first_images({"text": torch.zeros(4, 3)}, 2) is None
    assert first_images((images,), 2) is None


def test_the_heatmap_draws_each_layer_as_a_row_of_experts_and_greys_what_it_lacks():
    loads = {"layer0/vision": np.array([4, 0, 2, 2]), "layer2/vision": np.array([0, 0, 0, 0]), "layer2/shared": [1, 1]}
    pixels = load_heatmap(loads, list(loads))
    cell = 16
    assert pixels.shape == (2 * cell, 4 * cell + cell // 2 + 4 * cell, 3)
    assert np.array_equal(pixels[cell // 2, cell // 2 :: cell][:4], colour(np.array([2.0, 0.0, 1.0, 1.0]), 2.0))
    assert np.array_equal(pixels[cell + 1, 1], [128, 128, 128])  # a layer without tokens
    right = 4 * cell + cell // 2
    assert np.array_equal(pixels[1, right + 2 * cell + 1], [128, 128, 128])  # a 2-expert layer's missing experts
    assert np.array_equal(pixels[cell + 1, right + 1], [128, 128, 128])  # the shared panel's second row: no layer


def test_bad_arguments_are_refused_naming_them():
    with pytest.raises(ValueError, match="tier must be one of"):
        RoutingStatsCallback(tier="verbose")
    with pytest.raises(ValueError, match="map_images"):
        RoutingStatsCallback(map_images=-1)


def wandb_history(run: Path) -> list[dict]:
    """The history rows of an offline W&B run, read from its ``run-*.wandb`` file: a LevelDB-style log (7-byte
    header, 32 KiB blocks of chunks, each with a 7-byte header: checksum, length, type) of ``Record`` protobufs."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run.glob("run-*.wandb")
    data, position, chunk, rows = path.read_bytes(), 7, b"", []
    while position + 7 <= len(data):
        if 32768 - position % 32768 < 7:  # a block's tail too short for a header is padding
            position += 32768 - position % 32768
            continue
        length, kind = int.from_bytes(data[position + 4 : position + 6], "little"), data[position + 6]
        chunk += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items})
    return rows


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed (the mmoe[wandb] extra)")
def test_wandb_offline_run_holds_the_images_and_histograms(tmp_path, monkeypatch):
    import wandb
    from lightning.pytorch.loggers import WandbLogger

    for name, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(name, value)
    logger = WandbLogger(project="mmoe-test", save_dir=str(tmp_path), offline=True)
    _, recount, _ = fit(tmp_path, logger)
    wandb.finish()
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    media = run / "files" / "media" / "images" / "routing"
    heatmaps = sorted(media.glob("load_heatmap_*.png"), key=lambda p: int(p.name.split("_")[2]))
    assert len(heatmaps) == 2 and len(list(media.glob("subtoken_maps_*.png"))) == 2
    last = {key: counts.numpy() for key, counts in recount.windows[-1].items()}
    assert np.array_equal(np.asarray(Image.open(heatmaps[-1]).convert("RGB")), load_heatmap(last, list(last)))
    histogram, scalar = "routing/layer0/vision/expert_load/values", "routing/layer1/language/dead_experts"
    deadline = time.monotonic() + 120  # the W&B service may still be writing the run's file after finish()
    while True:
        history = wandb_history(run)
        rows = [row for row in history if histogram in row]
        dead = [row[scalar] for row in history if scalar in row]
        if len(rows) == len(dead) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert [row["trainer/global_step"] for row in rows] == [2, 4]
    for row, window in zip(rows, recount.windows, strict=True):
        assert row[histogram] == window["layer0/vision"].tolist()
        assert row["routing/layer0/vision/expert_load/bins"] == [e - 0.5 for e in range(9)]
    assert dead[-1] == float((recount.windows[-1]["layer1/language"] == 0).sum())


DOC = Path(__file__).resolve().parents[2] / "docs" / "routing_logging.md"


def test_the_documented_wandb_preset_parses_over_the_tiny_config(tmp_path, monkeypatch):
    from mmoe.config.launch import read_config

    text = DOC.read_text()
    snippet = next(body for body in text.split("```yaml\n")[1:] if "WandbLogger" in body.split("```", 1)[0])
    snippet = snippet.split("```", 1)[0]
    preset = tmp_path / "wandb.yaml"
    preset.write_text(snippet)
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    config = read_config([root / "configs/pretrain/tiny.yaml", root / "configs/pretrain/tiny/xmoe.yaml", preset])
    loggers = yaml.safe_load(snippet)["trainer"]["logger"]
    assert [logger["class_path"] for logger in config.fit.trainer.logger] == [
        logger["class_path"] for logger in loggers
    ]


@pytest.mark.slow
def test_mmoe_fit_writes_the_detailed_tier_to_its_run_folders_tensorboard(synthetic_corpus, tmp_path):
    from mmoe.cli import main
    from tests.tasks.test_pretraining_run import tiny_config

    path = tiny_config("mhmoe", synthetic_corpus, tmp_path, steps=4)
    config = yaml.safe_load(path.read_text())
    del config["trainer"]["logger"]  # the run folder's own: tensorboard/ and csv/
    for callback in config["trainer"]["callbacks"]:
        if callback["class_path"].endswith("RoutingStatsCallback"):
            callback["init_args"].update(every_n_steps=2, tier="detailed", map_images=2)
    path.write_text(yaml.safe_dump(config))
    assert main(["fit", "--config", str(path)]) == 0
    (folder,) = {event.parent for event in (tmp_path / "tensorboard").rglob("events.out.tfevents.*")}
    events = read_events(folder)
    windows = json.loads((tmp_path / "routing_stats.json").read_text())["windows"]
    assert [image.step for image in events.Images("routing/subtoken_maps")] == [w["step"] for w in windows] == [2, 4]
    maps = events.Images("routing/subtoken_maps")[-1]
    assert (maps.width, maps.height) == (3 * 32 + 2 * 2, 2 * 32 + 2)  # 2 pair images x (image + 2 vision layers)
    for key, loads in windows[-1]["loads"].items():
        assert events.Histograms(f"routing/{key}/expert_load")[-1].histogram_value.bucket == loads
