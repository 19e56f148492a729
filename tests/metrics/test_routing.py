"""Routing-analysis metrics against hand-made cases and direct NumPy references; router-input hooks; the callback."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from mmoe.metrics.routing import (
    DEFAULT_ACTIVATION_THRESHOLD,
    RoutingTotals,
    activation_ratio,
    activation_ratio_curve,
    choice_activation_ratio,
    image_diversity_maps,
    inter_run_consistency,
    load_summary,
    representation_collapse,
    routing_fluctuation,
    subtoken_diversity,
    text_diversity,
)
from mmoe.metrics.routing_collect import RouterInputs, moe_layers_by_key, run_routing
from mmoe.metrics.routing_stats import read_stats
from mmoe.model import MoEPlan, MultiwayConfig, MultiwayTransformer
from mmoe.runtime.routing_callback import RoutingStatsCallback
from tests.routing_fixtures import record, tiny_config

# -- sub-token assignment diversity ----------------------------------------------------------------------------------


def test_subtoken_diversity_counts_distinct_experts_of_the_heads():
    # (B=1, L=4, heads=4, top_k=2); first choices in [..., 0], second in [..., 1]
    first = torch.tensor([[[0, 0, 0, 0], [0, 1, 2, 3], [1, 3, 1, 3], [-1, -1, -1, -1]]])
    second = torch.tensor([[[1, 1, 1, 1], [1, 0, 3, 2], [0, 0, 0, 0], [-1, -1, -1, -1]]])
    index = torch.stack([first, second], dim=-1)
    assert subtoken_diversity(index).tolist() == [[1, 4, 2, 0]]
    assert subtoken_diversity(index, choices="all", num_experts=4).tolist() == [[2, 4, 3, 0]]
    # A dropped sub-token choice (-1) is ignored, not counted as an expert.
    index[0, 0, 1, 0] = -1
    assert subtoken_diversity(index)[0, 0] == 1


def test_image_diversity_map_follows_patch_order_and_skips_cls():
    # image_len = 1 + 4 patches (2 x 2 grid) + 2 text tokens in a shared record; heads = 2, top_k = 1.
    heads_choices = [
        [3, 3],  # CLS: ignored
        [0, 1],  # patch (0, 0): 2 experts
        [2, 2],  # patch (0, 1): 1
        [1, 1],  # patch (1, 0): 1
        [0, 3],  # patch (1, 1): 2
        [0, 1],  # text token 0: 2
        [-1, -1],  # text padding: 0
    ]
    index = torch.tensor(heads_choices)[None, :, :, None]
    maps = image_diversity_maps([record(index, 4, layer=3, modality="shared")], image_len=5)
    assert list(maps) == ["layer3/shared"]
    assert maps["layer3/shared"].tolist() == [[[2, 1], [1, 2]]]
    assert text_diversity([record(index, 4, layer=3, modality="shared")], image_len=5)["layer3/shared"].tolist() == [
        [2, 0]
    ]
    language = record(torch.tensor([[[0, 1], [2, 2]]])[..., None], 4, layer=1, modality="language")
    assert image_diversity_maps([language], image_len=5) == {}
    assert text_diversity([language], image_len=0)["layer1/language"].tolist() == [[2, 1]]


# -- activation ratio and load -------------------------------------------------------------------------------------


def _activation_reference(counts: np.ndarray, tokens: float | None, threshold: float) -> float:
    """MH-MoE Fig. 1a: an expert's selections over the number of tokens, activated at or above threshold / E; with
    tokens None, its share of the choices."""
    frequency = counts / (counts.sum() if tokens is None else tokens)
    return float(np.mean([f >= threshold / counts.size for f in frequency]))


@pytest.mark.parametrize("threshold", [0.0, 0.1, 0.5, 1.0, 1.7])
def test_activation_ratio_matches_numpy_reference(threshold):
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 50, size=(5, 16))
    counts[:, :3] = 0  # dead experts
    counts[1, 5] = 10_000  # one dominant expert
    tokens = counts.sum(-1) / 4.0  # four choices per token, e.g. h = 4 sub-tokens, top-1
    got = activation_ratio(torch.from_numpy(counts), torch.from_numpy(tokens), threshold)
    want = [_activation_reference(row, n, threshold) for row, n in zip(counts, tokens, strict=True)]
    np.testing.assert_allclose(got.numpy(), want)
    curve = activation_ratio_curve(torch.from_numpy(counts), torch.from_numpy(tokens), [0.0, threshold])
    np.testing.assert_allclose(curve[1].numpy(), want)
    assert torch.all(curve[0] == 1.0)
    by_choice = [_activation_reference(row, None, threshold) for row in counts]
    np.testing.assert_allclose(choice_activation_ratio(torch.from_numpy(counts), threshold).numpy(), by_choice)
    np.testing.assert_allclose(activation_ratio_curve(torch.from_numpy(counts), None, [threshold])[0], by_choice)


def test_activation_ratio_counts_per_token_so_more_choices_per_token_activate_more_experts():
    """MH-MoE's h·k factor: the same share of choices over a quarter as many tokens (h = 4) passes more experts."""
    counts = torch.tensor([400, 300, 200, 60, 30, 10, 0, 0])  # 1,000 choices over 8 experts; threshold 0.5 / 8
    assert float(choice_activation_ratio(counts, 0.5)) == 3 / 8  # shares >= 6.25%: 40, 30, 20 %
    assert float(activation_ratio(counts, 1000, 0.5)) == 3 / 8  # top-1, one head: one choice per token
    assert float(activation_ratio(counts, 250, 0.5)) == 5 / 8  # four choices per token: 30 / 250 >= 1 / 16 too


