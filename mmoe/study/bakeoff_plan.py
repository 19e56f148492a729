"""The plan of ``mmoe study routers``, fixed before any run: the routers with their active FLOPs per token, the seeds,
the training settings (steps, corpus, batch), the measures with their units and the test (Welch's t of each router
against Switch top-1 per measure, Holm's correction over the routers, at the plan's alpha).

A plan file is ``{"sha256": ..., "plan": {...}}``: the hash is of the plan's canonical JSON
(:func:`mmoe.study.plan.plan_hash`, as the claims study takes it), so a plan edited after it was fixed no longer
matches its hash and is refused. The plan also refuses a router whose active FLOPs per token differ from the dense
backbone's by more than ``flops_tolerance`` of the dense FFNs' (:func:`mmoe.study.bakeoff_cost.router_flops`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmoe.io import read_json, write_json
from mmoe.pipeline.settings import TrainingSettings
from mmoe.stats import ALPHA, LEVEL
from mmoe.study.bakeoff_cost import router_flops
from mmoe.study.bakeoff_presets import BakeoffPreset
from mmoe.study.bakeoff_routers import BASELINE, ROUTERS, RouterPreset
from mmoe.study.plan import PlanError, PlanReader, plan_hash

BAKEOFF_PLAN_VERSION = 1
#: The largest |FLOPs gap| a router may have, as a share of the dense FFNs' FLOPs per token: a router's scores cost
#: 2 D E FLOPs per token and layer beside its FFN's 4 D F, so 16 experts take 2.1% at the fast preset's width
#: (D = 96, F = 192, an MoE layer every other layer) and 0.5% at the CPU preset's (D = 192, F = 768).
FLOPS_TOLERANCE = 0.03
#: The fine-tuning every backbone gets, the same steps and seed for each.
FINETUNE_TASK = "vqav2"


@dataclass(frozen=True)
class Measure:
    """One measured quantity of a run.

    Attributes:
        name: its key in a run's results.
        what: what it is, in words.
        unit: its unit.
        better: ``higher`` or ``lower``, or ``none`` where neither is better (a routing property).
        tested: whether each router is tested against the baseline on it (not where it is fixed by design).
    """

    name: str
    what: str
    unit: str
    better: str
    tested: bool


MEASURES = (
    Measure("mim_loss", "masked image modelling loss, held-out images masked alone (vision)", "nats", "lower", True),
    Measure("mlm_loss", "masked language modelling loss, held-out pairs (language)", "nats", "lower", True),
    Measure("i2t_r1", "zero-shot image-to-text recall@1 among the held-out pairs", "fraction", "higher", True),
    Measure("t2i_r1", "zero-shot text-to-image recall@1 among the held-out pairs", "fraction", "higher", True),
    Measure("color_acc", "zero-shot colour accuracy of the top object", "fraction", "higher", True),
    Measure("shape_acc", "zero-shot shape accuracy of the top object", "fraction", "higher", True),
    Measure("vqa", "VQAv2 accuracy after the plan's fixed VQA fine-tuning", "%", "higher", True),
    Measure("load_cv_vision", "load CV of the vision MoE layers (mean over layers)", "std/mean", "lower", True),
    Measure("load_cv_language", "load CV of the language MoE layers (mean over layers)", "std/mean", "lower", True),
    Measure("experts_vision", "experts per vision token (mean over MoE layers)", "experts", "none", False),
    Measure("experts_language", "experts per language token (mean over MoE layers)", "experts", "none", False),
)


@dataclass(frozen=True)
class PlannedRouter:
    """A router as the plan fixes it: its preset's fields and its counted FLOPs (:mod:`mmoe.study.bakeoff_cost`)."""

    name: str
    backbone: dict[str, Any]
    active_flops_per_token: int
    flops_gap: float


@dataclass(frozen=True)
class BakeoffTest:
    """How a router's difference from the baseline is decided, per measure.

    Attributes:
        name: ``welch``: Welch's t over the seeds (each seed one pre-training).
        against: the baseline router.
        multiplicity: ``holm``: Holm's step-down over the routers tested on the measure.
        level: the intervals' coverage.
        alpha: the family-wise error rate per measure.
    """

    name: str = "welch"
    against: str = BASELINE
    multiplicity: str = "holm"
    level: float = LEVEL
    alpha: float = ALPHA


