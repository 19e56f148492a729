"""``mmoe study claims``: each claim's verdict on hand-made measurements, the object-patch test on rendered scenes,
backbone snapshots (fast), and the whole study at ``--fast`` with its report recomputed from the saved statistics
(slow)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from mmoe.cli import main
from mmoe.data.synth.scenes import Scene, Shape, render
from mmoe.metrics.routing import activation_ratio, inter_run_consistency, representation_collapse
from mmoe.metrics.routing_collect import run_routing
from mmoe.metrics.routing_stats import read_stats, window_loads
from mmoe.study import claims_from
from mmoe.study.claims import (
    NOT_REPRODUCED,
    NOT_SEPARATED,
    REPRODUCES,
    activation_claim,
    collapse_claim,
    consistency_claim,
    diversity_claim,
    fluctuation_claim,
    tasks_claim,
)
from mmoe.study.measures import held_out_batches, inputs, object_patches
from mmoe.study.report import write_report
from mmoe.study.runs import Measures
from mmoe.tasks.checkpoint import load_backbone

# -- claims on hand-made measurements --------------------------------------------------------------------------------


def test_activation_claim_counts_selections_per_token():
    """32 experts; X-MoE sends its 100 tokens to 2 experts, MH-MoE h=4's 400 sub-tokens spread over all 32."""
    few = [50, 50] + [0] * 30
    spread = [12] * 16 + [13] * 16
    activation = {
        "xmoe": {"heads": 1, "loads": {"layer1/vision": few}, "tokens": {"layer1/vision": 100.0}},
        "mhmoe-h4": {"heads": 4, "loads": {"layer1/vision": spread}, "tokens": {"layer1/vision": 100.0}},
    }
    claim = activation_claim(activation)
    assert claim.measured["runs"]["xmoe"]["mean"] == pytest.approx(2 / 32)
    assert claim.measured["runs"]["mhmoe-h4"]["mean"] == pytest.approx(1.0)
    assert claim.verdict == REPRODUCES
    reversed_runs = {"xmoe": activation["mhmoe-h4"] | {"heads": 1}, "mhmoe-h4": activation["xmoe"] | {"heads": 4}}
    assert activation_claim(reversed_runs).verdict == NOT_REPRODUCED


def test_diversity_claim_compares_object_and_background_means():
    region = {"object_sum": 30.0, "object_patches": 10, "background_sum": 20.0, "background_patches": 20}
    claim = diversity_claim({"mhmoe": {"layer1/vision": region, "layer3/vision": region}})
    assert claim.measured["runs"]["mhmoe"]["object_mean"] == pytest.approx(3.0)
    assert claim.measured["runs"]["mhmoe"]["background_mean"] == pytest.approx(1.0)
    assert claim.verdict == REPRODUCES
    flat = region | {"object_sum": 10.0}
    assert diversity_claim({"mhmoe": {"layer1/vision": flat}}).verdict == NOT_REPRODUCED


def _snapshot(step, rc, fluctuation):
    overall = None if fluctuation is None else {"layer1/vision": fluctuation, "overall": fluctuation}
    return {"step": step, "representation_collapse": {"layer1/vision": rc, "layer1/language": None},
            "fluctuation": overall}  # fmt: skip


def test_collapse_and_fluctuation_claims_from_snapshots():
    snapshots = {
        "switch": [_snapshot(0, 5.0, None), _snapshot(10, 4.0, 0.5), _snapshot(20, 3.0, 0.4), _snapshot(30, 2.0, 0.3)],
        "xmoe": [_snapshot(0, 5.0, None), _snapshot(10, 6.0, 0.3), _snapshot(20, 7.0, 0.1), _snapshot(30, 8.0, 0.1)],
    }
    collapse = collapse_claim(snapshots)
    assert collapse.measured["final"] == {"switch": 2.0, "xmoe": 8.0} and collapse.verdict == REPRODUCES
    assert collapse.measured["curves"]["xmoe"]["steps"] == [0, 10, 20, 30]
    fluctuation = fluctuation_claim(snapshots)
    assert fluctuation.measured["second_half_mean"] == pytest.approx({"switch": 0.35, "xmoe": 0.1})
    assert fluctuation.verdict == REPRODUCES
    swapped = {"switch": snapshots["xmoe"], "xmoe": snapshots["switch"]}
    assert collapse_claim(swapped).verdict == fluctuation_claim(swapped).verdict == NOT_REPRODUCED


def test_consistency_claim_uses_the_second_half_of_the_windows():
    def result(values):
        return {"steps": [10 * (i + 1) for i in range(len(values))], "windows": [{"mean": v} for v in values]}

    claim = consistency_claim({"switch": result([0.1, 0.2, 0.3, 0.2]), "xmoe": result([0.1, 0.5, 0.9, 0.95])})
    assert claim.measured["second_half_mean"] == pytest.approx({"switch": 0.25, "xmoe": 0.925})
    assert claim.verdict == REPRODUCES