def test_activation_ratio_default_threshold_separates_dead_experts():
    # 400 tokens, one choice each, over 4 experts: uniform share 100, default threshold 0.1 -> 10 selections
    assert DEFAULT_ACTIVATION_THRESHOLD == 0.1
    assert float(activation_ratio(torch.tensor([190, 190, 10, 10]), 400)) == 1.0  # exactly at the threshold counts
    assert float(activation_ratio(torch.tensor([191, 190, 10, 9]), 400)) == 3 / 4
    counts = torch.tensor([191, 190, 10, 9])
    assert float(activation_ratio(torch.zeros(8, dtype=torch.long), 0)) == 0.0
    with pytest.raises(ValueError, match="threshold"):
        activation_ratio(counts, 400, -0.1)


def test_load_summary():
    counts = torch.tensor([2, 2, 4, 0])
    summary = load_summary(counts)
    assert float(summary["load_min"]) == 0.0
    assert float(summary["load_max"]) == pytest.approx(4 / 8 * 4)
    assert float(summary["load_cv"]) == pytest.approx(np.std([2, 2, 4, 0]) / 2)


# -- representation collapse (X-MoE Eq. 11) ------------------------------------------------------------------------


def _rc_reference(hidden: np.ndarray, classes: np.ndarray) -> float:
    labels = sorted(set(classes.tolist()))
    global_mean = hidden.mean(0)
    dim = hidden.shape[1]
    within, between = np.zeros((dim, dim)), np.zeros((dim, dim))
    for label in labels:
        rows = hidden[classes == label]
        mean = rows.mean(0)
        within += sum(np.outer(r - mean, r - mean) for r in rows) / len(rows)
        between += np.outer(mean - global_mean, mean - global_mean)
    within /= len(labels)
    between /= len(labels)
    return float(np.trace(within @ np.linalg.pinv(between)))


@pytest.mark.parametrize(("rows", "dim", "num_classes"), [(200, 4, 8), (120, 6, 3), (50, 10, 2)])
def test_representation_collapse_matches_numpy_reference(rows, dim, num_classes):
    rng = np.random.default_rng(rows)
    classes = rng.integers(0, num_classes, rows)
    centers = rng.normal(size=(num_classes, dim)) * 2
    hidden = centers[classes] + rng.normal(size=(rows, dim)) * rng.uniform(0.2, 1.0, size=dim)
    got = representation_collapse(torch.from_numpy(hidden).float(), torch.from_numpy(classes))
    assert got == pytest.approx(_rc_reference(hidden.astype(np.float32).astype(np.float64), classes), rel=1e-6)


