"""``mmoe demo`` on the routers beyond top-1 token choice (fine-grained, shared experts, loss-free bias, expert
choice): their stages, their pre-training config, and the routing figures the demo draws of them."""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest
import torch
import yaml

from mmoe.cli import main
from mmoe.config.run_spec import read_spec
from mmoe.demo.command import parse
from mmoe.demo.recipe import variant_stages
from mmoe.model import MoEPlan, MultiwayTransformer
from mmoe.model.config import config_from_dict
from mmoe.moe.router import Router
from mmoe.pipeline import CONFIGS, VARIANTS, PipelineRun, finetune_spec, pretrain_spec
from mmoe.pipeline.settings import DEMO_FAST as FAST
from mmoe.runtime.checkpoint import export_backbone
from mmoe.runtime.layout import RunLayout
from mmoe.tasks.captioning import CaptioningFineTuning
from mmoe.tasks.vqa import VQAFineTuning
from tests.routing_fixtures import image_dir, shard, tiny_config, tiny_part_plan
from tests.viz.test_viz import differ

ROUTER_VARIANTS = ("fine_grained", "shared_experts", "loss_free", "expert_choice", "limoe", "moma", "deepseek")


@pytest.mark.parametrize("variant", ROUTER_VARIANTS)
def test_a_router_variant_runs_every_stage_of_the_demo_on_its_tiny_part(tmp_path, variant):
    assert parse(["--variant", variant]).variant == variant and variant in VARIANTS  # so also in --variant all
    run = PipelineRun(tmp_path, FAST)
    reference = [str(stage.key).split("/", 1)[1] for stage in variant_stages(run, "mhmoe")]
    stages = variant_stages(run, variant)
    assert [str(stage.key) for stage in stages] == [f"{variant}/{name}" for name in reference]
    assert stages[-1].output.parent == tmp_path / "figures" / variant

    config = read_spec(pretrain_spec(run, variant, run.pretraining(variant), FAST.pretrain_steps))
    part = yaml.safe_load((CONFIGS / "pretrain" / "tiny" / f"{variant}.yaml").read_text())
    moe = config.model.init_args.backbone.moe
    for field, value in part["model"]["init_args"]["backbone"]["moe"].items():
        assert getattr(moe, field) == value, field
    assert config.trainer.default_root_dir == str(run.pretraining(variant).root)


def checkpoint(path, plan: MoEPlan, seed: int, selection_bias: float | None = None):
    """A tiny backbone with the variant's MoE plan (every layer an MoE layer); ``selection_bias``: the loss-free bias
    of expert 0 (the other experts' stay 0)."""
    torch.manual_seed(seed)
    backbone = MultiwayTransformer(tiny_config(plan))
    if selection_bias is not None:
        for router in (module for module in backbone.modules() if isinstance(module, Router)):
            router.selection_bias[0] = selection_bias
    path.parent.mkdir(parents=True, exist_ok=True)
    export_backbone(backbone, path)
    return path


def test_captioning_of_an_expert_choice_backbone_is_fine_tuned_under_dropless_token_choice(tmp_path):
    """Captioning refuses expert choice (its text is causal): the demo fine-tunes it from the expert-choice backbone
    under dropless token choice, the backbone's weights loaded unchanged; the other tasks keep its routing."""
    run = PipelineRun(tmp_path, FAST)
    backbone = checkpoint(tmp_path / "backbone.pt", tiny_part_plan("expert_choice"), 0)
    spec = finetune_spec(run, CaptioningFineTuning, {}, backbone, RunLayout(tmp_path / "captioning"), 10)
    config = spec.model.backbone
    assert (config["moe"]["routing"], config["moe"]["capacity_factor"]) == ("token_choice", None)
    assert read_spec(spec).model.init_args.backbone.moe.routing == "token_choice"  # as mmoe fit parses it
    task = CaptioningFineTuning(backbone=config_from_dict(config), pretrained=str(backbone))
    exported = torch.load(backbone, weights_only=True)["state_dict"]
    assert all(torch.equal(task.backbone.state_dict()[name], exported[name]) for name in exported)
    vqa = finetune_spec(run, VQAFineTuning, {}, backbone, RunLayout(tmp_path / "vqa"), 10)
    assert vqa.model.backbone is None and read_spec(vqa).model.init_args.backbone is None