def _scores(vqa, nlvr2, cider):
    return {"vqav2": [{"overall": v} for v in vqa], "nlvr2": [{"accuracy": v} for v in nlvr2],
            "captioning": [{"CIDEr": v} for v in cider]}  # fmt: skip


def test_tasks_claim_separates_only_beyond_the_seed_spread():
    scores = {
        "dense": _scores([40.0], [0.50], [0.30, 0.31]),
        "switch": _scores([41.0, 43.0, 45.0], [0.50], [0.30]),  # VQA seed std 2.0
        "xmoe": _scores([45.0], [0.55], [0.40]),
        "mhmoe": _scores([50.0], [0.60], [0.35]),
        "stratified": _scores([44.0], [0.50], [0.30]),
    }
    claim = tasks_claim(scores)
    tasks = claim.measured["tasks"]
    assert claim.measured["scores"]["switch"]["vqav2"]["std"] == pytest.approx(2.0)
    assert tasks["vqav2"]["verdict"] == REPRODUCES  # gaps 5 and 5 > 2
    assert tasks["nlvr2"]["verdict"] == NOT_SEPARATED  # one seed everywhere: the noise is unknown
    assert tasks["nlvr2"]["seed_noise"] is None and tasks["nlvr2"]["order_as_paper"]
    assert tasks["captioning"]["verdict"] == NOT_REPRODUCED  # MH-MoE below X-MoE by more than the 0.007 spread
    assert claim.verdict == NOT_REPRODUCED
    assert "one seed each; means in the paper's order" in claim.summary
    close = scores | {"mhmoe": _scores([46.0], [0.60], [0.45])}  # 46 - 45 < 2: within the spread
    assert tasks_claim(close).measured["tasks"]["vqav2"]["verdict"] == NOT_SEPARATED


def test_object_patches_follow_the_rendered_shapes():
    square = Shape("square", "blue", "striped", "large", "middle", 0.5)
    pixels = np.asarray(render(Scene((square,), (60, 60, 60)), size=64))
    mask = object_patches(pixels, 16)
    assert mask.shape == (4, 4)
    assert mask[1:3, 1:3].all() and not mask[0].any() and not mask[3].any()
    empty = np.asarray(render(Scene((), (60, 68, 52)), size=64))
    assert not object_patches(empty, 16).any()


