"""End to end: `mmoe fit` with the tiny pre-training configs on synthetic shards (slow)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml

from mmoe.cli import main
from mmoe.data.datamodules import PretrainDataModule
from mmoe.model import MultiwayConfig
from mmoe.runtime.checkpoint import load_backbone
from mmoe.tasks.pretraining import MaskedPretraining, codes_in_loader, vqkd_codes
from tests.cli_fixtures import tiny_pretraining
from tests.model.vqkd_reference import released_state, save_released

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]


def tiny_config(variant: str, corpus: Path, out: Path, steps: int) -> Path:
    """The repo's tiny config, pointed at the test corpus and shrunk to 32-px images and a short run."""
    config = tiny_pretraining(variant)
    shards = corpus / "shards"
    trainer = config["trainer"]
    trainer.update(
        max_steps=steps,
        val_check_interval=steps,
        limit_val_batches=1,
        log_every_n_steps=1,
        default_root_dir=str(out),
        enable_progress_bar=False,
        accelerator="cpu",
    )
    trainer["logger"] = [
        {
            "class_path": "lightning.pytorch.loggers.CSVLogger",
            "init_args": {"save_dir": str(out), "name": "csv", "version": 0},
        }
    ]
    for callback in trainer["callbacks"]:  # their folders follow default_root_dir
        if callback["class_path"].endswith("RoutingStatsCallback"):
            callback["init_args"]["every_n_steps"] = 10
    model = config["model"]["init_args"]
    model["backbone"].update(image_size=32, dim=64, num_heads=4, ffn_dim=128)
    model.update(visual_codebook=str(corpus / "codebook.pt"))
    model["optimizer"].update(learning_rate=2e-3, warmup_steps=5)
    data = config["data"]["init_args"]
    data.update(
        image_shards=str(shards / "pretrain-images"),
        text_shards=str(shards / "pretrain-text"),
        pair_shards=str(shards / "pretrain-pairs"),
        val_pair_shards=str(shards / "pretrain-pairs"),
        image_size=32,
        batch_size=8,
        num_workers=0,
        batches_per_epoch=steps,
    )
    path = out / f"tiny_{variant}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def read_metrics(out: Path) -> list[dict]:
    with open(out / "csv" / "version_0" / "metrics.csv") as handle:
        return list(csv.DictReader(handle))


def column(rows: list[dict], name: str) -> list[float]:
    return [float(row[name]) for row in rows if row.get(name)]


def test_tiny_xmoe_loss_falls(synthetic_corpus, tmp_path):
    config = tiny_config("xmoe", synthetic_corpus, tmp_path, steps=40)
    assert main(["fit", "--config", str(config)]) == 0
    rows = read_metrics(tmp_path)
    loss = column(rows, "train/loss")
    assert len(loss) == 40 and all(value == value for value in loss)  # no NaN
    first, last = sum(loss[:5]) / 5, sum(loss[-5:]) / 5
    assert last < 0.85 * first, (first, last)
    for name in ("train/image_ppl", "train/text_ppl", "train/pair_ppl", "train/balance_loss"):
        assert column(rows, name), name
    assert any(key.startswith("routing/layer1/vision/activation_ratio") for key in rows[0])
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    assert json.loads((tmp_path / "routing_stats.json").read_text())["windows"]

    # The checkpoint restores the routing exactly, and its backbone exports for fine-tuning.
    checkpoint = tmp_path / "checkpoints" / "last.ckpt"
    restored = MaskedPretraining.load_from_checkpoint(checkpoint, map_location="cpu").eval()
    assert main(["export-backbone", "--ckpt", str(checkpoint), "--out", str(tmp_path / "backbone.pt")]) == 0
    exported = load_backbone(tmp_path / "backbone.pt").eval()
    image, text = torch.randn(2, 3, 32, 32), torch.randint(0, 1000, (2, 8))
    with torch.no_grad():
        first = restored.backbone(image=image, text=text)
        second = exported(image=image, text=text)
    torch.testing.assert_close(first.hidden, second.hidden)
    for a, b in zip(first.routing, second.routing, strict=True):
        assert torch.equal(a.expert_index, b.expert_index)
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]
    for name, value in restored.state_dict().items():
        if "router" in name:
            assert torch.equal(value, state[name]), name


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_tiny_xmoe_trains_in_bf16_with_its_gradient_clipping(synthetic_corpus, tmp_path, precision):
    """The shipped configs clip gradients: under bf16-mixed the optimiser must not be torch's fused AdamW (Lightning
    refuses to clip its gradients), and under bf16-true the codebook's bf16 centroids still encode float32 patches."""
    config = tiny_config("xmoe", synthetic_corpus, tmp_path, steps=3)
    assert yaml.safe_load(config.read_text())["trainer"]["gradient_clip_val"] > 0
    assert main(["fit", "--config", str(config), "--trainer.precision", precision]) == 0
    loss = column(read_metrics(tmp_path), "train/loss")
    assert len(loss) == 3 and all(torch.isfinite(torch.tensor(loss)))


