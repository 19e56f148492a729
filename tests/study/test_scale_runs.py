"""What ``mmoe study claims --scale gpu`` / ``--scale gpu-tasks`` runs and decides, checked without training: the
stages a study launches are its plan's runs and the cost model's list, the default and fast presets launch what they
did before the presets chose their claims, a claim outside a preset is not measured and says which preset runs it, and
claim 6 is decided over the pre-trainings (the fine-tuning seeds averaged within each), Holm over its gaps."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from mmoe.study.claim_settings import claim_settings
from mmoe.study.claims.task_scores import TASK_SCORES
from mmoe.study.command import claims_from
from mmoe.study.decisions import decision_text, run_decisions
from mmoe.study.lanes import study_stages
from mmoe.study.plan_design import TASK_ORDER, study_plan
from mmoe.study.report import write_report
from mmoe.study.runs import Measures, StudyRun, pretrainings
from mmoe.study.settings import CLAIM_IDS, DEFAULT, FAST, GPU, GPU_TASKS, PRESETS
from mmoe.study.verdicts import NOT_RUN, UNINFORMATIVE

#: The default and fast presets' pre-trainings and training stages as the code listed them before the presets chose
#: their claims (``fast-with-tasks``: the fast preset with the task order trained).
RUN_LISTS = Path(__file__).resolve().parent / "data" / "run_lists.json"
GPU_PRESETS = ("gpu", "gpu-tasks")
#: Each task's chance level in the synthetic measures below (VQA in percent, NLVR2 a fraction, CIDEr).
CHANCE = {"vqav2": 30.0, "nlvr2": 0.5, "captioning": 0.05}


def training_keys(settings, out: Path) -> tuple[set[str], set[str]]:
    """The pre-training stages (random inits included) and fine-tuning stages a study of ``settings`` would run."""
    keys = [str(stage.key) for stage in study_stages(StudyRun(out, settings.training), settings)]
    pretrain = {key for key in keys if key.startswith("pretrain/") and key.count("/") == 1}
    return pretrain, {key for key in keys if key.startswith("finetune/") and key.count("/") == 2}


def planned_keys(settings, preset: str) -> tuple[set[str], set[str]]:
    """The runs the plan of ``preset`` names, and the backbone (pre-training or random init) of each fine-tuning."""
    runs = {run for claim in study_plan(settings, preset).claims for arm in claim.arms for run in arm.runs}
    finetune = {run for run in runs if run.startswith("finetune/")}
    backbones = {f"pretrain/{run.split('/')[1]}" for run in finetune}
    return {run for run in runs if run.startswith("pretrain/")} | backbones, finetune


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_a_gpu_study_launches_exactly_its_plans_runs(preset, tmp_path):
    settings = PRESETS[preset]
    pretrain, finetune = training_keys(settings, tmp_path)
    assert (pretrain, finetune) == planned_keys(settings, preset)
    trained = {f"pretrain/{run.name}" for run in pretrainings(settings)}
    assert trained == {key for key in pretrain if "random-init" not in key}
    assert not list(tmp_path.iterdir())  # nothing trained, nothing written


def test_the_task_variants_are_pre_trained_once_per_seed_under_their_plan_names():
    runs = pretrainings(GPU_TASKS)
    assert [(run.name, run.variant, run.seed) for run in runs] == [
        (f"{variant}-seed{seed}", variant, seed) for variant in ("dense", "xmoe", "mhmoe") for seed in range(3)
    ]
    assert {run.steps for run in runs} == {2000}
    assert "stratified" not in {run.name for run in pretrainings(GPU)}


@pytest.mark.parametrize("preset", ["default", "fast", "fast-with-tasks"])
def test_the_default_and_fast_presets_launch_what_they_did_before(preset, tmp_path):
    settings = dataclasses.replace(FAST, run_tasks=True) if preset == "fast-with-tasks" else PRESETS[preset]
    before = json.loads(RUN_LISTS.read_text())[preset]
    assert [dataclasses.asdict(run) for run in pretrainings(settings)] == [
        run | {"moe": tuple(tuple(pair) for pair in run["moe"])} for run in before["pretrainings"]
    ]
    out = Path("/nonexistent")  # the stored keys were listed under this folder; stage keys do not name it
    assert [str(stage.key) for stage in study_stages(StudyRun(out, settings.training), settings)] == before["stages"]


def task_measures(offsets: dict[str, dict[str, float]], seed: int = 0) -> Measures:
    """Measures of a ``--scale gpu-tasks`` run: per variant and task, 3 pre-trainings (each its own offset around the
    variant's mean in ``offsets``) x 3 fine-tuning seeds; nothing else measured."""
    rng = np.random.default_rng(seed)
    spread = {"vqav2": 1.5, "nlvr2": 0.01, "captioning": 0.01}  # the spread of pre-trainings, about 3x fine-tunings'
    by_pretraining: dict = {}
    for variant, means in offsets.items():
        for task, score, _ in TASK_SCORES:
            pretrained = means[task] + spread[task] * rng.standard_normal(3)
            by_pretraining.setdefault(variant, {})[task] = [
                [{score: float(value + spread[task] / 3 * rng.standard_normal())} for _ in range(3)]
                for value in pretrained
            ]
    flat = {v: {t: [run for runs in per for run in runs] for t, per in tasks.items()}
            for v, tasks in by_pretraining.items()}  # fmt: skip
    return Measures({}, {}, {}, {}, flat, {}, {}, {}, CHANCE, task_pretrainings=by_pretraining)


ORDERED = {"mhmoe": {"vqav2": 58.0, "nlvr2": 0.60, "captioning": 0.35},
           "xmoe": {"vqav2": 50.0, "nlvr2": 0.59, "captioning": 0.34},
           "dense": {"vqav2": 42.0, "nlvr2": 0.57, "captioning": 0.33}}  # fmt: skip


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, by hand."""
    order = np.argsort(p_values)
    adjusted, running = [0.0] * len(p_values), 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[index]))
        adjusted[index] = running
    return adjusted


def test_claim_6_is_decided_over_the_pre_trainings_means_with_holm():
    stats = pytest.importorskip("scipy.stats", reason="the hand computation's Welch p-values are scipy's")
    measures, plan = task_measures(ORDERED), study_plan(GPU_TASKS, "gpu-tasks")
    claims = claims_from(measures, plan)
    decision = next(d for d in run_decisions(claims, plan, measures) if d["id"] == "tasks")
    expected, p_values = [], []
    for task, score, _ in TASK_SCORES:
        for upper, lower in zip(TASK_ORDER, TASK_ORDER[1:], strict=False):
            a, b = ([np.mean([run[score] for run in runs]) for runs in measures.task_pretrainings[v][task]]
                    for v in (upper, lower))  # fmt: skip
            p_values.append(stats.ttest_ind(a, b, equal_var=False).pvalue)
            expected.append((task, [upper, lower], float(np.mean(a) - np.mean(b))))
    adjusted = holm(p_values)
    assert [(g["task"], g["pair"]) for g in decision["gaps"]] == [(task, pair) for task, pair, _ in expected]
    for gap, (_, _, difference), p, holm_p in zip(decision["gaps"], expected, p_values, adjusted, strict=True):
        assert gap["welch"]["runs"] == [3, 3]  # the pre-trainings, not the 9 fine-tunings
        assert gap["welch"]["difference"] == pytest.approx(difference)
        assert gap["welch"]["p_value"] == pytest.approx(p, rel=1e-6)
        assert gap["holm_p"] == pytest.approx(holm_p, rel=1e-6)
        assert (gap["verdict"] == "reproduces") == (holm_p <= 0.05 and difference > 0)
    assert decision["multiplicity"] == "holm" and any(g["verdict"] == "reproduces" for g in decision["gaps"])
    # The arms count their deciding units, the pre-trainings; the fine-tunings averaged within them stand beside.
    assert decision["runs_per_arm"] == [3] * 9 and decision["fine_tunings_per_arm"] == [9] * 9
    assert decision_text(decision).startswith("3 run(s) per arm (of 9 fine-tunings per arm); unit: pre-training run")
    assert plan.claim("tasks").runs_text() == "9 (fine-tunings of 3 backbone(s) per arm)"
    held_back = [g for g in decision["gaps"] if g["unadjusted_verdict"] == "reproduces" != g["verdict"]]
    assert [(g["task"], g["pair"]) for g in held_back] == [("nlvr2", ["xmoe", "dense"])]  # p 0.017, Holm's 0.067


def test_claim_6_is_uninformative_on_a_task_where_a_variant_is_at_chance():
    at_chance = {variant: means | {"captioning": CHANCE["captioning"] - 0.04} if variant == "dense" else means
                 for variant, means in ORDERED.items()}  # fmt: skip
    measures, plan = task_measures(at_chance), study_plan(GPU_TASKS, "gpu-tasks")
    decision = next(d for d in run_decisions(claims_from(measures, plan), plan, measures) if d["id"] == "tasks")
    assert decision["tasks"]["captioning"] == UNINFORMATIVE and decision["tasks"]["vqav2"] != UNINFORMATIVE


def test_a_claim_outside_the_preset_is_not_measured_and_names_who_runs_it(tmp_path):
    measures, plan = task_measures(ORDERED), study_plan(GPU_TASKS, "gpu-tasks")
    claims = claims_from(measures, plan)
    assert [claim.id for claim in claims] == list(CLAIM_IDS)
    not_run = {claim.id: claim for claim in claims if claim.verdict == NOT_RUN}
    assert set(not_run) == set(CLAIM_IDS) - set(GPU_TASKS.claims)
    assert not_run["activation"].summary == "not run (preset gpu-tasks): run by the default preset (mmoe study claims)"
    assert not_run["pretraining"].summary.endswith("run by the default preset (mmoe study claims) and --scale gpu")
    decisions = run_decisions(claims, plan, measures)
    assert {d["id"] for d in decisions if d["verdict"] == NOT_RUN} == set(not_run)
    text = decision_text(next(d for d in decisions if d["id"] == "capacity"))
    assert "run by the default preset" in text and "nothing trained" in text
    report = write_report(claims, tmp_path, "# header", {}, CHANCE, claim_settings(GPU_TASKS, "gpu-tasks"), [],
                          decisions)  # fmt: skip
    assert set(report["figures"]) == {"tasks"}  # a claim not run draws nothing
    assert report["claim_settings"]["fluctuation"].startswith("not run under this preset (run by the default preset")


def test_the_gpu_presets_claim_settings_name_the_preset_that_runs_each_other_claim():
    settings = claim_settings(GPU, "gpu")
    assert settings["tasks"].startswith("not run under this preset (run by --scale gpu-tasks): dense, xmoe, mhmoe")
    assert not settings["fluctuation"].startswith("not run") and not settings["pretraining"].startswith("not run")
    assert claim_settings(DEFAULT)["tasks"].startswith("not run under this preset (run by --scale gpu-tasks)")


def test_the_analysis_collects_task_scores_per_pre_training_and_skips_what_was_not_trained(tmp_path):
    from mmoe.study.measure_runs import backbone_measures, consistency_of, task_scores_by_pretraining

    study = StudyRun(tmp_path, GPU_TASKS.training)
    for backbone, variant, seed in [(f"{v}-seed{s}", v, s) for v in ("dense", "xmoe", "mhmoe") for s in range(3)]:
        for task, score, _ in TASK_SCORES:
            for tuning in range(GPU_TASKS.task_seeds):
                layout = study.finetuning(backbone, task, tuning)
                layout.scores.parent.mkdir(parents=True, exist_ok=True)
                layout.scores.write_text(json.dumps({score: 100 * seed + tuning, "variant": variant}))
    by_pretraining = task_scores_by_pretraining(study, GPU_TASKS)
    assert set(by_pretraining) == {"dense", "xmoe", "mhmoe"}
    vqa = by_pretraining["xmoe"]["vqav2"]
    assert [[run["overall"] for run in runs] for runs in vqa] == [[0, 1, 2], [100, 101, 102], [200, 201, 202]]
    assert {run["variant"] for runs in vqa for run in runs} == {"xmoe"}
    assert consistency_of(study, GPU_TASKS, "frozen") == {} and backbone_measures(study, GPU_TASKS) == {}
    assert task_scores_by_pretraining(StudyRun(tmp_path, GPU.training), GPU) == {}
