"""Claims 1, 3 and 4 decided over the routing seeds (:mod:`mmoe.study.routing_decisions`) on hand-made per-seed
measures, checked against the per-run statistic computed by hand; claim 7's image bootstrap against a direct loop;
the routing runs' seed and constant learning rate; ``--dry-run``."""

from __future__ import annotations

import contextlib
import dataclasses
import io
from pathlib import Path

import numpy as np
import pytest

from mmoe.cli import main
from mmoe.study.decisions import short_verdict
from mmoe.study.plan_design import study_plan
from mmoe.study.routing_decisions import (
    NOT_MEASURED,
    activation_gaps,
    collapse_gap,
    fluctuation_gap,
    image_interval,
    routing_decision,
)
from mmoe.study.settings import DEFAULT
from mmoe.study.verdicts import NOT_SEPARATED, OPPOSITE, REPRODUCES, UNINFORMATIVE

PLAN = study_plan(DEFAULT, "default")
LAYERS = ("layer1/language", "layer3/language", "layer1/vision")


def _snapshot(step: int, rc: float, changed: int | None, loads=(25, 25, 25, 25)) -> dict:
    """Every layer with RC ``rc``; ``changed`` of 100 tokens per held-out batch changed expert (None: the first)."""
    fluctuation = (
        None if changed is None else {key: {"changed": [changed] * 4, "compared": [100] * 4} for key in LAYERS}
    )
    return {"step": step, "collapse": {key: {"rc": rc, "classes": 4} for key in LAYERS},
            "loads": {key: list(loads) for key in LAYERS}, "fluctuation": fluctuation}  # fmt: skip


def _run(rc: float, changed: int, snapshots: int = 11, loads=(25, 25, 25, 25)) -> list[dict]:
    return [_snapshot(10 * i, rc, None if i == 0 else changed, loads) for i in range(snapshots)]


def _seeds(xmoe_rc, switch_rc, xmoe_changed=(10, 10, 10), switch_changed=(40, 40, 40), loads=(25, 25, 25, 25)):
    """Per routing seed, X-MoE's and Switch's snapshots: RC and the tokens that changed expert, one value per seed."""
    seeds = []
    for seed, (x, s, cx, cs) in enumerate(zip(xmoe_rc, switch_rc, xmoe_changed, switch_changed, strict=True)):
        seeds.append(
            {"seed": seed, "snapshots": {"xmoe": _run(x, cx, loads=loads), "switch": _run(s, cs, loads=loads)}}
        )
    return seeds


def test_tiny_within_run_noise_and_large_run_to_run_spread_is_not_separated_over_routing_seeds():
    """Seed 0's within-run interval is tight and on the paper's side, but the routing seeds disagree: the decision
    over runs is not separated; with seeds that agree it reproduces."""
    rules = PLAN.claim("collapse")
    tight = [0.40, 0.42]  # seed 0's log ratio interval over router-input rows
    spread = collapse_gap(_seeds([3.0, 0.5, 9.0], [2.0, 4.0, 0.6]), rules, "language", tight)
    assert spread["within_run"] == tight and spread["verdict"] == NOT_SEPARATED
    # the per-run statistic: the window's mean log RC over every language layer
    assert spread["per_run"]["xmoe"] == pytest.approx(np.log([3.0, 0.5, 9.0]))
    agreeing = collapse_gap(_seeds([3.0, 3.1, 2.9], [1.0, 1.1, 0.9]), rules, "language", tight)
    assert agreeing["verdict"] == REPRODUCES and agreeing["welch"]["runs"] == [3, 3]


def test_a_run_whose_rc_is_undefined_in_the_window_leaves_its_arm_and_is_counted():
    seeds = _seeds([3.0, 3.1, 2.9], [1.0, 1.1, 0.9])
    seeds[1]["snapshots"]["switch"][-1]["collapse"]["layer3/language"]["rc"] = None  # one class: RC undefined
    gap = collapse_gap(seeds, PLAN.claim("collapse"), "language", None)
    assert gap["undefined_runs"] == {"xmoe": 0, "switch": 1} and gap["welch"]["runs"] == [3, 2]
    assert gap["per_run"]["switch"][1] is None


