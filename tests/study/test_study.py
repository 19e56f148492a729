"""``mmoe study claims``: each claim's verdict on hand-made measurements, the object-patch test on rendered scenes,
backbone snapshots (fast), and the whole study at ``--fast`` with its report recomputed from the saved statistics
(slow)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import json
import math
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from mmoe.cli import main
from mmoe.data.synth.scenes import Scene, Shape, render
from mmoe.metrics.routing import (
    activation_ratio,
    choice_activation_ratio,
    inter_run_consistency,
    representation_collapse,
)
from mmoe.metrics.routing_collect import run_routing
from mmoe.metrics.routing_stats import read_stats, window_loads
from mmoe.runtime.checkpoint import load_backbone
from mmoe.study import claims_from
from mmoe.study.claims import (
    activation_claim,
    average_ranks,
    capacity_claim,
    collapse_claim,
    consistency_claim,
    diversity_claim,
    fluctuation_claim,
    frequency_claim,
    mean_correlation,
    pretraining_claim,
    spearman,
    tasks_claim,
)
from mmoe.study.decisions import NO_SEED_VALUES, run_decisions
from mmoe.study.measures import (
    RC_RESAMPLES,
    held_out_batches,
    inputs,
    object_patches,
    token_passes,
    training_token_counts,
)
from mmoe.study.plan import plan_from_json, plan_hash, read_plan, write_plan
from mmoe.study.plan_design import study_plan
from mmoe.study.report import write_report
from mmoe.study.run_statistics import UNDECIDABLE
from mmoe.study.runs import Measures
from mmoe.study.settings import DEFAULT, FAST
from mmoe.study.verdicts import (
    DESCRIPTIVE,
    NOT_RUN,
    NOT_SEPARATED,
    OPPOSITE,
    REPRODUCES,
    SATURATED,
    UNINFORMATIVE,
    VERDICTS,
)
from tests.study.test_shipped_report import differences

# -- claims on hand-made measurements --------------------------------------------------------------------------------

LANGUAGE, VISION = "layer1/language", "layer1/vision"
#: The rules of the second half of the snapshots the hand-made curves below are written for (the plan the shipped
#: report was made under).
HALF_WINDOW = read_plan(Path(__file__).resolve().parent / "data" / "plan_before_seeds.json")


def _activation_run(heads, language_batch, vision_batch, batches=6):
    """Per held-out batch, the same loads (32 experts) over 100 tokens."""
    return {
        "heads": heads,
        "loads": {LANGUAGE: [language_batch] * batches, VISION: [vision_batch] * batches},
        "tokens": {LANGUAGE: [100.0] * batches, VISION: [100.0] * batches},
    }


def test_activation_claim_judges_each_modality_in_both_views():
    """Language: X-MoE sends its tokens to 2 of 32 experts, MH-MoE h=4 spreads its sub-tokens over all 32 (both views
    rise). Vision: both spread over all 32 (saturated)."""
    few, spread = [50, 50] + [0] * 30, [12] * 16 + [13] * 16
    claim = activation_claim({"xmoe": _activation_run(1, few, spread), "mhmoe-h4": _activation_run(4, spread, spread)})
    language = claim.measured["by_modality"]["language"]
    assert language["runs"]["xmoe"]["per_token"] == pytest.approx(2 / 32)
    assert language["runs"]["mhmoe-h4"]["per_token"] == pytest.approx(1.0)
    assert language["runs"]["mhmoe-h4"]["share_of_choices"] == pytest.approx(1.0)
    assert language["verdict"] == REPRODUCES and claim.verdict == REPRODUCES
    assert claim.measured["by_modality"]["vision"]["verdict"] == SATURATED
    # a random router over 400 choices activates every expert: what no learning gives
    assert language["runs"]["mhmoe-h4"]["random_router"]["per_token"] == pytest.approx(1.0)
    reversed_runs = {"xmoe": _activation_run(1, spread, spread), "mhmoe-h4": _activation_run(4, few, spread)}
    assert activation_claim(reversed_runs).verdict == OPPOSITE


def test_activation_claim_does_not_count_the_built_in_per_token_rise():
    """MH-MoE h=4 routes exactly like X-MoE (the same share of choices per expert): per token, 4 choices per token
    push more experts over the threshold, but the share-of-choices view does not move, so nothing reproduces."""
    uneven = [40, 30, 20, 6] + [0.125] * 32
    uneven = uneven[:32]
    claim = activation_claim(
        {"xmoe": _activation_run(1, uneven, uneven), "mhmoe-h4": _activation_run(4, [4 * v for v in uneven], uneven)}
    )
    views = claim.measured["by_modality"]["language"]["views"]
    assert views["per_token"]["verdict"] == REPRODUCES
    assert views["share_of_choices"]["verdict"] == NOT_SEPARATED
    assert claim.verdict == NOT_SEPARATED


def _diversity_run(heads, experts, object_values, background_values):
    """Per image: 4 object and 12 background patches with the given mean diversity."""
    return {
        VISION: {
            "object_sum": [4 * v for v in object_values],
            "object_patches": [4] * len(object_values),
            "background_sum": [12 * v for v in background_values],
            "background_patches": [12] * len(background_values),
            "heads": heads,
            "experts": experts,
        }
    }


def test_diversity_claim_separates_saturated_runs_from_telling_ones():
    generator = np.random.default_rng(0)
    at_ceiling = _diversity_run(2, 32, [2.0] * 20, [2.0] * 20)
    headroom = _diversity_run(8, 8, list(5 + generator.normal(0, 0.2, 20)), list(4 + generator.normal(0, 0.2, 20)))
    claim = diversity_claim({"mhmoe-h2": at_ceiling, "mhmoe-h8": headroom})
    runs = claim.measured["runs"]
    assert runs["mhmoe-h2"]["verdict"] == SATURATED and runs["mhmoe-h2"]["ceiling"] == 2
    assert runs["mhmoe-h2"]["random_router"] == pytest.approx(32 * (1 - (31 / 32) ** 2))
    assert runs["mhmoe-h8"]["verdict"] == REPRODUCES and runs["mhmoe-h8"]["difference"] == pytest.approx(1.0, abs=0.2)
    assert claim.verdict == REPRODUCES  # the saturated run shows nothing either way
    noisy = _diversity_run(8, 8, list(4 + generator.normal(0, 1.0, 20)), list(4 + generator.normal(0, 1.0, 20)))
    assert diversity_claim({"mhmoe-h8": noisy}).verdict == NOT_SEPARATED
    assert diversity_claim({"mhmoe-h2": at_ceiling}).verdict == SATURATED


def _snapshot(step, rc, changed, loads=None, batches=8):
    """RC per key with tight bootstrap replicates; ``changed`` per key: tokens out of 100 per batch that changed
    expert since the previous snapshot (None for the first)."""
    loads = loads or [25, 25, 25, 25]
    collapse = {key: {"rc": value, "classes": 4, "resamples": [value * f for f in np.linspace(0.97, 1.03, 50)]}
                for key, value in rc.items()}  # fmt: skip
    fluctuation = None
    if changed is not None:
        fluctuation = {
            key: {"changed": [value] * batches, "compared": [100] * batches} for key, value in changed.items()
        }
    return {"step": step, "collapse": collapse, "loads": {key: loads for key in rc}, "fluctuation": fluctuation}


def _curve(rc_language, rc_vision, changed_language, changed_vision):
    return [
        _snapshot(10 * i, {LANGUAGE: rl, VISION: rv}, None if i == 0 else {LANGUAGE: cl, VISION: cv})
        for i, (rl, rv, cl, cv) in enumerate(zip(rc_language, rc_vision, changed_language, changed_vision, strict=True))
    ]


def test_collapse_and_fluctuation_claims_are_judged_per_modality():
    """Language: X-MoE's RC stays larger and its routing changes less (the papers' direction); vision: the opposite."""
    snapshots = {
        "switch": _curve([5, 4, 3, 2], [5, 6, 7, 8], [0, 50, 40, 40], [0, 20, 10, 10]),
        "xmoe": _curve([5, 6, 7, 8], [5, 4, 3, 2], [0, 30, 10, 10], [0, 50, 40, 40]),
    }
    collapse = collapse_claim(snapshots, HALF_WINDOW.claim("collapse"))
    language, vision = (collapse.measured["by_modality"][m] for m in ("language", "vision"))
    assert language["second_half_log_ratio"] == pytest.approx(np.mean([np.log(7 / 3), np.log(8 / 2)]))
    assert language["verdict"] == REPRODUCES and vision["verdict"] == OPPOSITE
    assert collapse.verdict == REPRODUCES  # X-MoE Fig. 2c measures text
    assert language["second_half_slope"]["xmoe"] > 0 > language["second_half_slope"]["switch"]
    per_layer = language["per_layer"][LANGUAGE]
    assert per_layer["xmoe"]["second_half_rc"] == pytest.approx(np.sqrt(7 * 8))  # geometric, not (7 + 8) / 2
    assert per_layer["xmoe"]["classes"] == 4 and per_layer["xmoe"]["rc_per_direction"] == pytest.approx(8 / 3)
    assert language["curves"]["xmoe"]["steps"] == [0, 10, 20, 30]

    fluctuation = fluctuation_claim(snapshots, HALF_WINDOW.claim("fluctuation"))
    language = fluctuation.measured["by_modality"]["language"]
    assert language["second_half_mean"] == pytest.approx({"switch": 0.4, "xmoe": 0.1})
    assert language["random_reassignment"]["xmoe"] == pytest.approx(0.75)  # 1 - 4 x (1/4)^2
    assert language["verdict"] == REPRODUCES and fluctuation.verdict == REPRODUCES
    assert fluctuation.measured["by_modality"]["vision"]["verdict"] == OPPOSITE
    swapped = {"switch": snapshots["xmoe"], "xmoe": snapshots["switch"]}
    half = HALF_WINDOW.claim
    assert collapse_claim(swapped, half("collapse")).verdict == OPPOSITE
    assert fluctuation_claim(swapped, half("fluctuation")).verdict == OPPOSITE


def test_fluctuation_at_the_random_reassignment_level_is_uninformative():
    snapshots = {
        "switch": _curve([5] * 4, [5] * 4, [0, 74, 74, 74], [0, 74, 74, 74]),
        "xmoe": _curve([5] * 4, [5] * 4, [0, 70, 70, 70], [0, 70, 70, 70]),
    }
    # 0.70 and 0.74 >= 0.9 x 0.75
    assert fluctuation_claim(snapshots, HALF_WINDOW.claim("fluctuation")).verdict == UNINFORMATIVE


def _consistency(values_language, values_vision, runs=5):
    windows = [{"step": 10 * (i + 1), LANGUAGE: lang, VISION: vis, "mean": None}
               for i, (lang, vis) in enumerate(zip(values_language, values_vision, strict=True))]  # fmt: skip
    return {"steps": [w["step"] for w in windows], "windows": windows, "runs": runs}


def test_consistency_claim_uses_the_mean_correlation_between_runs():
    """IC = (m + Σ_{i≠j} ρ) / m²: with m = 5, IC 0.2 is ρ = 0 and IC 1 is ρ = 1."""
    assert mean_correlation(0.2, 5) == pytest.approx(0.0) and mean_correlation(1.0, 5) == pytest.approx(1.0)
    switch = _consistency([0.3, 0.3, 0.3, 0.32, 0.28, 0.3], [0.3] * 6)
    xmoe = _consistency([0.3, 0.3, 0.3, 0.9, 0.92, 0.88], [0.3, 0.3, 0.3, 0.5, 0.1, 0.3])
    claim = consistency_claim({"switch": switch, "xmoe": xmoe})
    language = claim.measured["by_modality"]["language"]
    assert language["second_half_mean"]["xmoe"] == pytest.approx(mean_correlation(0.9, 5))
    # the windows of one set of fine-tunings describe, they decide nothing: the interval is kept, no verdict read
    assert language["verdict"] == DESCRIPTIVE and claim.verdict == DESCRIPTIVE and language["interval"][0] > 0
    vision = claim.measured["by_modality"]["vision"]
    assert vision["verdict"] == DESCRIPTIVE and vision["interval"][0] < 0 < vision["interval"][1]  # swings across 0
    # the reading of reports before the term was labelled descriptive stays beside it (a rule changed after the runs)
    assert (language["verdict_before"], vision["verdict_before"]) == (REPRODUCES, NOT_SEPARATED)
    assert "(earlier reports' reading: reproduces)" in claim.summary
    full = _consistency([1.0] * 4, [1.0] * 4)
    assert consistency_claim({"switch": full, "xmoe": full}).verdict == SATURATED


def _scores(vqa, nlvr2, cider):
    return {"vqav2": [{"overall": v} for v in vqa], "nlvr2": [{"accuracy": v} for v in nlvr2],
            "captioning": [{"CIDEr": v} for v in cider]}  # fmt: skip


CHANCE = {"vqav2": 39.4, "nlvr2": 0.5, "captioning": 0.31}


def test_tasks_claim_uses_the_noise_of_each_difference_and_the_chance_levels():
    scores = {
        "dense": _scores([40.0, 41.0, 42.0], [0.50], [0.30, 0.30]),
        "switch": _scores([41.0], [0.50], [0.30]),
        "xmoe": _scores([45.0, 46.0, 47.0], [0.55], [0.40, 0.42]),
        "mhmoe": _scores([50.0, 51.0, 52.0], [0.60], [0.36, 0.36]),
        "stratified": _scores([44.0], [0.50], [0.30]),
    }
    claim = tasks_claim(scores, CHANCE)
    tasks = claim.measured["tasks"]
    assert tasks["vqav2"]["pooled_seed_std"] == pytest.approx(1.0)
    assert tasks["vqav2"]["verdict"] == REPRODUCES  # gaps 5 and 5, each ± 1.96 x sqrt(2/3)
    assert tasks["nlvr2"]["verdict"] == NOT_SEPARATED  # one seed everywhere: the noise is unknown
    assert tasks["captioning"]["gaps"][0]["verdict"] == OPPOSITE  # MH-MoE below X-MoE beyond the noise
    assert tasks["captioning"]["verdict"] == OPPOSITE
    assert claim.verdict == NOT_SEPARATED  # the tasks disagree
    below = {variant: _scores([30.0, 31.0], [0.45], [0.2]) for variant in scores}
    below_claim = tasks_claim(below, CHANCE)
    assert {entry["verdict"] for entry in below_claim.measured["tasks"].values()} == {UNINFORMATIVE}
    assert below_claim.verdict == UNINFORMATIVE


def test_pretraining_claim_compares_equal_fine_tunings_per_task():
    pretrained = _scores([45.0, 46.0, 47.0], [0.60, 0.61, 0.62], [0.50, 0.51, 0.52])
    random_init = _scores([40.0, 41.0, 42.0], [0.61, 0.62, 0.63], [0.20, 0.21, 0.22])
    claim = pretraining_claim("xmoe", pretrained, random_init, CHANCE)
    tasks = claim.measured["tasks"]
    assert tasks["vqav2"]["difference"] == pytest.approx(5.0) and tasks["vqav2"]["verdict"] == REPRODUCES
    assert tasks["nlvr2"]["verdict"] == NOT_SEPARATED  # -0.01 within the seeds' noise
    assert tasks["captioning"]["verdict"] == REPRODUCES
    assert claim.verdict == NOT_SEPARATED  # not every task
    below = pretraining_claim("xmoe", _scores([33.0, 34.0], [0.4, 0.41], [0.1, 0.1]),
                              _scores([30.0, 31.0], [0.4, 0.41], [0.1, 0.1]), CHANCE)  # fmt: skip
    assert below.measured["tasks"]["vqav2"]["verdict"] == UNINFORMATIVE  # neither side above the 39.4 prior
    worse = pretraining_claim("xmoe", random_init, pretrained, CHANCE)
    assert worse.measured["tasks"]["captioning"]["verdict"] == OPPOSITE


def _capacity(first, later, batches=8):
    rows = {}
    for modality_name, (a, b) in {"language": (first, later), "vision": (later, first)}.items():
        rows[f"layer1/{modality_name}"] = {"capacity": [a] * batches, "tokens": [100] * batches}
        rows[f"layer3/{modality_name}"] = {"capacity": [b] * batches, "tokens": [100] * batches}
    return rows


def test_capacity_claim_compares_the_first_stratified_layer_with_the_later_ones():
    claim = capacity_claim(_capacity(1.8, 1.2))
    language = claim.measured["by_modality"]["language"]
    assert language["per_layer"] == pytest.approx({"layer1/language": 1.8, "layer3/language": 1.2})
    assert language["overall"] == pytest.approx(1.5) and language["difference"] == pytest.approx(0.6)
    assert language["verdict"] == REPRODUCES and claim.verdict == REPRODUCES
    assert claim.measured["by_modality"]["vision"]["verdict"] == OPPOSITE
    assert capacity_claim(_capacity(1.2, 1.8)).verdict == OPPOSITE


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
    from mmoe.runtime.layout import RunLayout
    from mmoe.runtime.snapshots import BackboneSnapshots
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
    # The run folder's layout names the same files, and lists them by step; other files in the folder are no snapshot.
    layout = RunLayout(tmp_path)
    assert [layout.snapshot(step) for step in (0, 2, 4)] == [callback.path(step) for step in (0, 2, 4)]
    (layout.snapshots / "step12.pt").write_text("")
    (layout.snapshots / "step000006.pt.tmp").write_text("")
    (layout.snapshots / "step000010.pt").mkdir()
    assert layout.saved_snapshots() == {step: layout.snapshot(step) for step in (0, 2, 4)}
    assert RunLayout(tmp_path / "elsewhere").saved_snapshots() == {}
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
    plan = study_plan(FAST, "fast")
    assert report["claims"] == json.loads(
        json.dumps([claim.to_json() for claim in claims_from(Measures.from_json(measures), plan)])
    )
    # the plan: its hash in the report and in every stage's marker; the claims decided over runs beside
    assert report["plan"]["sha256"] == plan_hash(plan) and read_plan(out / "plan.json") == plan
    markers = [json.loads(path.read_text()) for path in (out / "stages").glob("*.json")]
    assert markers and {marker["result"]["plan_sha256"] for marker in markers} == {plan_hash(plan)}
    assert [d["id"] for d in report["decisions"]] == [c["id"] for c in report["claims"]]
    decided = {decision["id"]: decision for decision in report["decisions"]}
    assert decided["activation"]["runs_per_arm"] == [2, 2, 2] and decided["activation"]["verdict"] != UNDECIDABLE
    assert decided["consistency"]["runs_per_arm"] == decided["consistency_trained"]["runs_per_arm"] == [3, 3]
    assert decided["diversity"]["verdict"] == UNDECIDABLE and decided["tasks"]["verdict"] == NOT_RUN
    assert [claim["id"] for claim in report["claims"]] == [
        "activation", "diversity", "collapse", "fluctuation", "consistency", "consistency_trained", "tasks",
        "pretraining", "capacity", "frequency",
    ]  # fmt: skip
    markdown = (out / "report.md").read_text()
    assert "mmoe study claims --fast" in markdown and f"Plan `{plan_hash(plan)}`" in markdown
    # the run's facts come from the run: every training it made with FAST's settings (Stratified MoE, 2 seeds x 4
    # routing arms, the diversity run, the 8 of the router table, 2 recipe pre-trainings; 2 rules x 2 routers x 3 seeds
    # of consistency fine-tunings, 2 backbones x 2 arms of VQA fine-tunings; no task order: --scale gpu only)
    assert report["run"]["trainings"] == 1 + 8 + 1 + len(FAST.router_variants) + 2 + 12 + 4
    assert [row["router"] for row in report["routers"] if not row["not_run"]] == [
        name for name in FAST.router_variants for _ in ((None,) if name == "limoe" else ("language", "vision"))
    ]
    assert {row["modality"] for row in report["routers"] if row["router"] == "limoe"} == {"shared"}  # one pool
    assert f"{report['run']['trainings']} trainings" in markdown and report["run"]["disk_bytes"] > 0
    assert report["claim_settings"]["collapse"] in markdown
    for claim in report["claims"]:
        assert claim["verdict"] in VERDICTS
        assert claim["title"] in markdown
        assert claim["verdict"] == NOT_RUN or Path(report["figures"][claim["id"]]).stat().st_size > 0
    assert any((out / "figures" / "maps").glob("subtoken_map_*.png"))


def _saved(out: Path) -> tuple[dict, dict, dict]:
    """The fast study's report, measures and decisions by claim id."""
    report = json.loads((out / "report.json").read_text())
    measures = json.loads((out / "analysis" / "measures.json").read_text())
    return report, measures, {decision["id"]: decision for decision in report["decisions"]}