def test_backbone_snapshots_write_loadable_backbones_at_their_steps(tmp_path):
    import lightning as L

    from mmoe.model import MultiwayConfig
    from mmoe.tasks.snapshots import BackboneSnapshots
    from tests.routing_fixtures import make_checkpoint

    backbone = load_backbone(make_checkpoint(tmp_path / "a.pt"))

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.backbone = backbone

        def training_step(self, batch, batch_idx):
            return self.backbone(image=batch[0]).hidden.mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    size = backbone.config.image_size
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(5, 3, size, size)), batch_size=1)
    callback = BackboneSnapshots(tmp_path / "snapshots", every_n_steps=2)
    trainer = L.Trainer(max_steps=5, callbacks=[callback], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(Module(), data)
    names = sorted(path.name for path in (tmp_path / "snapshots").iterdir())
    assert names == ["step000000.pt", "step000002.pt", "step000004.pt"]
    first, last = (load_backbone(tmp_path / "snapshots" / name) for name in (names[0], names[-1]))
    assert isinstance(first.config, MultiwayConfig)
    pairs = zip(first.state_dict().values(), last.state_dict().values(), strict=True)
    assert any(not torch.equal(a, b) for a, b in pairs)
    with pytest.raises(ValueError, match="every_n_steps"):
        BackboneSnapshots(tmp_path, 0)


# -- the whole study -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fast_study(tmp_path_factory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("study") / "claims"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["study", "claims", "--fast", "--out", str(out)]) == 0
    yield out
    shutil.rmtree(out.parent)  # about 3 GB of checkpoints


@pytest.mark.slow
def test_fast_study_report_is_recomputed_from_its_saved_statistics(fast_study):
    out = fast_study
    report = json.loads((out / "report.json").read_text())
    measures = json.loads((out / "analysis" / "measures.json").read_text())
    assert report["claims"] == json.loads(
        json.dumps([claim.to_json() for claim in claims_from(Measures.from_json(measures))])
    )
    assert [claim["id"] for claim in report["claims"]] == [
        "activation", "diversity", "collapse", "fluctuation", "consistency", "tasks"
    ]  # fmt: skip
    markdown = (out / "report.md").read_text()
    assert "mmoe study claims --fast" in markdown
    for claim in report["claims"]:
        assert claim["verdict"] in (REPRODUCES, NOT_REPRODUCED, NOT_SEPARATED)
        assert claim["title"] in markdown and Path(report["figures"][claim["id"]]).stat().st_size > 0
    assert any((out / "figures" / "maps").glob("subtoken_map_*.png"))

    # claim 1: the paper's activation ratio of the saved loads and tokens, by hand
    for name, run in report["claims"][0]["measured"]["runs"].items():
        saved = measures["activation"][name]
        ratios = [float(activation_ratio(torch.tensor(saved["loads"][key]), saved["tokens"][key], 0.1))
                  for key in saved["loads"]]  # fmt: skip
        assert run["mean"] == pytest.approx(np.mean(ratios))
    assert {run["heads"] for run in measures["activation"].values()} == {1, 2, 8}

    # claim 4b: IC window by window from the seeds' own routing_stats.json
    for variant in ("switch", "xmoe"):
        runs = [window_loads(read_stats(out / "finetune" / variant / f"vqav2-seed{seed}")) for seed in (0, 1)]
        curve = report["claims"][4]["measured"]["curves"][variant]
        assert curve["steps"] == [step for step, _ in runs[0]]
        for position, ic in enumerate(curve["ic"]):
            keys = runs[0][position][1]
            values = [inter_run_consistency([run[position][1][key].tolist() for run in runs]) for key in keys]
            defined = [v for v in values if math.isfinite(v)]
            assert ic == (pytest.approx(np.mean(defined)) if defined else None)

    # claim 5: the scores are the evaluation files' own
    scores = report["claims"][5]["measured"]["scores"]
    for variant in ("dense", "switch", "xmoe", "mhmoe", "stratified"):
        vqa = json.loads((out / "finetune" / variant / "vqav2-seed0" / "scores.json").read_text())["overall"]
        assert scores[variant]["vqav2"]["values"][0] == pytest.approx(vqa)
    assert len(scores["switch"]["vqav2"]["values"]) == 2 and len(scores["dense"]["vqav2"]["values"]) == 1

    # claim 3: the last X-MoE snapshot's RC, recomputed from the snapshot file
    snapshots = sorted((out / "pretrain" / "xmoe" / "snapshots").glob("step*.pt"))
    assert [int(p.stem[4:]) for p in snapshots] == report["claims"][2]["measured"]["curves"]["xmoe"]["steps"]
    batches = held_out_batches(out / "data" / "shards" / "coco-karpathy-test", 64, 2, 16, 32)
    run = run_routing(load_backbone(snapshots[-1]), inputs(batches), capture_inputs=True, max_rows=500)
    saved = measures["snapshots"]["xmoe"][-1]["representation_collapse"]
    for key, (hidden, top1) in run.router_inputs.items():
        value = representation_collapse(hidden, top1)
        assert saved[key] == (pytest.approx(value, rel=1e-6) if math.isfinite(value) else None)


@pytest.mark.slow
def test_fast_study_reuses_its_stages_and_refuses_other_settings(fast_study, capsys):
    before = (fast_study / "report.json").stat().st_mtime_ns
    capsys.readouterr()
    assert main(["study", "claims", "--fast", "--out", str(fast_study)]) == 0
    printed = capsys.readouterr().out
    assert "reused" in printed and "] ...\n" not in printed  # no stage ran again
    assert (fast_study / "report.json").stat().st_mtime_ns >= before
    assert main(["study", "claims", "--out", str(fast_study)]) == 1
    assert "other settings" in capsys.readouterr().err


def test_a_report_of_hand_made_claims_is_written_whole(tmp_path):
    """The report from claims (Markdown, JSON, one figure per claim that has one) without training anything."""
    activation = {
        "xmoe": {"heads": 1, "loads": {"layer1/vision": [50, 50] + [0] * 30}, "tokens": {"layer1/vision": 100.0}},
        "mhmoe-h4": {"heads": 4, "loads": {"layer1/vision": [12] * 16 + [13] * 16}, "tokens": {"layer1/vision": 100.0}},
    }
    region = {"object_sum": 30.0, "object_patches": 10, "background_sum": 20.0, "background_patches": 20}
    snapshots = {name: [_snapshot(0, 5.0, None), _snapshot(10, 4.0, 0.5), _snapshot(20, 3.0, 0.4)]
                 for name in ("switch", "xmoe")}  # fmt: skip
    windows = {"steps": [10, 20], "windows": [{"mean": 0.1}, {"mean": 0.2}]}
    scores = {name: _scores([40.0, 42.0], [0.5], [0.3]) for name in ("dense", "switch", "xmoe", "mhmoe", "stratified")}
    claims = [
        activation_claim(activation),
        diversity_claim({"mhmoe": {"layer1/vision": region}}),
        collapse_claim(snapshots),
        fluctuation_claim(snapshots),
        consistency_claim({"switch": windows, "xmoe": windows}),
        tasks_claim(scores),
    ]
    chance = {"vqav2": 39.4, "nlvr2": 0.5, "captioning": 0.31}
    report = write_report(claims, tmp_path, "# header", {"command": "test"}, chance)
    assert report["claims"] == [claim.to_json() for claim in claims]
    assert json.loads((tmp_path / "report.json").read_text()) == json.loads(json.dumps(report))
    markdown = (tmp_path / "report.md").read_text()
    for number, claim in enumerate(claims, 1):
        assert f"## {number}. {claim.title}" in markdown and f"**Verdict: {claim.verdict}.**" in markdown
    assert report["figures"] and all(Path(path).stat().st_size > 0 for path in report["figures"].values())
