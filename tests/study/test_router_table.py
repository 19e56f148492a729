"""``mmoe study claims``'s router table: the routers beyond top-1 token choice pre-trained with the study's settings,
their loads, unrouted tokens and selection biases measured on held-out batches (against a per-token loop), and the
table, which says "not run" for a router a ``measures.json`` lacks (the shipped one)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mmoe.data.tokenizer import CAPTION_MAX_TEXT_LENGTH
from mmoe.metrics.routing import record_key
from mmoe.model import MultiwayTransformer
from mmoe.moe.router import Router
from mmoe.pipeline.launch import configured_moe
from mmoe.pipeline.settings import refuse_other_settings
from mmoe.pipeline.stages import PipelineError, run_stage
from mmoe.runtime.checkpoint import export_backbone
from mmoe.study import claims_from
from mmoe.study.command import upgraded_study
from mmoe.study.measures import expert_loads, held_out_batches, inputs, router_variant_measures
from mmoe.study.report import ROUTERS_HEADING, write_report
from mmoe.study.routers import NOT_RUN, router_rows, router_table
from mmoe.study.runs import ANALYSIS_SHARDS, Measures, StudyRun, pretrain_stages, pretrainings
from mmoe.study.settings import FAST, ROUTER_VARIANTS
from tests.routing_fixtures import shard, tiny_config, tiny_part_plan

DATA = Path(__file__).resolve().parent / "data"


def test_each_router_variant_is_a_pretraining_of_its_own_tiny_part():
    runs = {run.name: run for run in pretrainings(FAST)}
    for name in ROUTER_VARIANTS:
        assert runs[name].variant == name and runs[name].steps == FAST.router_table_steps
        assert runs[name].moe == () and runs[name].snapshots == 0  # the part's own plan, no snapshots
    assert len(runs) == len(pretrainings(FAST))  # no name taken twice


def tiny_backbone(variant: str, seed: int = 0) -> MultiwayTransformer:
    """A tiny backbone with ``variant``'s MoE plan in every layer."""
    torch.manual_seed(seed)
    return MultiwayTransformer(tiny_config(tiny_part_plan(variant)))


def loop_loads(backbone: MultiwayTransformer, batches) -> dict[str, list[list[int]]]:
    """Per MoE layer and batch, each expert's choices, counted one (sub-)token choice at a time."""
    loads: dict[str, list[list[int]]] = {}
    for batch in inputs(batches):
        with torch.no_grad():
            records = backbone(**batch).routing
        for record in records:
            counts = [0] * record.expert_counts.numel()
            for expert in record.expert_index.flatten().tolist():
                if expert >= 0:
                    counts[expert] += 1
            loads.setdefault(record_key(record), []).append(counts)
    return loads


@pytest.fixture(scope="module")
def held_out(tmp_path_factory):
    path = shard(tmp_path_factory.mktemp("held_out") / "data-000000.tar", count=12)
    return held_out_batches(path, 32, 3, 4, max_text_length=CAPTION_MAX_TEXT_LENGTH)


@pytest.mark.parametrize("variant", ROUTER_VARIANTS)
def test_router_measures_count_every_choice_and_the_tokens_no_expert_took(tmp_path, held_out, variant):
    backbone = tiny_backbone(variant)
    biases = {}
    for index, router in enumerate(module for module in backbone.modules() if isinstance(module, Router)):
        if router.selection_bias is not None:  # a bias as the loss-free update leaves it: spread 0.02 * (index + 1)
            router.selection_bias.copy_(torch.linspace(-0.01, 0.01, router.selection_bias.numel()) * (index + 1))
            biases[index] = 0.02 * (index + 1)
    export_backbone(backbone, tmp_path / "backbone.pt")
    measured = router_variant_measures(tmp_path / "backbone.pt", held_out)
    assert measured["loads"] == loop_loads(backbone.eval(), held_out)
    shared = expert_loads(tmp_path / "backbone.pt", held_out)  # the activation runs' loads and tokens, one pass
    assert (measured["loads"], measured["tokens"]) == (shared["loads"], shared["tokens"])
    plan = configured_moe(variant)
    pools = plan.experts_by_modality or {}  # MoMa: each modality's own pool
    assert measured["experts"] == {key: pools.get(key.split("/")[1], plan.num_experts) for key in measured["experts"]}
    rows = router_rows({variant: measured}, [variant])
    assert [row["modality"] for row in rows] == (["shared"] if plan.mode == "shared" else ["language", "vision"])
    for row in rows:
        keys = [key for key in measured["loads"] if key.endswith(row["modality"])]
        summed = [np.sum(measured["loads"][key], axis=0) for key in keys]
        cv = [loads.std() / loads.mean() for loads in summed]
        assert row["load_cv_mean"] == pytest.approx(np.mean(cv)) and row["load_cv_worst"] == pytest.approx(max(cv))
        assert row["busiest"] == pytest.approx(max(loads.max() / loads.mean() for loads in summed))
    if plan.routing == "expert_choice":
        # Per image token (no padding among them): taken by no expert when every one of its choices is -1.
        backbone.eval()
        for position, batch in enumerate(inputs(held_out)):
            with torch.no_grad():
                records = [r for r in backbone(**batch).routing if r.modality == "vision"]
            for record in records:
                per_token = record.expert_index.flatten(2)
                unrouted = sum(bool((token < 0).all()) for token in per_token.flatten(0, 1))
                expected = unrouted / per_token.shape[0] / per_token.shape[1]
                assert measured["unrouted"][record_key(record)][position] == pytest.approx(expected)
        vision = next(row for row in rows if row["modality"] == "vision")
        assert 0 < vision["unrouted"] < 1
    else:
        assert measured["unrouted"] == {} and all(row["unrouted"] is None for row in rows)
    if plan.bias_update_rate:
        assert sorted(np.ptp(bias) for bias in measured["selection_bias"].values()) == pytest.approx(
            sorted(biases.values())
        )
        assert all(row["bias_spread"] is not None and row["bias_spread"] > 0 for row in rows)
    else:
        assert measured["selection_bias"] == {} and all(row["bias_spread"] is None for row in rows)


