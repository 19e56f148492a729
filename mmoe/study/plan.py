"""The study's plan, fixed before its runs: per claim, the arms with their runs and seeds, the steps and schedule, the
layers and modalities measured, the window, the gates, the noise rule and the multiplicity correction, and the rule
changes made after results were seen (each claim's verdict is then shown under the old rule beside the new).

A plan is a tree of frozen dataclasses with a JSON round trip (:meth:`StudyPlan.to_json`, :func:`plan_from_json`):
a hand-edited file is checked field by field and refused in one line naming the field, the value and what was
expected (:class:`PlanError`). Its hash (:func:`plan_hash`, SHA-256 of the canonical JSON) is recorded with every
stage the study runs and in the report; the claims read their rules from it (:meth:`StudyPlan.claim`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmoe.io import json_excerpt
from mmoe.stats import ALPHA, LEVEL, POWER

PLAN_VERSION = 1
#: The layers a claim is judged on: every MoE layer of the modality, those whose value is defined at every
#: measurement, or those defined throughout its window.
LAYER_RULES = ("all", "defined_at_every_snapshot", "defined_in_window")
MULTIPLICITY = ("none", "holm")
MODALITY_NAMES = ("language", "vision")


class PlanError(ValueError):
    """A plan file that is not a valid plan: the message names the file, the field, the value and what was
    expected."""


@dataclass(frozen=True)
class Arm:
    """One side of a comparison.

    Attributes:
        name: what the report calls it (``switch``, ``mhmoe h=8``).
        runs: the training runs (folders under the study's directory) whose measurements make the arm.
        seeds: their training seeds, one per run.
        steps: optimiser steps of each run.
        measured_at: the step the arm is measured at (``steps`` for the end of the run).
    """

    name: str
    runs: tuple[str, ...]
    seeds: tuple[int, ...]
    steps: int
    measured_at: int

    def backbones(self) -> int:
        """How many distinct backbones the arm's runs start from: a fine-tuning run
        (``finetune/<backbone>/<task>-seed<k>``) counts its pre-training or random init, a pre-training run itself."""
        return len({run.split("/")[1] if run.startswith("finetune/") else run for run in self.runs})


@dataclass(frozen=True)
class NoiseRule:
    """How a difference becomes a verdict.

    Attributes:
        unit: the independent unit of the deciding interval (``training run``: a Welch interval over runs).
        within_run: the resampling inside a run, reported as a secondary interval (not a verdict).
        level: the intervals' coverage.
        alpha: the family-wise error rate of the decisions.
        power: the power at which the smallest detectable effect is reported.
    """

    unit: str
    within_run: str
    level: float = LEVEL
    alpha: float = ALPHA
    power: float = POWER


@dataclass(frozen=True)
class ClaimPlan:
    """What one claim compares and how it is judged.

    Attributes:
        id: the claim's id (:class:`mmoe.study.claims.Claim`).
        arms: the compared arms, in the paper's predicted order (the first above the next).
        schedule: the learning-rate schedule of the arms' runs.
        layers: which MoE layers are kept (:data:`LAYER_RULES`).
        modalities: the modalities measured.
        paper_modality: the modality the paper measured (its verdict is the claim's).
        window_from: share of the snapshots or windows (in order) before the judged window (0.5: the second half;
            None where the claim has no window).
        gates: named thresholds of the gates (saturation, chance, random routing) and measurement constants.
        noise_rule: the interval that decides and the one reported beside it.
        multiplicity: the family-wise correction over the claim's gaps (:data:`MULTIPLICITY`).
    """

    id: str
    arms: tuple[Arm, ...]
    schedule: str
    layers: str
    modalities: tuple[str, ...]
    paper_modality: str
    window_from: float | None
    gates: dict[str, float]
    noise_rule: NoiseRule
    multiplicity: str

    def gate(self, name: str) -> float:
        """The gate ``name``; KeyError naming the claim when the plan does not state it."""
        if name not in self.gates:
            raise KeyError(f"the plan states no gate {name!r} for claim {self.id!r}")
        return self.gates[name]

    def runs_per_arm(self) -> list[int]:
        return [len(arm.runs) for arm in self.arms]

    def backbones_per_arm(self) -> list[int]:
        """Per arm, the distinct backbones its runs start from (:meth:`Arm.backbones`): fewer than its runs where
        several fine-tunings share a pre-training."""
        return [arm.backbones() for arm in self.arms]

    def runs_text(self) -> str:
        """Runs per arm in words (``3``, ``3/4``; ``9 (fine-tunings of 3 backbones per arm)`` where fine-tunings share
        pre-trainings; ``none``)."""
        runs = "/".join(map(str, sorted(set(self.runs_per_arm())))) or "none"
        backbones = self.backbones_per_arm()
        if backbones == self.runs_per_arm():
            return runs
        return f"{runs} (fine-tunings of {'/'.join(map(str, sorted(set(backbones))))} backbone(s) per arm)"

    @property
    def not_run(self) -> bool:
        """Whether the preset trains none of the claim's runs (every arm without runs)."""
        return all(not arm.runs for arm in self.arms)


@dataclass(frozen=True)
class RuleChange:
    """A rule changed after results were seen.

    Attributes:
        claim: the claim's id.
        rule: the changed field of its :class:`ClaimPlan` (``window_from``, ``layers``, ``paper_modality``,
            ``multiplicity``) or ``gates.<name>``.
        old: the value before.
        new: the value now (the plan's).
        why: the reason, in a sentence.
        date: when (ISO date).
    """

    claim: str
    rule: str
    old: Any
    new: Any
    why: str
    date: str


@dataclass(frozen=True)
class StudyPlan:
    """The plan of one study: its preset, each claim's plan, the rule changes (after results were seen) and the
    design notes (why the design is what it is, and what changed from an earlier plan before any run of this one)."""

    preset: str
    claims: tuple[ClaimPlan, ...]
    rule_changes: tuple[RuleChange, ...] = ()
    version: int = PLAN_VERSION
    design_notes: tuple[str, ...] = ()

    def claim(self, claim_id: str) -> ClaimPlan:
        for claim in self.claims:
            if claim.id == claim_id:
                return claim
        raise KeyError(f"the plan has no claim {claim_id!r}")

    def to_json(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def under_old_rule(self, change: RuleChange) -> StudyPlan:
        """This plan with ``change``'s rule set back to its old value."""
        claims = tuple(
            with_rule(claim, change.rule, change.old) if claim.id == change.claim else claim for claim in self.claims
        )
        return dataclasses.replace(self, claims=claims, rule_changes=())


def with_rule(claim: ClaimPlan, rule: str, value: Any) -> ClaimPlan:
    """``claim`` with ``rule`` (a field name or ``gates.<name>``) set to ``value``."""
    if rule.startswith("gates."):
        return dataclasses.replace(claim, gates={**claim.gates, rule.removeprefix("gates."): value})
    return dataclasses.replace(claim, **{rule: value})


def canonical_json(plan: StudyPlan) -> str:
    """The plan as canonical JSON (sorted keys, no white space): what its hash is taken of."""
    return json.dumps(plan.to_json(), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def plan_hash(plan: StudyPlan) -> str:
    """SHA-256 of the plan's canonical JSON (hex)."""
    return hashlib.sha256(canonical_json(plan).encode("utf-8")).hexdigest()


def write_plan(plan: StudyPlan, path: Path) -> None:
    """The plan as indented JSON at ``path`` (whole or absent)."""
    from mmoe.io import write_json

    write_json(path, plan.to_json())


def read_plan(path: Path) -> StudyPlan:
    """The plan in ``path``; PlanError (one line naming the file and the field) when it is not a valid plan."""
    from mmoe.io import read_json

    return plan_from_json(read_json(path, "study plan", PlanError), str(path))


# -- reading a plan ---------------------------------------------------------------------------------------------------


class PlanReader:
    """Checks the fields of a decoded plan, each error naming the file and the field's path (the claims study's plan
    and the bake-off's)."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, path: str, value: Any, expected: str) -> PlanError:
        return PlanError(f"{self.where}: {path} is {json_excerpt(value)}, expected {expected}")

    def mapping(self, value: Any, path: str, fields: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict:
        if not isinstance(value, dict):
            raise self.fail(path, value, "an object")
        unknown = sorted(set(value) - set(fields) - set(optional))
        if unknown:
            raise self.fail(f"{path}.{unknown[0]}", value[unknown[0]], f"no such field (fields: {', '.join(fields)})")
        missing = [name for name in fields if name not in value]
        if missing:
            raise PlanError(f"{self.where}: {path} lacks the field {missing[0]!r}")
        return value

    def text(self, value: Any, path: str, choices: tuple[str, ...] = ()) -> str:
        if not isinstance(value, str) or not value or (choices and value not in choices):
            raise self.fail(path, value, f"one of {', '.join(choices)}" if choices else "a non-empty string")
        return value

    def integer(self, value: Any, path: str, least: int = 0) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise self.fail(path, value, f"a whole number >= {least}")
        return value

    def number(self, value: Any, path: str, low: float, high: float) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise self.fail(path, value, f"a number in [{low}, {high}]")
        return float(value)

    def items(self, value: Any, path: str, least: int = 0) -> list:
        if not isinstance(value, list) or len(value) < least:
            raise self.fail(path, value, f"a list of at least {least}")
        return value


def _arm(reader: PlanReader, value: Any, path: str) -> Arm:
    fields = reader.mapping(value, path, ("name", "runs", "seeds", "steps", "measured_at"))
    # no runs: the claim is not run under this preset (its row says which preset runs it)
    runs = tuple(reader.text(run, f"{path}.runs[{i}]") for i, run in enumerate(reader.items(fields["runs"], path)))
    seeds = tuple(reader.integer(s, f"{path}.seeds[{i}]") for i, s in enumerate(reader.items(fields["seeds"], path)))
    if len(seeds) != len(runs):
        raise reader.fail(f"{path}.seeds", fields["seeds"], f"one seed per run ({len(runs)})")
    steps = reader.integer(fields["steps"], f"{path}.steps", 1)
    measured_at = reader.integer(fields["measured_at"], f"{path}.measured_at")
    if measured_at > steps:
        raise reader.fail(f"{path}.measured_at", measured_at, f"a step of the run (at most {steps})")
    return Arm(reader.text(fields["name"], f"{path}.name"), runs, seeds, steps, measured_at)


def _noise_rule(reader: PlanReader, value: Any, path: str) -> NoiseRule:
    fields = reader.mapping(value, path, ("unit", "within_run", "level", "alpha", "power"))
    return NoiseRule(
        reader.text(fields["unit"], f"{path}.unit"),
        reader.text(fields["within_run"], f"{path}.within_run"),
        reader.number(fields["level"], f"{path}.level", 0.5, 0.999),
        reader.number(fields["alpha"], f"{path}.alpha", 0.001, 0.5),
        reader.number(fields["power"], f"{path}.power", 0.5, 0.999),
    )


CLAIM_FIELDS = tuple(field.name for field in dataclasses.fields(ClaimPlan))


def _claim(reader: PlanReader, value: Any, path: str) -> ClaimPlan:
    fields = reader.mapping(value, path, CLAIM_FIELDS)
    modalities = reader.items(fields["modalities"], f"{path}.modalities", 1)
    gates = fields["gates"]
    if not isinstance(gates, dict):
        raise reader.fail(f"{path}.gates", gates, "an object of numbers")
    window = fields["window_from"]
    return ClaimPlan(
        id=reader.text(fields["id"], f"{path}.id"),
        arms=tuple(_arm(reader, arm, f"{path}.arms[{i}]") for i, arm in enumerate(reader.items(fields["arms"], path))),
        schedule=reader.text(fields["schedule"], f"{path}.schedule"),
        layers=reader.text(fields["layers"], f"{path}.layers", LAYER_RULES),
        modalities=tuple(reader.text(m, f"{path}.modalities[{i}]", MODALITY_NAMES) for i, m in enumerate(modalities)),
        paper_modality=reader.text(fields["paper_modality"], f"{path}.paper_modality", MODALITY_NAMES),
        window_from=None if window is None else reader.number(window, f"{path}.window_from", 0.0, 0.99),
        gates={name: reader.number(v, f"{path}.gates.{name}", -1e9, 1e9) for name, v in gates.items()},
        noise_rule=_noise_rule(reader, fields["noise_rule"], f"{path}.noise_rule"),
        multiplicity=reader.text(fields["multiplicity"], f"{path}.multiplicity", MULTIPLICITY),
    )


def _rule_change(reader: PlanReader, value: Any, path: str, claims: dict[str, ClaimPlan]) -> RuleChange:
    fields = reader.mapping(value, path, ("claim", "rule", "old", "new", "why", "date"))
    claim = reader.text(fields["claim"], f"{path}.claim", tuple(claims))
    rule = reader.text(fields["rule"], f"{path}.rule")
    changeable = ("window_from", "layers", "paper_modality", "multiplicity")
    if rule not in changeable and not (rule.startswith("gates.") and rule[6:] in claims[claim].gates):
        raise reader.fail(f"{path}.rule", rule, f"one of {', '.join(changeable)} or gates.<a gate of {claim}>")
    current = dataclasses.asdict(claims[claim])
    now = current["gates"][rule[6:]] if rule.startswith("gates.") else current[rule]
    if fields["new"] != now:
        raise reader.fail(f"{path}.new", fields["new"], f"the plan's value of {rule} ({json_excerpt(now)})")
    try:
        _claim(reader, json.loads(json.dumps(dataclasses.asdict(with_rule(claims[claim], rule, fields["old"])))), path)
    except PlanError as error:
        raise reader.fail(f"{path}.old", fields["old"], f"a valid value of {rule} ({error})") from None
    return RuleChange(
        claim,
        rule,
        fields["old"],
        fields["new"],
        reader.text(fields["why"], f"{path}.why"),
        reader.text(fields["date"], f"{path}.date"),
    )


def plan_from_json(value: Any, where: str = "plan") -> StudyPlan:
    """The plan of a decoded plan file; PlanError naming ``where`` and the first invalid field."""
    reader = PlanReader(where)
    fields = reader.mapping(value, "plan", ("preset", "claims", "rule_changes", "version"), ("design_notes",))
    if fields["version"] != PLAN_VERSION:
        raise reader.fail("plan.version", fields["version"], f"{PLAN_VERSION}")
    claims = tuple(_claim(reader, c, f"claims[{i}]") for i, c in enumerate(reader.items(fields["claims"], "claims", 1)))
    by_id = {claim.id: claim for claim in claims}
    if len(by_id) != len(claims):
        repeated = next(claim.id for claim in claims if [c.id for c in claims].count(claim.id) > 1)
        raise reader.fail("claims[].id", repeated, "each claim once")
    changes = tuple(
        _rule_change(reader, change, f"rule_changes[{i}]", by_id)
        for i, change in enumerate(reader.items(fields["rule_changes"], "rule_changes"))
    )
    given = reader.items(fields.get("design_notes", []), "plan.design_notes")
    notes = tuple(reader.text(note, f"plan.design_notes[{i}]") for i, note in enumerate(given))
    return StudyPlan(reader.text(fields["preset"], "plan.preset"), claims, changes, design_notes=notes)