@pytest.mark.slow
def test_fast_study_decides_claims_1_3_4_over_the_routing_seeds(fast_study):
    out = fast_study
    report, measures, decided = _saved(out)
    # claim 1: the paper's activation ratio of the saved loads and tokens (summed over the batches), by hand
    language = report["claims"][0]["measured"]["by_modality"]["language"]
    for name, run in language["runs"].items():
        saved = measures["activation"][name]
        ratios = [
            float(activation_ratio(torch.tensor(saved["loads"][key]).sum(0), sum(saved["tokens"][key]), 0.1))
            for key in language["keys"]
        ]
        assert run["per_token"] == pytest.approx(np.mean(ratios))
    assert {run["heads"] for run in measures["activation"].values()} == {1, 2, 8}
    assert all(key.endswith("/language") for key in language["keys"])
    assert measures["activation"] == measures["seeded"]["seeds"][0]["activation"]  # routing seed 0's

    # claims 1, 3, 4 over the routing seeds: each run's statistic recomputed from its own saved measures
    seeds = measures["seeded"]["seeds"]
    assert len(seeds) == FAST.routing_seeds == 2
    activation = decided["activation"]["by_modality"]["language"]
    for seed, entry in enumerate(seeds):
        xmoe = entry["activation"]["xmoe-e8"]
        keys = [key for key in xmoe["loads"] if key.endswith("/language")]
        shares = [float(choice_activation_ratio(torch.tensor(xmoe["loads"][k], dtype=torch.float64).sum(0), 0.1))
                  for k in keys]  # fmt: skip
        assert activation["per_run"]["h=1"][seed] == pytest.approx(np.mean(shares))
    assert [gap["pair"] for gap in activation["gaps"]] == [["h=8", "h=1"], ["h=8", "h=2"]]
    assert all(gap["holm_p"] is not None for gap in activation["gaps"])
    collapse = decided["collapse"]["by_modality"]["language"]
    window = study_plan(FAST, "fast").claim("collapse").window_from
    for seed, entry in enumerate(seeds):
        late = entry["snapshots"]["xmoe"][int(len(entry["snapshots"]["xmoe"]) * window) :]
        keys = [key for key in late[0]["collapse"] if key.endswith("/language")]
        rcs = [[snapshot["collapse"][k]["rc"] for k in keys] for snapshot in late]
        expected = None if any(v is None for r in rcs for v in r) else np.mean([np.mean(np.log(r)) for r in rcs])
        assert collapse["per_run"]["xmoe"][seed] == (None if expected is None else pytest.approx(expected))
    assert set(decided["fluctuation"]["by_modality"]) == {"language", "vision"}
    assert "language (the paper's)" in (out / "report.md").read_text()