def test_representation_collapse_shrinks_as_classes_collapse():
    rng = np.random.default_rng(1)
    classes = torch.from_numpy(rng.integers(0, 4, 400))
    centers = torch.from_numpy(rng.normal(size=(4, 8)) * 3)
    noise = torch.from_numpy(rng.normal(size=(400, 8)))
    for label in range(4):  # zero-mean noise per class: the class means stay the centers, so Σ_B is fixed
        noise[classes == label] -= noise[classes == label].mean(0)
    spread = [representation_collapse(centers[classes] + scale * noise, classes) for scale in (1.0, 0.5, 0.1)]
    assert spread[0] > spread[1] > spread[2] > 0
    assert spread[1] == pytest.approx(spread[0] / 4, rel=1e-9)  # RC is quadratic in the within-class spread
    # Scaling all representations changes nothing (Σ_W and Σ_B scale alike).
    scaled = representation_collapse(5 * (centers[classes] + noise), classes)
    assert scaled == pytest.approx(spread[0], rel=1e-9)
    assert math.isnan(representation_collapse(noise, torch.zeros(400, dtype=torch.long)))


# -- fluctuation and inter-run consistency (X-MoE §4.5) ------------------------------------------------------------


def test_routing_fluctuation_on_hand_made_assignments():
    a = torch.tensor([[0, 1, 2, 3, -1], [1, 1, 1, 1, -1]])
    b = torch.tensor([[0, 1, 3, 3, -1], [1, 2, 1, -1, 0]])
    # comparable positions: 4 + 3 = 7 (padding / drops excluded); changed: (0, 2) and (1, 1)
    assert routing_fluctuation(a, b) == pytest.approx(2 / 7)
    assert routing_fluctuation(a, a) == 0.0
    assert math.isnan(routing_fluctuation(torch.full((3,), -1), torch.full((3,), -1)))


def test_inter_run_consistency_on_hand_made_loads():
    assert inter_run_consistency([[1, 2, 3, 4], [2, 4, 6, 8], [11, 12, 13, 14]]) == pytest.approx(1.0)
    # ρ = -1 between the two runs: (1 + 1 - 1 - 1) / 4
    assert inter_run_consistency([[1, 2, 3, 4], [4, 3, 2, 1]]) == pytest.approx(0.0)
    assert inter_run_consistency([[5, 1, 1, 1]]) == pytest.approx(1.0)
    loads = np.random.default_rng(0).integers(0, 100, size=(5, 8))
    assert inter_run_consistency(torch.from_numpy(loads)) == pytest.approx(np.corrcoef(loads).mean())
    assert math.isnan(inter_run_consistency([[1, 2, 3], [7, 7, 7]]))


# -- collecting from a backbone --------------------------------------------------------------------------------------


def _batches(count: int = 2, seed: int = 0) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        padding = torch.zeros(3, 6, dtype=torch.bool)
        padding[0, 4:] = True
        out.append(
            {
                "image": torch.randn(3, 3, 32, 32, generator=generator),
                "text": torch.randint(0, 1000, (3, 6), generator=generator),
                "text_padding_mask": padding,
            }
        )
    return out