def test_an_arm_left_with_fewer_than_two_runs_of_defined_rc_says_so_and_the_other_modality_still_shows():
    """The plan's rule (a run whose RC is undefined leaves its arm) can leave an arm under two runs: the language
    verdict says RC was undefined, in how many runs of each arm, and the summary and the decision text still give
    the vision verdict beside it (both modalities stand, the paper's first)."""
    from mmoe.study.claims import Claim
    from mmoe.study.decisions import decision_text, run_decisions
    from mmoe.study.runs import Measures

    seeds = _seeds([3.0, 3.1, 2.9], [1.0, 1.1, 0.9])
    for seed in (0, 1):
        seeds[seed]["snapshots"]["switch"][-1]["collapse"]["layer1/language"]["rc"] = None
    gap = collapse_gap(seeds, PLAN.claim("collapse"), "language", None)
    assert gap["verdict"] == "undecidable: RC undefined in the window (xmoe 0 of 3, switch 2 of 3 runs)"
    claim = Claim("collapse", "title", "paper", {"by_modality": {}}, NOT_SEPARATED, "statement")
    required = ("activation", "diversity", "snapshots", "consistency", "scores", "random_init", "capacity",
                "token_capacity", "chance")  # fmt: skip
    measures = Measures.from_json(dict.fromkeys(required, {}) | {"seeded": {"seeds": seeds}})
    decision = next(d for d in run_decisions([claim], PLAN, measures) if d["id"] == "collapse")
    assert decision["modalities"] == {"language": gap["verdict"], "vision": REPRODUCES}
    assert short_verdict(decision) == f"language (the paper's): {gap['verdict']}; vision: reproduces"
    text = decision_text(decision)
    assert f"language: {gap['verdict']}" in text and "vision: " in text and "covers one run of each arm" not in text


def test_fluctuation_is_decided_over_runs_and_gated_at_random_reassignment():
    rules = PLAN.claim("fluctuation")
    less = fluctuation_gap(_seeds([1] * 3, [1] * 3, (10, 12, 11), (40, 42, 41)), rules, "language", None)
    assert less["verdict"] == REPRODUCES  # X-MoE changes expert less: the paper's sign is negative
    assert less["per_run"]["xmoe"] == pytest.approx([0.10, 0.12, 0.11])
    more = fluctuation_gap(_seeds([1] * 3, [1] * 3, (40, 42, 41), (10, 12, 11)), rules, "language", None)
    assert more["verdict"] == OPPOSITE
    # flat loads over 4 experts: a random reassignment changes 75% of tokens; both at 70-74% >= 0.9 x 75%
    random = fluctuation_gap(_seeds([1] * 3, [1] * 3, (70, 71, 72), (72, 73, 74)), rules, "language", None)
    assert random["verdict"] == UNINFORMATIVE and random["random_reassignment"]["xmoe"] == pytest.approx([0.75] * 3)


def _activation(heads: int, busy: int) -> dict:
    """32 experts: ``busy`` of them share the choices evenly, on every held-out batch, both modalities."""
    loads = [[100 / busy] * busy + [0] * (32 - busy)] * 4
    return {"heads": heads, "loads": {"layer1/language": loads, "layer1/vision": loads},
            "tokens": {"layer1/language": [100] * 4, "layer1/vision": [100] * 4}}  # fmt: skip


def _activation_seeds(busy: dict[int, list[int]]) -> list[dict]:
    seeds = len(next(iter(busy.values())))
    return [{"seed": s, "activation": {f"h{h}": _activation(h, values[s]) for h, values in busy.items()}}
            for s in range(seeds)]  # fmt: skip