@pytest.mark.slow
def test_fast_study_measures_claims_5_and_7_from_their_runs_files(fast_study):
    out = fast_study
    report, measures, decided = _saved(out)
    # claim 5: IC window by window from the seeds' own routing_stats.json, both routers under the same rule per row
    for variant, rule in itertools.product(("switch", "xmoe"), ("frozen", "trained")):
        folders = [out / "finetune" / f"{variant}-e8-seed0-{rule}" / f"vqav2-seed{seed}" for seed in range(3)]
        runs = [window_loads(read_stats(folder)) for folder in folders]
        saved = measures["consistency" if rule == "frozen" else "consistency_trained"][variant]
        assert saved["steps"] == [step for step, _ in runs[0]] and saved["runs"] == 3
        assert saved["frozen_routing"] == (rule == "frozen")
        for position, window in enumerate(saved["windows"]):
            for key in runs[0][position][1]:
                ic = inter_run_consistency([run[position][1][key].tolist() for run in runs])
                assert window[key] == (pytest.approx(ic) if math.isfinite(ic) else None)
                for left, windows in enumerate(saved["leave_one_out"]):  # each seed left out: the jackknife's
                    rest = [run[position][1][key].tolist() for seed, run in enumerate(runs) if seed != left]
                    ic = inter_run_consistency(rest)
                    assert windows[position][key] == (pytest.approx(ic) if math.isfinite(ic) else None)

    # claim 7: one score per backbone, the evaluation files' own; the image sums add up to each run's accuracy
    tasks = report["claims"][7]["measured"]["tasks"]
    images = measures["backbones"]["images"]["vqav2"]
    for arm, folder in (("pretrained", "mhmoe-demo-seed{}"), ("random_init", "mhmoe-demo-random-init-seed{}")):
        for seed in (0, 1):
            path = out / "finetune" / folder.format(seed) / f"vqav2-seed{seed}" / "scores.json"
            vqa = json.loads(path.read_text())["overall"]
            assert tasks["vqav2"][arm]["values"][seed] == pytest.approx(vqa)
            run = images[arm][seed]
            assert 100 * sum(run["sums"]) / sum(run["questions"]) == pytest.approx(vqa, abs=0.01)
    assert decided["pretraining"]["gaps"][0]["within_run"] is not None