def draw(out, checkpoints, images, data) -> set[str]:
    """The demo's figures (the sub-token maps of two checkpoints, the load heatmap) of ``checkpoints``."""
    argv = ["viz", "subtoken-map", *(f"--ckpt={path}" for path in checkpoints), "--images", str(images)]
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert main([*argv, "--out", str(out), "--num-images", "2"]) == 0
        written = json.loads(printed.getvalue())["written"]
    heatmap = ["viz", "heatmap", "--ckpt", str(checkpoints[0]), "--data", str(data), "--out", str(out)]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([*heatmap, "--batches", "2", "--batch-size", "4"]) == 0
    assert all(path.stat().st_size > 1000 for path in out.glob("*.png"))
    return {*map(str, written), *(str(path) for path in out.glob("heatmap_*.png"))}


@pytest.mark.parametrize("variant", ROUTER_VARIANTS)
def test_the_demo_draws_the_routing_figures_of_a_router_variant(tmp_path, variant):
    """The variant's own plan (its expert count, top-k, width, shared experts, bias, expert choice) in every layer of a
    tiny backbone: both checkpoints get maps; a loss-free bias on expert 0 changes the loads drawn."""
    plan = tiny_part_plan(variant)
    images, data = image_dir(tmp_path / "images"), shard(tmp_path / "shards" / "data-000000.tar", count=8)
    pair = [checkpoint(tmp_path / name / "backbone.pt", plan, seed) for seed, name in enumerate(("pre", "fine"))]
    written = draw(tmp_path / "figures", pair, images, data)
    names = {path.rsplit("/", 1)[1] for path in written}
    assert {"subtoken_map_pre-backbone.png", "subtoken_map_fine-backbone.png", "heatmap_backbone.png"} <= names
    if variant == "loss_free":
        biased = checkpoint(tmp_path / "biased" / "backbone.pt", plan, 0, selection_bias=10.0)
        draw(tmp_path / "biased_figures", [biased, pair[1]], images, data)
        for figure in ("heatmap_backbone.png", "loads_backbone.png"):
            assert differ(tmp_path / "figures" / figure, tmp_path / "biased_figures" / figure)


def test_the_router_balance_script_reads_its_table_from_the_run_files(tmp_path):
    """``scripts/router_balance.py``: load CV and busiest expert of the last routing window, the last logged values."""
    import importlib.util

    from mmoe.metrics.routing_stats import STATS_FORMAT

    path = CONFIGS.parents[1] / "scripts" / "router_balance.py"
    spec = importlib.util.spec_from_file_location("router_balance", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    run = PipelineRun(tmp_path, FAST)
    layout = run.pretraining("expert_choice")
    layout.csv_logs.joinpath("version_0").mkdir(parents=True)
    early, late = (
        {"layer1/vision": [9, 1, 5, 5], "layer3/vision": [5, 5, 5, 5]},
        {"layer1/vision": [8, 2, 6, 4], "layer3/vision": [4, 4, 6, 6]},
    )
    windows = [{"step": 50, "loads": early}, {"step": 80, "loads": late}]
    stats = {"format": STATS_FORMAT, "num_experts": {key: 4 for key in late}, "total_loads": early, "windows": windows}
    (layout.root / "routing_stats.json").write_text(json.dumps(stats))
    rows = ["step,train/loss,train/unrouted_fraction", "9,10.5,0.25", "19,,", "79,9.5,0.125", "80,,"]
    (layout.csv_logs / "version_0" / "metrics.csv").write_text("\n".join(rows) + "\n")
    row = script.balance_row(run, "expert_choice")
    cv = [np.std(loads) / np.mean(loads) for loads in late.values()]
    assert row["window step"] == 80 and row["MoE layers"] == 2
    assert row["load CV mean"] == pytest.approx(np.mean(cv)) and row["load CV worst"] == pytest.approx(max(cv))
    assert row["busiest / mean"] == pytest.approx(8 / 5)
    assert (row["unrouted (%)"], row["loss"], row["bias spread"]) == (pytest.approx(12.5), 9.5, None)
    printed = script.table([row]).splitlines()
    assert printed[0].startswith("| variant | window step |") and printed[2].startswith("| expert_choice | 80 | 2 |")