def test_router_input_hooks_agree_with_the_records():
    torch.manual_seed(0)
    backbone = MultiwayTransformer(tiny_config(moe=MoEPlan(num_experts=4, heads=2, every=1)))
    batch = _batches(1)[0]
    backbone.eval()
    with RouterInputs(backbone) as recorder, torch.no_grad():
        records = backbone(**batch).routing
    assert list(recorder.captures) == ["layer0/vision", "layer0/language", "layer1/vision", "layer1/language"]
    for rec in records:
        hidden, top1 = recorder.captures[f"layer{rec.layer}/{rec.modality}"].tensors()
        expected = rec.expert_index[..., 0].reshape(-1)
        expected = expected[expected >= 0]  # padding sub-tokens are not captured
        assert torch.equal(top1, expected)
        assert hidden.shape == (expected.numel(), 32 // 2)  # sub-tokens of D / heads


def test_run_routing_totals_and_stratified_requested_capacity():
    torch.manual_seed(0)
    plan = MoEPlan(num_experts=4, top_k=2, strata=[2, 2], every=1)
    backbone = MultiwayTransformer(tiny_config(moe=plan))
    run = run_routing(backbone, _batches(2), capture_inputs=True)
    summary = run.totals.summary()
    assert set(summary) == set(moe_layers_by_key(backbone))
    for stats in summary.values():
        assert 1.0 <= stats["requested_capacity"] <= 2.0
    assert any(stats["requested_capacity"] > 1.0 for stats in summary.values())
    image_tokens = 2 * 3 * 17  # batches * batch * (CLS + 16 patches)
    # Every token passes the first gate; later gates add passes, each counting its two choices.
    counts = run.totals.counts["layer0/vision"]
    rc = summary["layer0/vision"]["requested_capacity"]
    assert int(counts.sum()) == pytest.approx(2 * image_tokens * rc)
    assert run.router_inputs["layer0/vision"][0].shape == (image_tokens, 32)


def test_routing_totals_weight_by_tokens():
    first = record(torch.tensor([[[0], [1]]])[..., None].squeeze(-1), 2)
    first.expert_index = torch.tensor([[[[0]], [[1]]]])  # (1, 2, 1, 1)
    first.router_entropy = torch.tensor(1.0)
    second = record(torch.tensor([[[[1]], [[1]], [[1]], [[-1]]]]), 2)  # 3 tokens, one padding
    second.router_entropy = torch.tensor(0.0)
    totals = RoutingTotals()
    totals.add([first, second])
    assert totals.counts["layer0/vision"].tolist() == [1, 4]
    assert totals.summary()["layer0/vision"]["entropy"] == pytest.approx(2 / 5)
    assert totals.tokens() == {"layer0/vision": 5.0}  # 2 + 3, the padding left out


# -- the Lightning callback ----------------------------------------------------------------------------------------


class TinyRoutingTask(L.LightningModule):
    """Returns the contract of the training tasks: ``{"loss": ..., "routing": [detached records]}``."""

    def __init__(self) -> None:
        super().__init__()
        plan = MoEPlan(num_experts=4, heads=2, every=1)
        config = MultiwayConfig.preset("test", num_heads=2, vocab_size=100, moe=plan)
        self.backbone = MultiwayTransformer(config)
        self.seen_counts: dict[str, torch.Tensor] = {}

    def training_step(self, batch, batch_idx):
        image, text = batch
        out = self.backbone(image=image, text=text)
        loss = out.hidden.square().mean() + 0.01 * sum(r.balance_loss for r in out.routing)
        for rec in out.routing:
            key = f"layer{rec.layer}/{rec.modality}"
            self.seen_counts[key] = self.seen_counts.get(key, 0) + rec.expert_counts
        return {"loss": loss, "routing": out.routing}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(tmp_path, callback, steps: int = 4, reduce_factor: int | None = None) -> tuple[L.Trainer, TinyRoutingTask]:
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(steps * 2, 3, 32, 32), torch.randint(0, 100, (steps * 2, 5)))
    trainer = L.Trainer(
        max_steps=steps,
        logger=CSVLogger(tmp_path, name="logs"),
        callbacks=[callback],
        log_every_n_steps=2,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    if reduce_factor is not None:  # stand-in for DDP: every rank saw the same counts
        trainer.strategy.reduce = lambda tensor, group=None, reduce_op="mean": tensor * reduce_factor
    task = TinyRoutingTask()
    trainer.fit(task, DataLoader(data, batch_size=2))
    return trainer, task


def test_callback_logs_expected_keys_to_csv_and_saves_loads(tmp_path):
    callback = RoutingStatsCallback(every_n_steps=2, save_dir=tmp_path / "stats")
    trainer, task = _fit(tmp_path, callback)
    with open(f"{trainer.logger.log_dir}/metrics.csv") as stream:
        rows = list(csv.DictReader(stream))
    logged = [row for row in rows if row.get("routing/activation_ratio")]
    assert [int(row["step"]) for row in logged] == [1, 3]  # every 2 batches
    for key in ("layer0/vision", "layer0/language", "layer1/vision", "layer1/language"):
        for name in ("activation_ratio", "entropy", "load_min", "load_max", "load_cv", "dropped_fraction"):
            value = float(logged[-1][f"routing/{key}/{name}"])
            assert math.isfinite(value)
        assert float(logged[-1][f"routing/{key}/requested_capacity"]) == 1.0
        assert 0.0 <= float(logged[-1][f"routing/{key}/activation_ratio"]) <= 1.0
    stats = read_stats(tmp_path / "stats")
    assert len(stats["windows"]) == 2 and stats["activation_threshold"] == DEFAULT_ACTIVATION_THRESHOLD
    assert stats["total_loads"] == {key: counts.tolist() for key, counts in task.seen_counts.items()}
    # 4 batches of 2 samples: 2 * 4 = 8 images of 1 + 4 tokens, 8 texts of 5 tokens; h = 2 sub-tokens each
    tokens = {"vision": 8 * 5, "language": 8 * 5}
    assert stats["total_tokens"] == {key: float(tokens[key.partition("/")[2]]) for key in stats["total_loads"]}
    assert all(sum(loads) == 2 * stats["total_tokens"][key] for key, loads in stats["total_loads"].items())
    last = stats["windows"][-1]
    for key, window_tokens in last["tokens"].items():
        want = activation_ratio(torch.tensor(last["loads"][key]), window_tokens)
        assert last["stats"][key]["activation_ratio"] == pytest.approx(float(want))
    assert [p.name for p in (tmp_path / "stats").iterdir()] == ["routing_stats.json"]  # no temporary left


def test_callback_reduces_counts_across_ranks_before_logging(tmp_path):
    callback = RoutingStatsCallback(every_n_steps=2, save_dir=tmp_path / "stats")
    _, task = _fit(tmp_path, callback, reduce_factor=2)
    stats = json.loads((tmp_path / "stats" / "routing_stats.json").read_text())
    assert stats["total_loads"] == {key: (2 * counts).tolist() for key, counts in task.seen_counts.items()}


def test_callback_rejects_bad_arguments():
    with pytest.raises(ValueError, match="every_n_steps"):
        RoutingStatsCallback(every_n_steps=0)
    with pytest.raises(ValueError, match="activation_threshold"):
        RoutingStatsCallback(activation_threshold=-1)


DDP_SCRIPT = """
import json, sys
import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset
from lightning.pytorch.loggers import CSVLogger
from mmoe.runtime.routing_callback import RoutingStatsCallback
from tests.metrics.test_routing import TinyRoutingTask

if __name__ == "__main__":
    out = sys.argv[1]
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(16, 3, 32, 32), torch.randint(0, 100, (16, 5)))
    trainer = L.Trainer(
        max_steps=4, accelerator="cpu", devices=2, strategy="ddp_find_unused_parameters_true",
        logger=CSVLogger(out, name="logs"), callbacks=[RoutingStatsCallback(every_n_steps=2, save_dir=out)],
        log_every_n_steps=2, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    task = TinyRoutingTask()
    trainer.fit(task, DataLoader(data, batch_size=2))
    seen = {key: counts.tolist() for key, counts in task.seen_counts.items()}
    with open(f"{out}/seen{trainer.global_rank}.json", "w") as stream:
        json.dump(seen, stream)
"""


@pytest.mark.slow
def test_callback_sums_counts_over_two_ddp_processes(tmp_path):
    script = tmp_path / "ddp_routing.py"
    script.write_text(DDP_SCRIPT)
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    seen = [json.loads((tmp_path / f"seen{rank}.json").read_text()) for rank in (0, 1)]
    assert seen[0] != seen[1]  # each rank routed its own share of the data
    stats = read_stats(tmp_path)
    assert stats["total_loads"] == {
        key: [a + b for a, b in zip(seen[0][key], seen[1][key], strict=True)] for key in seen[0]
    }


def test_a_routing_statistics_file_that_is_not_one_is_refused_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="RoutingStatsCallback writes it"):
        read_stats(tmp_path)
    path = tmp_path / "routing_stats.json"
    path.write_text('{"format": "mmoe-routing-stats", "total_loads"')  # cut off mid-write
    with pytest.raises(ValueError, match=r"routing statistics file .*routing_stats.json: malformed JSON at line 1"):
        read_stats(tmp_path)
    path.write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match="is not a routing statistics file"):
        read_stats(path)