@pytest.mark.slow
def test_fast_study_rc_is_the_snapshot_files_own(fast_study):
    out = fast_study
    _, measures, _ = _saved(out)
    # claim 3: the last X-MoE snapshot's RC, recomputed from the snapshot file
    snapshots = sorted((out / "pretrain" / "xmoe-e8-seed0" / "snapshots").glob("step*.pt"))
    assert [int(p.stem[4:]) for p in snapshots] == [m["step"] for m in measures["snapshots"]["xmoe"]]
    batches = held_out_batches(out / "data" / "shards" / "coco-karpathy-test", 64, 2, 16, 32)
    run = run_routing(load_backbone(snapshots[-1]), inputs(batches), capture_inputs=True, max_rows=500)
    saved = measures["snapshots"]["xmoe"][-1]["collapse"]
    for key, (hidden, top1) in run.router_inputs.items():
        value = representation_collapse(hidden, top1)
        assert saved[key]["rc"] == (pytest.approx(value, rel=1e-6) if math.isfinite(value) else None)
        assert len(saved[key]["resamples"]) == RC_RESAMPLES


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
    # the plan changed after the runs (a window moved, undeclared): refused, both hashes named, nothing rewritten
    plan = study_plan(FAST, "fast")
    claims = tuple(dataclasses.replace(c, window_from=0.25) if c.id == "collapse" else c for c in plan.claims)
    changed = dataclasses.replace(plan, claims=claims)
    write_plan(changed, fast_study.parent / "changed.json")
    report = (fast_study / "report.json").stat().st_mtime_ns
    assert (
        main(["study", "claims", "--fast", "--out", str(fast_study), "--plan", str(fast_study.parent / "changed.json")])
        == 2
    )
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and plan_hash(plan) in error and plan_hash(changed) in error
    assert (fast_study / "report.json").stat().st_mtime_ns == report