@dataclass(frozen=True)
class BakeoffPlan:
    """The bake-off's plan (the module docstring)."""

    preset: str
    routers: tuple[PlannedRouter, ...]
    seeds: tuple[int, ...]
    training: dict[str, Any]
    measures: tuple[Measure, ...]
    test: BakeoffTest
    flops_tolerance: float
    analysis_batches: int
    analysis_batch_size: int
    design_notes: tuple[str, ...] = ()
    version: int = BAKEOFF_PLAN_VERSION

    def to_json(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def settings(self) -> TrainingSettings:
        return TrainingSettings(**self.training)

    def router(self, name: str) -> PlannedRouter:
        return next(router for router in self.routers if router.name == name)

    @property
    def pretrain_steps(self) -> int:
        return int(self.training["pretrain_steps"])

    @property
    def finetune_steps(self) -> int:
        return int(self.training["finetune_steps"][FINETUNE_TASK])


def design(
    preset: BakeoffPreset, seeds: tuple[int, ...] | None = None, presets: tuple[RouterPreset, ...] = ROUTERS
) -> BakeoffPlan:
    """The plan of ``preset`` (at ``seeds`` where given): every router of ``presets`` (all of :data:`ROUTERS`; a
    subset keeps a test short) with its FLOPs counted; PlanError naming a router off the dense FLOPs."""
    settings = preset.training
    routers = tuple(
        PlannedRouter(router.name, json.loads(json.dumps(router.backbone)), **router_flops(settings, router.backbone))
        for router in presets
    )
    plan = BakeoffPlan(
        preset=preset.name,
        routers=routers,
        seeds=tuple(range(preset.seeds)) if seeds is None else tuple(seeds),
        training=settings.to_json(),
        measures=MEASURES,
        test=BakeoffTest(),
        flops_tolerance=FLOPS_TOLERANCE,
        analysis_batches=preset.analysis_batches,
        analysis_batch_size=preset.analysis_batch_size,
        design_notes=preset.notes,
    )
    check_plan(plan, "the design")
    return plan


def check_plan(plan: BakeoffPlan, where: str) -> None:
    """PlanError where a router's FLOPs are off the dense backbone's by more than the tolerance or not those its
    fields count to, with under 3 seeds, or without the baseline."""
    if len(set(plan.seeds)) < 3 or len(set(plan.seeds)) != len(plan.seeds):
        raise PlanError(f"{where}: seeds is {list(plan.seeds)}, expected at least 3 distinct seeds")
    if BASELINE not in {router.name for router in plan.routers} or plan.test.against != BASELINE:
        raise PlanError(f"{where}: test.against is {plan.test.against!r}, expected {BASELINE!r}, one of the routers")
    for index, router in enumerate(plan.routers):
        try:
            counted = router_flops(plan.settings(), router.backbone)
        except (TypeError, ValueError) as error:
            raise PlanError(
                f"{where}: routers[{index}].backbone of {router.name!r} is not a backbone: {error}"
            ) from None
        if router.active_flops_per_token != counted["active_flops_per_token"]:
            raise PlanError(
                f"{where}: routers[{index}].active_flops_per_token is {router.active_flops_per_token}, expected "
                f"{counted['active_flops_per_token']} (what mmoe info counts for {router.name!r})"
            )
        if abs(counted["flops_gap"]) > plan.flops_tolerance:
            raise PlanError(
                f"{where}: router {router.name!r} has {counted['flops_gap']:+.2%} of the dense FFNs' FLOPs per token "
                f"beyond the dense backbone's, expected at most ±{plan.flops_tolerance:.0%} (equal active compute)"
            )


def write_plan_file(plan: BakeoffPlan, path: Path) -> str:
    """``path``: the plan and its hash (whole or absent); returns the hash."""
    digest = plan_hash(plan)
    write_json(path, {"sha256": digest, "plan": plan.to_json()})
    return digest


def read_plan_file(path: Path) -> tuple[BakeoffPlan, str]:
    """The plan in ``path`` and its hash; PlanError (one line naming the file and the field) for a file that is not
    a plan, or whose hash is not that of its plan."""
    value = read_json(path, "bake-off plan", PlanError)
    reader = PlanReader(str(path))
    fields = reader.mapping(value, "file", ("sha256", "plan"))
    plan = plan_from_json(fields["plan"], str(path))
    digest = plan_hash(plan)
    if fields["sha256"] != digest:
        raise reader.fail("sha256", fields["sha256"], f"{digest}, the hash of the plan it holds (edited after fixed?)")
    return plan, digest


def plan_from_json(value: Any, where: str) -> BakeoffPlan:
    """The plan of a decoded ``plan`` object; PlanError naming ``where`` and the first invalid field."""
    reader = PlanReader(where)
    names = tuple(field.name for field in dataclasses.fields(BakeoffPlan))
    fields = reader.mapping(value, "plan", names)
    if fields["version"] != BAKEOFF_PLAN_VERSION:
        raise reader.fail("plan.version", fields["version"], str(BAKEOFF_PLAN_VERSION))
    routers = tuple(
        _router(reader, item, f"plan.routers[{i}]")
        for i, item in enumerate(reader.items(fields["routers"], "plan.routers", 2))
    )
    seeds = tuple(
        reader.integer(s, f"plan.seeds[{i}]") for i, s in enumerate(reader.items(fields["seeds"], "plan.seeds", 3))
    )
    measures = tuple(
        _measure(reader, item, f"plan.measures[{i}]")
        for i, item in enumerate(reader.items(fields["measures"], "plan.measures", 1))
    )
    plan = BakeoffPlan(
        preset=reader.text(fields["preset"], "plan.preset"),
        routers=routers,
        seeds=seeds,
        training=_training(reader, fields["training"]),
        measures=measures,
        test=_test(reader, fields["test"]),
        flops_tolerance=reader.number(fields["flops_tolerance"], "plan.flops_tolerance", 0.0, 0.5),
        analysis_batches=reader.integer(fields["analysis_batches"], "plan.analysis_batches", 1),
        analysis_batch_size=reader.integer(fields["analysis_batch_size"], "plan.analysis_batch_size", 1),
        design_notes=tuple(
            reader.text(n, f"plan.design_notes[{i}]")
            for i, n in enumerate(reader.items(fields["design_notes"], "plan.design_notes"))
        ),
    )
    check_plan(plan, where)
    return plan


def _router(reader: PlanReader, value: Any, path: str) -> PlannedRouter:
    fields = reader.mapping(value, path, tuple(field.name for field in dataclasses.fields(PlannedRouter)))
    if not isinstance(fields["backbone"], dict):
        raise reader.fail(f"{path}.backbone", fields["backbone"], "an object of backbone fields")
    return PlannedRouter(
        reader.text(fields["name"], f"{path}.name"),
        fields["backbone"],
        reader.integer(fields["active_flops_per_token"], f"{path}.active_flops_per_token", 1),
        reader.number(fields["flops_gap"], f"{path}.flops_gap", -1.0, 1e6),
    )


def _measure(reader: PlanReader, value: Any, path: str) -> Measure:
    fields = reader.mapping(value, path, tuple(field.name for field in dataclasses.fields(Measure)))
    known = {measure.name for measure in MEASURES}
    if not isinstance(fields["tested"], bool):
        raise reader.fail(f"{path}.tested", fields["tested"], "true or false")
    return Measure(
        reader.text(fields["name"], f"{path}.name", tuple(sorted(known))),
        reader.text(fields["what"], f"{path}.what"),
        reader.text(fields["unit"], f"{path}.unit"),
        reader.text(fields["better"], f"{path}.better", ("higher", "lower", "none")),
        fields["tested"],
    )


def _test(reader: PlanReader, value: Any) -> BakeoffTest:
    fields = reader.mapping(value, "plan.test", tuple(field.name for field in dataclasses.fields(BakeoffTest)))
    return BakeoffTest(
        reader.text(fields["name"], "plan.test.name", ("welch",)),
        reader.text(fields["against"], "plan.test.against"),
        reader.text(fields["multiplicity"], "plan.test.multiplicity", ("holm",)),
        reader.number(fields["level"], "plan.test.level", 0.5, 0.999),
        reader.number(fields["alpha"], "plan.test.alpha", 0.001, 0.5),
    )


def _training(reader: PlanReader, value: Any) -> dict[str, Any]:
    """The plan's training settings, checked by building them."""
    names = tuple(field.name for field in dataclasses.fields(TrainingSettings))
    fields = reader.mapping(value, "plan.training", names)
    steps = fields["finetune_steps"]
    if not isinstance(steps, dict) or set(steps) != {FINETUNE_TASK}:
        raise reader.fail("plan.training.finetune_steps", steps, f'{{"{FINETUNE_TASK}": steps}}')
    reader.integer(steps[FINETUNE_TASK], f"plan.training.finetune_steps.{FINETUNE_TASK}", 1)
    reader.integer(fields["pretrain_steps"], "plan.training.pretrain_steps", 1)
    try:
        return TrainingSettings(**fields).to_json()
    except (TypeError, ValueError) as error:
        raise reader.fail("plan.training", fields, f"valid training settings ({error})") from None