def test_activation_rises_over_runs_with_holm_over_its_two_gaps():
    rules = PLAN.claim("activation")
    rising = activation_gaps(_activation_seeds({1: [8, 9, 10], 4: [16, 17, 18], 8: [28, 29, 30]}), rules, "language",
                             None)  # fmt: skip
    assert rising["per_run"]["h=1"] == pytest.approx([8 / 32, 9 / 32, 10 / 32])  # share of choices, by hand
    assert [gap["pair"] for gap in rising["gaps"]] == [["h=8", "h=1"], ["h=8", "h=4"]]
    assert all(gap["holm_p"] >= gap["welch"]["p_value"] for gap in rising["gaps"])
    assert rising["verdict"] == REPRODUCES
    falling = activation_gaps(_activation_seeds({1: [8, 9, 10], 4: [28, 29, 30], 8: [16, 17, 18]}), rules,
                              "language", None)  # fmt: skip
    assert falling["verdict"] == OPPOSITE  # h=8 below h=4 beyond the noise


def test_both_modalities_are_decided_and_the_paper_s_comes_first():
    rules = PLAN.claim("collapse")
    seeds = {"seeds": _seeds([3.0, 3.1, 2.9], [1.0, 1.1, 0.9])}
    by_modality = routing_decision("collapse", {"by_modality": {}}, rules, seeds)
    assert list(by_modality) == ["language", "vision"]
    assert by_modality["language"]["verdict"] == by_modality["vision"]["verdict"] == REPRODUCES
    assert routing_decision("collapse", {}, rules, {})["language"]["verdict"] == NOT_MEASURED
    decision = {"verdict": REPRODUCES, "modalities": {"language": REPRODUCES, "vision": NOT_SEPARATED}}
    assert short_verdict(decision) == "language (the paper's): reproduces; vision: not separated"


def test_the_image_bootstrap_resamples_images_and_matches_a_direct_loop():
    generator = np.random.default_rng(3)
    questions = generator.integers(1, 6, 40)

    def run(shift: float) -> dict:
        accuracy = np.clip(generator.uniform(0.2, 0.8, 40) + shift, 0, 1)
        return {"images": [str(i) for i in range(40)], "questions": questions.tolist(),
                "sums": (accuracy * questions).tolist()}  # fmt: skip

    images = {"pretrained": [run(0.2), run(0.2)], "random_init": [run(0.0), run(0.0)]}
    interval = image_interval(images)
    # the same draws, by hand: each arm's mean over backbones of sum(accuracy sums) / sum(questions) of the images
    draws = np.random.default_rng(0)
    replicates = []
    for _ in range(1000):
        index = draws.integers(0, 40, 40)
        means = [np.mean([np.sum(np.asarray(r["sums"])[index]) / np.sum(questions[index]) for r in images[arm]])
                 for arm in ("pretrained", "random_init")]  # fmt: skip
        replicates.append(100 * (means[0] - means[1]))
    assert interval == pytest.approx(list(np.percentile(replicates, [2.5, 97.5])))
    assert interval[0] > 0
    same = {"pretrained": images["pretrained"], "random_init": images["pretrained"]}
    assert image_interval(same) == pytest.approx([0.0, 0.0])


def test_every_routing_run_has_its_seed_and_a_constant_learning_rate_after_the_warm_up(tmp_path):
    from mmoe.config.run_spec import read_spec
    from mmoe.runtime.optimizer import warmup_cosine
    from mmoe.study.runs import StudyRun, pretraining_spec, pretrainings

    runs = {run.name: run for run in pretrainings(DEFAULT)}
    arms = [name for name in runs if name.endswith(("-seed0", "-seed1", "-seed2")) and "demo" not in name]
    assert len(arms) == 4 * DEFAULT.routing_seeds
    assert {(runs[name].steps, runs[name].min_lr_ratio) for name in arms} == {(100, 1.0)}
    run = runs["xmoe-e32-seed1"]
    study = StudyRun(tmp_path, DEFAULT.training)
    config = read_spec(pretraining_spec(study, run))
    optimizer = config.model.init_args.optimizer
    assert config.seed_everything == 1 and optimizer.min_lr_ratio == 1.0
    assert optimizer.warmup_steps == 30 and optimizer.learning_rate == pytest.approx(1e-3)  # the config's, kept
    schedule = warmup_cosine(optimizer.warmup_steps, run.steps, optimizer.min_lr_ratio)
    assert {schedule(step) for step in range(30, 100)} == {1.0}