def test_a_report_of_hand_made_claims_is_written_whole(tmp_path):
    """The report from claims (Markdown, JSON, one figure per claim, intervals in the panels) without training."""
    few, spread = [50, 50] + [0] * 30, [12] * 16 + [13] * 16
    activation = {"xmoe": _activation_run(1, few, spread), "mhmoe-h4": _activation_run(4, spread, spread)}
    diversity = {"mhmoe-h8": _diversity_run(8, 8, [5.0, 5.2, 4.8], [4.0, 4.1, 3.9])}
    snapshots = {
        "switch": _curve([5, 4, 3, 2], [5, 6, 7, 8], [0, 50, 40, 40], [0, 20, 10, 10]),
        "xmoe": _curve([5, 6, 7, 8], [5, 4, 3, 2], [0, 30, 10, 10], [0, 50, 40, 40]),
    }
    consistency = {"switch": _consistency([0.3] * 4, [0.3] * 4), "xmoe": _consistency([0.3, 0.4, 0.9, 0.9], [0.3] * 4)}
    scores = {name: _scores([40.0, 42.0], [0.5], [0.3]) for name in ("dense", "switch", "xmoe", "mhmoe", "stratified")}
    claims = [
        activation_claim(activation),
        diversity_claim(diversity),
        collapse_claim(snapshots, HALF_WINDOW.claim("collapse")),
        fluctuation_claim(snapshots, HALF_WINDOW.claim("fluctuation")),
        consistency_claim(consistency),
        tasks_claim(scores, CHANCE),
        pretraining_claim("xmoe", scores["xmoe"], scores["dense"], CHANCE),
        capacity_claim(_capacity(1.8, 1.2)),
        frequency_claim(_token_passes(lambda t: 1 + t / 30), {str(t): 1000 - 30 * t for t in range(30)}),
    ]
    settings = {"collapse": "Switch and X-MoE, 32 experts"}
    plan = HALF_WINDOW  # the design of one run per routing arm
    measures = Measures({}, {}, {}, consistency, {}, {}, {}, {}, CHANCE)
    decisions = run_decisions(claims, plan, measures)
    report = write_report(claims, tmp_path, "# header", {"command": "test"}, CHANCE, settings, None, decisions)
    assert report["claims"] == [claim.to_json() for claim in claims] and report["decisions"] == decisions
    assert json.loads((tmp_path / "report.json").read_text()) == json.loads(json.dumps(report))
    markdown = (tmp_path / "report.md").read_text()
    for number, (claim, decision) in enumerate(zip(claims, decisions, strict=True), 1):
        assert f"## {number}. {claim.title}" in markdown and f"**Within-run verdict: {claim.verdict}.**" in markdown
        assert f"**Verdict: {decision['verdict']}.**" in markdown
        assert claim.verdict in VERDICTS
    # one run per arm is not decided, whatever the within-run interval says; the seeds decide claims 6 and 7
    by_id = {decision["id"]: decision for decision in decisions}
    assert by_id["activation"]["verdict"] == UNDECIDABLE and by_id["activation"]["within_run_verdict"] == REPRODUCES
    assert "| 1 run per arm: not decided |" in markdown
    assert by_id["consistency"]["verdict"] == NO_SEED_VALUES  # these measures hold no leave-one-out windows
    assert by_id["tasks"]["runs_per_arm"] == [2] * 9 and len(by_id["tasks"]["gaps"]) == 6
    gaps = by_id["tasks"]["gaps"]  # VQA has two seeds per cell, NLVR2 and captioning one here
    assert all((gap["holm_p"] is not None) == (gap["task"] == "vqav2") for gap in gaps)
    assert {gap["verdict"] for gap in gaps if gap["task"] != "vqav2"} == {UNDECIDABLE}
    assert "language (the paper's)" in markdown and "vision" in markdown
    assert set(report["figures"]) == {claim.id for claim in claims}
    assert "**mmoe's setting.** Switch and X-MoE, 32 experts." in markdown
    assert all(Path(path).stat().st_size > 0 for path in report["figures"].values())