def test_the_shipped_measures_give_a_report_whose_router_rows_say_not_run(tmp_path):
    """The shipped ``measures.json`` predates the router runs: it still reads, and the table says "not run"."""
    measures = Measures.from_json(json.loads((DATA / "measures_before_seeds.json").read_text()))
    assert measures.router_variants == {}
    rows = router_rows(measures.router_variants, ROUTER_VARIANTS)
    assert [row["router"] for row in rows] == list(ROUTER_VARIANTS) and all(row["not_run"] for row in rows)
    report = write_report(claims_from(measures), tmp_path, "# report", {}, measures.chance, routers=rows)
    markdown = (tmp_path / "report.md").read_text()
    table = markdown.split(ROUTERS_HEADING, 1)[1]
    for name in ROUTER_VARIANTS:
        assert f"| {name} | — | {NOT_RUN} |" in table
    assert report["routers"] == rows
    with pytest.raises(ValueError, match="lacks chance"):
        Measures.from_json({key: value for key, value in measures.to_json().items() if key != "chance"})


def test_a_router_pretrained_with_the_fast_settings_is_measured_into_the_table(tmp_path, synthetic_corpus):
    """The fast study's expert-choice run: its pre-training stage and export, then its measures and table row."""
    study = StudyRun(tmp_path / "study", FAST.training.replace(codebook_size=16))
    study.out.mkdir()
    study.data.symlink_to(synthetic_corpus, target_is_directory=True)
    run = next(run for run in pretrainings(FAST) if run.name == "expert_choice")
    for stage in pretrain_stages(study, run):
        run_stage(study, stage)
    batches = held_out_batches(study.shards / ANALYSIS_SHARDS, FAST.training.image_size, 2, 8, CAPTION_MAX_TEXT_LENGTH)
    measured = router_variant_measures(study.backbone(run.name), batches)
    stats = json.loads(study.pretraining(run.name).routing_stats.read_text())
    assert set(measured["loads"]) == set(stats["num_experts"])  # the layers the training routed
    rows = router_rows({run.name: measured}, [run.name])
    # Expert choice: every expert takes exactly its C tokens of each batch, so the loads are flat.
    assert {row["modality"] for row in rows} == {"language", "vision"}
    assert all(row["load_cv_mean"] == pytest.approx(0, abs=1e-9) for row in rows)
    assert any(line.startswith("| expert_choice | vision |") for line in router_table(rows))


def test_a_study_from_before_the_router_table_is_the_same_run_and_gets_the_router_runs(tmp_path):

    older = {key: value for key, value in FAST.to_json().items() if key != "router_variants"}
    (tmp_path / "study.json").write_text(json.dumps({"settings": older}))
    refuse_other_settings(tmp_path / "study.json", FAST.to_json(), "a claims study", "", upgraded_study)  # accepted
    other = FAST.to_json() | {"router_variants": ["loss_free"]}
    with pytest.raises(PipelineError, match="router_variants"):
        refuse_other_settings(tmp_path / "study.json", other, "a claims study", "", upgraded_study)
