"""Every claim of the report judged from the measures under a plan: :func:`claims_from` (each claim's measurement
and within-run verdict) and :func:`rule_change_verdicts` (the plan's changed rules with the verdicts under the old
rule and the new)."""

from __future__ import annotations

import dataclasses

from mmoe.study.claims import xmoe_routing
from mmoe.study.claims.claim import Claim
from mmoe.study.claims.mhmoe_routing import ACTIVATION, DIVERSITY, activation_claim, diversity_claim
from mmoe.study.claims.stratified import CAPACITY, FREQUENCY, capacity_claim, frequency_claim
from mmoe.study.claims.task_scores import PRETRAINING, TASKS, not_run_claim, pretraining_claim, tasks_claim
from mmoe.study.claims.xmoe_routing import COLLAPSE, CONSISTENCY, FLUCTUATION, TRAINED
from mmoe.study.decisions import run_decisions
from mmoe.study.plan import StudyPlan
from mmoe.study.plan_design import study_plan
from mmoe.study.runs import PRETRAINING_VARIANT, Measures
from mmoe.study.settings import CLAIM_IDS, DEFAULT

#: Every claim's statement by id (a claim the plan does not run is its statement, not measured).
STATEMENTS = {
    statement.id: statement
    for statement in (
        ACTIVATION,
        DIVERSITY,
        COLLAPSE,
        FLUCTUATION,
        CONSISTENCY,
        TRAINED,
        TASKS,
        PRETRAINING,
        CAPACITY,
        FREQUENCY,
    )
}


def claims_from(measures: Measures, plan: StudyPlan | None = None) -> list[Claim]:
    """Every claim of the report from ``analysis/measures.json`` (recomputable from that file alone), each judged by
    its rules in ``plan`` (the default settings' plan without one); a claim the plan does not run is not measured and
    says so in the plan's words (which preset runs it)."""
    plan = plan or study_plan(DEFAULT, "default")
    rules = plan.claim
    ids = [claim.id for claim in plan.claims]

    def pretraining() -> Claim:
        if measures.backbones:
            backbones = measures.backbones
            return pretraining_claim(
                PRETRAINING_VARIANT, backbones["pretrained"], backbones["random_init"], measures.chance
            )
        # a measures.json from before claim 7's backbones: one pre-trained xmoe against its random init
        return pretraining_claim("xmoe", measures.scores["xmoe"], measures.random_init, measures.chance)

    measured = {
        "activation": lambda: activation_claim(measures.activation, rules("activation")),
        "diversity": lambda: diversity_claim(measures.diversity, rules("diversity")),
        "collapse": lambda: xmoe_routing.collapse_claim(measures.snapshots, rules("collapse")),
        "fluctuation": lambda: xmoe_routing.fluctuation_claim(measures.snapshots, rules("fluctuation")),
        "consistency": lambda: xmoe_routing.consistency_claim(measures.consistency, rules("consistency")),
        "consistency_trained": lambda: xmoe_routing.consistency_claim(
            measures.consistency_trained, rules("consistency_trained"), TRAINED
        ),
        "tasks": lambda: tasks_claim(measures.scores, measures.chance),
        "pretraining": pretraining,
        "capacity": lambda: capacity_claim(measures.capacity, rules("capacity")),
        "frequency": lambda: frequency_claim(
            measures.token_capacity["passes"], measures.token_capacity["training_counts"], rules("frequency")
        ),
    }
    claims = []
    for claim_id in CLAIM_IDS:
        if claim_id == "consistency_trained" and claim_id not in ids:  # a plan from before its row
            continue
        not_run = claim_id in ids and rules(claim_id).not_run
        claims.append(
            not_run_claim(STATEMENTS[claim_id], rules(claim_id).noise_rule.unit) if not_run else measured[claim_id]()
        )
    return claims


def rule_change_verdicts(measures: Measures, plan: StudyPlan, decisions: list[dict]) -> list[dict]:
    """Each of the plan's rule changes with the affected claim's verdicts (within one run and over runs) under the old
    rule and under the plan's."""
    by_id = {decision["id"]: decision for decision in decisions}
    changes = []
    for change in plan.rule_changes:
        old_plan = plan.under_old_rule(change)
        old_claims = claims_from(measures, old_plan)
        old = next(d for d in run_decisions(old_claims, old_plan, measures) if d["id"] == change.claim)
        new = by_id[change.claim]
        changes.append(
            dataclasses.asdict(change)
            | {
                "old_verdicts": {"within_run": old["within_run_verdict"], "over_runs": old["verdict"]},
                "new_verdicts": {"within_run": new["within_run_verdict"], "over_runs": new["verdict"]},
            }
        )
    return changes