# -- Stratified MoE §5: capacity by token frequency ------------------------------------------------------------------


def test_spearman_ranks_ties_by_their_average():
    assert list(average_ranks(np.asarray([10, 20, 20, 30]))) == [1, 2.5, 2.5, 4]
    assert spearman(np.asarray([1, 2, 3, 4]), np.asarray([8, 6, 4, 2])) == pytest.approx(-1.0)
    assert spearman(np.asarray([1, 2, 2, 4]), np.asarray([1, 3, 3, 4])) == pytest.approx(1.0)
    assert spearman(np.asarray([1, 2, 3]), np.asarray([5, 5, 5])) is None


def _token_passes(passes_of, tokens=30, occurrences=4):
    """One language layer: token t seen ``occurrences`` times with ``passes_of(t)`` passes each."""
    ids = list(range(tokens))
    return {LANGUAGE: {"ids": ids, "passes": [occurrences * passes_of(t) for t in ids],
                       "occurrences": [occurrences] * tokens}}  # fmt: skip


def test_frequency_claim_correlates_training_frequency_with_passes():
    counts = {str(t): 1000 - 30 * t for t in range(30)}  # token 0 the most frequent
    fewer_for_frequent = frequency_claim(_token_passes(lambda t: 1 + t / 30), counts)
    assert fewer_for_frequent.measured["rho"] == pytest.approx(-1.0)
    assert fewer_for_frequent.verdict == REPRODUCES and fewer_for_frequent.measured["tokens"] == 30
    assert frequency_claim(_token_passes(lambda t: 2 - t / 30), counts).verdict == OPPOSITE
    assert frequency_claim(_token_passes(lambda t: 1.0), counts).verdict == UNINFORMATIVE
    rare = frequency_claim(_token_passes(lambda t: 1 + t / 30, occurrences=2), counts)
    assert rare.measured["tokens"] == 0 and rare.verdict == NOT_SEPARATED  # seen too rarely to rank