def test_dry_run_prints_the_plan_and_its_estimated_cost_and_writes_nothing(tmp_path):
    for options, machine in (([], "the 2-core CPU"), (["--scale", "gpu"], "one H100")):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert main(["study", "claims", *options, "--dry-run", "--out", str(tmp_path / "out")]) == 0
        text = printed.getvalue()
        assert "## Estimated cost" in text and machine in text and "an estimate" in text
        assert "runs per arm: 3" in text or "runs per arm: 8" in text
    assert not Path(tmp_path / "out").exists()


def test_one_sample_verdict_is_students_t_over_the_runs():
    from mmoe.study.run_statistics import one_sample_verdict

    values = [0.2, 0.4, 0.3, 0.5, 0.1]
    gap = one_sample_verdict(values, +1)
    half = 2.776 * np.std(values, ddof=1) / np.sqrt(5)  # t_{0.975, 4} of the published table
    assert gap["welch"]["interval"] == pytest.approx([0.3 - half, 0.3 + half], rel=1e-3)
    assert gap["verdict"] == REPRODUCES and gap["runs"] == [5]
    assert one_sample_verdict([0.2, -0.3, 0.1], +1)["verdict"] == NOT_SEPARATED
    assert one_sample_verdict([0.2], +1)["welch"] is None


def _regions(objects: float, background: float, heads: int = 8, experts: int = 16) -> dict:
    """One run's vision layer: 10 images of 4 object and 12 background patches at the given mean diversity."""
    return {"layer1/vision": {"object_sum": [4 * objects] * 10, "object_patches": [4] * 10,
                              "background_sum": [12 * background] * 10, "background_patches": [12] * 10,
                              "heads": heads, "experts": experts}}  # fmt: skip


def test_claim_2_is_decided_over_the_seeds_of_the_diversity_run():
    from mmoe.study.claims import Claim
    from mmoe.study.decisions import _diversity_decision
    from mmoe.study.settings import DEFAULT

    # the default's single-run arms (h = 4 and 8 over 32 experts) beside an 8-seed diversity run (--scale gpu's)
    settings = dataclasses.replace(DEFAULT, diversity_runs=((8, 16),), diversity_seeds=8)
    rules = study_plan(settings, "default").claim("diversity")
    seeded = next(arm for arm in rules.arms if len(arm.runs) == 8)
    claim = Claim("diversity", "t", "p", {}, NOT_SEPARATED, "s")
    single = {run.removeprefix("pretrain/"): _regions(7.0, 6.0) for arm in rules.arms for run in arm.runs}
    richer = single | {run.removeprefix("pretrain/"): _regions(6.0 + 0.1 * i, 5.0) for i, run in enumerate(seeded.runs)}
    decision = _diversity_decision(claim, rules, richer)
    assert [gap["verdict"] for gap in decision["gaps"]][-1] == REPRODUCES and decision["verdict"] == REPRODUCES
    assert decision["gaps"][0]["welch"] is None  # the arms of one run are not decided
    scattered = single | {run.removeprefix("pretrain/"): _regions(6.0 + (-1) ** i, 6.0) for i, run in
                          enumerate(seeded.runs)}  # fmt: skip
    assert _diversity_decision(claim, rules, scattered)["verdict"] == NOT_SEPARATED
