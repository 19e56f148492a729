"""The GPU presets' plans (``--scale gpu``: claims 2, 4 and 7; ``--scale gpu-tasks``: the task order): the committed
``docs/claims/plan_gpu*.json`` + ``.md`` equal to what the code writes, each design as the plan states it, the window
from the warm-up's end, the cost model's estimate against a hand count, and the dry run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from mmoe.io import read_json
from mmoe.pipeline.settings import refuse_other_settings
from mmoe.study.claims import judged_window
from mmoe.study.command import study_command, upgraded_study
from mmoe.study.cost import BUDGETS, GPU_COSTS, cost_lines, total_minutes
from mmoe.study.plan import read_plan
from mmoe.study.plan_design import PLAN_STEMS, plan_markdown, study_plan, write_plan_files
from mmoe.study.runs import STRATIFIED, pretrainings
from mmoe.study.settings import CLAIM_IDS, DEFAULT, FAST, GPU, GPU_TASKS, PRESETS

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "claims"
GPU_PRESETS = ("gpu", "gpu-tasks")


def warmup_steps() -> int:
    """The tiny pre-training config's warm-up (every routing run's)."""
    config = yaml.safe_load((ROOT / "configs" / "pretrain" / "tiny.yaml").read_text())
    return config["model"]["init_args"]["optimizer"]["warmup_steps"]


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_the_committed_gpu_plans_are_what_the_code_writes(preset, tmp_path):
    stem = PLAN_STEMS[preset]
    shipped = read_plan(DOCS / f"{stem}.json")
    assert shipped == study_plan(PRESETS[preset], preset)
    assert (DOCS / f"{stem}.md").read_text() == plan_markdown(shipped)
    write_plan_files(tmp_path, from_design=True, preset=preset)  # the writer the files were made with
    assert (tmp_path / f"{stem}.json").read_bytes() == (DOCS / f"{stem}.json").read_bytes()
    assert (tmp_path / f"{stem}.md").read_bytes() == (DOCS / f"{stem}.md").read_bytes()


def test_every_claim_is_run_by_some_preset_and_a_gpu_plan_names_it():
    runners = {claim: [name for name, s in PRESETS.items() if name != "fast" and s.runs_claim(claim)]
               for claim in CLAIM_IDS}  # fmt: skip
    assert all(runners.values()), runners
    for preset in GPU_PRESETS:
        for claim in study_plan(PRESETS[preset], preset).claims:
            if claim.not_run:
                assert claim.noise_rule.unit.startswith(f"not run (preset {preset}): run by ")
                assert all(name in claim.noise_rule.unit for name in runners[claim.id] if name != "default")
                assert ("default preset" in claim.noise_rule.unit) == ("default" in runners[claim.id])


def test_scale_gpu_holds_claims_2_4_and_7_at_8_runs_per_arm():
    plan = study_plan(GPU, "gpu")
    run = {claim.id for claim in plan.claims if not claim.not_run}
    assert run == {"diversity", "fluctuation", "pretraining"}
    diversity = plan.claim("diversity")
    assert [arm.name for arm in diversity.arms] == ["mhmoe-e16-h8"]  # h = 8 over 16 experts: headroom below 8
    assert diversity.runs_per_arm() == [8] and diversity.arms[0].steps == 1000
    fluctuation = plan.claim("fluctuation")
    assert [arm.name for arm in fluctuation.arms] == ["xmoe", "switch"]
    assert fluctuation.runs_per_arm() == [8, 8] and {arm.steps for arm in fluctuation.arms} == {1000}
    assert GPU.snapshot_every == 100 and GPU.routing_min_lr_ratio == 1.0 and "constant" in fluctuation.schedule
    pretraining = plan.claim("pretraining")
    assert pretraining.runs_per_arm() == [8, 8] and [arm.steps for arm in pretraining.arms] == [300, 300]
    # nothing of the claims it does not run is trained
    names = {run.name for run in pretrainings(GPU)}
    assert STRATIFIED not in names and not any("-h4-" in n or n.startswith("mhmoe-e32") for n in names)
    assert len(names) == 8 + 16 + 8 and GPU.seeds == 0 and GPU.router_variants == ()


@pytest.mark.parametrize("settings", [DEFAULT, GPU], ids=["default", "gpu"])
def test_the_fluctuation_window_starts_at_the_warm_ups_end(settings):
    """Claims 3 and 4 read the snapshots (and the pairs of consecutive ones) from the first at or after the warm-up's
    last step: every judged pair lies at the constant rate, and the snapshot before the window does not."""
    warmup = warmup_steps()
    steps = list(range(0, settings.router_steps + 1, settings.snapshot_every))  # BackboneSnapshots: step 0 on
    window = study_plan(settings, "x").claim("fluctuation").window_from
    judged = judged_window(steps, window)
    assert judged[0] >= warmup and steps[steps.index(judged[0]) - 1] < warmup
    pairs = list(zip(steps, steps[1:], strict=False))  # a fluctuation per snapshot after the first
    judged_pairs = judged_window(pairs, window)
    assert judged_pairs[0][0] >= warmup and judged_pairs == pairs[pairs.index(judged_pairs[0]) :]
    assert pairs[pairs.index(judged_pairs[0]) - 1][0] < warmup


def test_scale_gpu_tasks_is_the_audits_task_order_design():
    plan = study_plan(GPU_TASKS, "gpu-tasks")
    assert [claim.id for claim in plan.claims if not claim.not_run] == ["tasks"]
    tasks = plan.claim("tasks")
    assert len(tasks.arms) == 9 and tasks.runs_per_arm() == [9] * 9 and tasks.multiplicity == "holm"
    mhmoe_vqa = tasks.arms[0]
    assert mhmoe_vqa.name == "mhmoe vqav2" and mhmoe_vqa.steps == 1000
    assert {run.split("/")[1] for run in mhmoe_vqa.runs} == {"mhmoe-seed0", "mhmoe-seed1", "mhmoe-seed2"}
    assert "pre-training run" in tasks.noise_rule.unit and "baseline" in tasks.noise_rule.unit
    trained = pretrainings(GPU_TASKS)
    assert sorted((run.variant, run.seed, run.steps) for run in trained) == sorted(
        (variant, seed, 2000) for variant in ("dense", "xmoe", "mhmoe") for seed in range(3)
    )
    assert 20 <= total_minutes(GPU_TASKS, GPU_COSTS) <= 35  # the audit's 20-35 min
    assert any("20-35 minutes" in note for note in plan.design_notes)


def test_the_gpu_estimate_is_the_cost_models_hand_count():
    """24 routing and diversity runs of 1,000 steps, 8 recipe pre-trainings of 80, 16 VQA fine-tunings of 300 with
    their scoring, 8 at once; then 2 x 8 runs x 11 snapshots and 24 backbones measured one after the other."""
    c = GPU_COSTS
    trainings = 24 * (1000 * c.pretrain + c.per_training) + 8 * (80 * c.recipe_pretrain + c.per_training)
    trainings += 16 * (300 * c.finetune + c.per_training + c.evaluation)
    seconds = trainings / 8 + 2 * 8 * 11 * c.snapshot + 24 * c.measure
    assert c.streams == 8 and total_minutes(GPU, c) == pytest.approx(seconds / 60)


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_the_budget_line_says_whether_the_estimate_fits(preset):
    budget, total = BUDGETS[preset], total_minutes(PRESETS[preset], GPU_COSTS)
    line = cost_lines(PRESETS[preset], GPU_COSTS, budget)[-1]
    assert line.startswith(f"- budget: {budget.minutes:.0f} min")
    assert ("within it" in line) == (total <= budget.minutes) and ("over it" in line) == (total > budget.minutes)
    assert "8 runs at once" in cost_lines(PRESETS[preset], GPU_COSTS)[-1]


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_the_dry_run_prints_the_plan_and_writes_nothing(preset, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert study_command(["claims", "--scale", preset, "--dry-run", "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert printed == plan_markdown(study_plan(PRESETS[preset], preset))
    assert "## Estimated cost" in printed and "- budget: " in printed and not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"claims": ("fluctuation", "speed")}, "claims holds 'speed'"),
        ({"heads": ()}, "claims holds 'activation', but the settings train none of its runs"),
        ({"seeds": 0}, "claims holds 'consistency'"),
        ({"claims": ("diversity",), "run_tasks": True}, "run_tasks trains the task order"),
        ({"routing_seeds": -1}, "routing_seeds must be at least 0, got -1"),
        ({"routing_window": 1.0}, "routing_window must be in [0, 1)"),
    ],
)
def test_settings_refuse_a_claim_without_runs(change, message):
    with pytest.raises(ValueError) as error:
        dataclasses.replace(DEFAULT, **change)
    assert message in str(error.value)


@pytest.mark.parametrize("settings", [DEFAULT, FAST], ids=["default", "fast"])
def test_a_study_folder_from_before_the_claims_field_is_the_same_run(settings, tmp_path):
    new = ("claims", "task_pretraining_seeds", "routing_window")
    older = {key: value for key, value in settings.to_json().items() if key not in new}
    (tmp_path / "study.json").write_text(json.dumps({"settings": older}))
    refuse_other_settings(tmp_path / "study.json", settings.to_json(), "a claims study", "", upgraded_study)
    assert read_json(tmp_path / "study.json", "settings")["settings"] == older  # accepted, left as it was


def test_a_gpu_plan_under_the_other_gpu_preset_is_one_line_naming_its_option(capsys):
    plan = str(DOCS / "plan_gpu.json")
    assert study_command(["claims", "--scale", "gpu-tasks", "--plan", plan, "--dry-run"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "not those of the --scale gpu-tasks settings" in error and plan in error