def test_token_passes_count_each_text_tokens_gates_and_training_counts_read_the_shards(tmp_path):
    from mmoe.model import MoEPlan
    from mmoe.viz.inputs import Sample, TextEncoder, make_batches
    from tests.routing_fixtures import make_checkpoint, png_bytes, shard

    plan = MoEPlan(num_experts=4, strata=[2, 2], top_k=2, every=1)
    checkpoint = make_checkpoint(tmp_path / "stratified.pt", moe=plan)
    texts = ["a red square", "two blue circles and a red square", "a square"]
    samples = [Sample(f"s{i}", image=png_bytes(i), text=text) for i, text in enumerate(texts)]
    batches = list(make_batches(samples, 32, 3, TextEncoder(16)))
    measured = token_passes(checkpoint, batches)
    backbone = load_backbone(checkpoint).eval()
    with torch.no_grad():
        output = backbone(**batches[0].inputs)
    ids, real = batches[0].inputs["text"], ~batches[0].inputs["text_padding_mask"]
    records = [r for r in output.routing if r.modality == "language"]
    assert sorted(measured) == sorted(f"layer{r.layer}/language" for r in records)
    for record in records:
        passes = (record.stratum_path >= 0).sum(-1)
        entry = measured[f"layer{record.layer}/language"]
        for token, total, occurrences in zip(entry["ids"], entry["passes"], entry["occurrences"], strict=True):
            where = (ids == token) & real
            assert occurrences == int(where.sum()) and total == int(passes[where].sum())
        assert set(entry["passes"]) - {0}  # every real token passes at least one gate
    train = shard(tmp_path / "train" / "shard-000000.tar", count=3)
    counts = training_token_counts([train.parent], 16)
    tokenizer = TextEncoder(16).tokenizer
    expected: dict[int, int] = {}
    for index in range(3):
        for token in tokenizer.encode(f"a small red square and {index} blue circles"):
            expected[token] = expected.get(token, 0) + 1
    assert counts == expected