def test_tiny_dense_with_vqkd_targets_mim_loss_falls(synthetic_corpus, tmp_path, capsys):
    """BEiT-3's targets: a VQ-KD tokenizer file in the released layout (random weights, 64 codes) in place of the
    k-means codebook, its codes computed by the loader's worker (a CPU run with one); the MIM loss falls and its
    perplexity is logged."""
    tokenizer = save_released(tmp_path / "vqkd.pth", released_state(dim=64, depth=1, mlp=128, grid=2, codes=64))
    config_path = tiny_config("dense", synthetic_corpus, tmp_path, steps=40)
    config = yaml.safe_load(config_path.read_text())
    config["model"]["init_args"].update(visual_codebook=None, vqkd_tokenizer=str(tokenizer))
    config["data"]["init_args"]["num_workers"] = 1
    config_path.write_text(yaml.safe_dump(config))
    assert main(["fit", "--config", str(config_path)]) == 0
    assert "model.vqkd_tokenizer" in capsys.readouterr().err
    rows = read_metrics(tmp_path)
    loss = column(rows, "train/image_loss")
    assert len(loss) == 40 and all(value == value for value in loss)
    first, last = sum(loss[:5]) / 5, sum(loss[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    assert column(rows, "train/image_ppl")[-1] < 64


def test_a_cpu_run_with_workers_computes_the_vqkd_codes_in_the_loader(synthetic_corpus, tmp_path):
    tokenizer = save_released(tmp_path / "vqkd.pth", released_state(dim=64, depth=1, mlp=128, grid=2, codes=64))
    shards = synthetic_corpus / "shards"
    data_args = dict(image_shards=str(shards / "pretrain-images"), text_shards=str(shards / "pretrain-text"),
                     pair_shards=str(shards / "pretrain-pairs"), image_size=32, batch_size=4, joint=True,
                     batches_per_epoch=2)  # fmt: skip
    workers, no_workers = PretrainDataModule(**data_args, num_workers=1), PretrainDataModule(**data_args, num_workers=0)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert codes_in_loader(cpu, workers) and not codes_in_loader(cuda, workers) and not codes_in_loader(cpu, no_workers)
    task = MaskedPretraining(MultiwayConfig.preset("test"), vqkd_tokenizer=str(tokenizer))
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(task, workers)
    assert workers.image_targets is not None
    batch = next(iter(workers.train_dataloader()))["image"]
    assert torch.equal(batch["image_targets"], vqkd_codes(task._vqkd[0], batch["image"]))


def test_missing_shard_directory_fails_before_training(synthetic_corpus, tmp_path, capsys):
    config_path = tiny_config("dense", synthetic_corpus, tmp_path, steps=2)
    config = yaml.safe_load(config_path.read_text())
    config["data"]["init_args"]["text_shards"] = str(tmp_path / "nowhere")
    config_path.write_text(yaml.safe_dump(config))
    with pytest.raises((SystemExit, FileNotFoundError, ValueError)) as error:
        main(["fit", "--config", str(config_path)])
    message = str(error.value) + capsys.readouterr().err
    assert "nowhere" in message
    assert not (tmp_path / "csv" / "version_0" / "metrics.csv").exists()


def test_two_process_ddp(synthetic_corpus, tmp_path):
    script = ROOT / "tests" / "scripts" / "ddp_pretrain.py"
    shards = synthetic_corpus / "shards" / "pretrain-pairs"
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path), str(synthetic_corpus / "codebook.pt"), str(shards)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    keys = [set(rank["keys"]) for rank in ranks]
    assert keys[0] and keys[1] and not keys[0] & keys[1]  # disjoint data
    assert ranks[0]["checksum"] == ranks[1]["checksum"]  # identical weights after the steps
    stats = json.loads((tmp_path / "routing_stats.json").read_text())
    for name, load in stats["total_loads"].items():  # the logged loads are the sum over both ranks
        assert load == [a + b for a, b in zip(ranks[0]["counts"][name], ranks[1]["counts"][name], strict=True)]