def test_the_shipped_report_is_recomputed_from_its_shipped_measures():
    """``docs/claims.md`` ships with the default run's ``measures.json`` and ``report.json``: today's claims code
    recomputes the report's claims from the measures, and the Markdown carries every verdict."""
    docs = Path(__file__).resolve().parents[2] / "docs"
    measures = json.loads((docs / "claims" / "measures.json").read_text())
    report = json.loads((docs / "claims" / "report.json").read_text())
    shipped_plan = (plan_from_json({key: value for key, value in report["plan"].items() if key != "sha256"})
                    if "plan" in report else HALF_WINDOW)  # a report from before plans: that design's  # fmt: skip
    recomputed = json.loads(
        json.dumps([claim.to_json() for claim in claims_from(Measures.from_json(measures), shipped_plan)])
    )
    # floats within 1e-9: a least-squares slope's last bits move with the CPU's BLAS kernels
    assert differences(recomputed, report["claims"]) == []
    markdown = (docs / "claims.md").read_text()
    for claim in report["claims"]:  # "**Verdict: ...**" before the runs per arm, "**Within-run verdict: ...**" since
        assert f"erdict: {claim['verdict']}.**" in markdown
    for link in re.findall(r"\]\((claims/figures/[^)]+)\)", markdown):
        assert (docs / link).is_file(), link


def test_the_study_fine_tunes_only_the_benchmarks_its_settings_give_steps(tmp_path):
    """The demo's retrieval benchmark has no steps in the study's settings: no retrieval stage, no retrieval scores."""
    from mmoe.study.runs import StudyRun, finetune_stages
    from mmoe.study.settings import FAST as STUDY_FAST

    with_tasks = dataclasses.replace(STUDY_FAST, run_tasks=True)
    keys = [str(stage.key) for stage in finetune_stages(StudyRun(tmp_path, with_tasks.training), with_tasks)]
    tasks = {key.split("/")[2].split("-seed")[0] for key in keys if key.startswith("finetune/dense/")}
    assert tasks == set(STUDY_FAST.training.finetune_steps) == {"vqav2", "nlvr2", "captioning"}


def test_the_study_keeps_its_training_setting_apart_from_the_demos():
    """The study trains as its shipped report says (BEiT-3's pre-training objective, the tiny width, the configs'
    learning rates but captioning's), whatever the demo's own setting becomes."""
    from mmoe.pipeline.settings import upgraded_settings
    from mmoe.study.settings import FAST as STUDY_FAST
    from mmoe.study.settings import GPU as SCALE

    shipped = json.loads((Path(__file__).parents[2] / "docs" / "claims" / "report.json").read_text())
    stored = upgraded_settings(shipped["settings"]["training"])  # in today's form
    assert {key: DEFAULT.training.to_json()[key] for key in stored} == stored
    for settings in (DEFAULT, STUDY_FAST, SCALE):
        training = settings.training
        assert training.contrastive_coefficient == 0 and not training.pretrain_output_vocab
        assert training.pretrain_learning_rate is None
        assert all(set(options) <= {"learning_rate"} for options in training.finetune_optimizer.values())
    assert STUDY_FAST.training.finetune_optimizer == SCALE.training.finetune_optimizer == {}
