"""The papers' analysis claims, each computed from the study's saved measurements (``analysis/measures.json``): the
claim, the paper's figure and setting, mmoe's measurement per modality with a 95% interval, and a verdict under the
noise rule of :mod:`mmoe.study.verdicts` (reproduces / opposite / not separated / saturated / uninformative). Pure
functions of those numbers, so the report can be recomputed from the file.

One module per paper's family of claims: :mod:`~mmoe.study.claims.mhmoe_routing` (MH-MoE's expert activation and
sub-token diversity), :mod:`~mmoe.study.claims.xmoe_routing` (X-MoE's representation collapse, routing fluctuation
and inter-run consistency), :mod:`~mmoe.study.claims.task_scores` (MH-MoE's task order, pre-training against random
init) and :mod:`~mmoe.study.claims.stratified` (Stratified MoE's requested capacity and token frequency), over
:mod:`~mmoe.study.claims.claim` (:class:`Claim`, :class:`Statement`, :func:`modality_claim`).
"""

from mmoe.study.claims.claim import Claim, Statement, empty_claim, modality_claim
from mmoe.study.claims.mhmoe_routing import (
    activation_claim,
    diversity_claim,
    random_activation,
)
from mmoe.study.claims.stratified import average_ranks, capacity_claim, frequency_claim, spearman
from mmoe.study.claims.task_scores import (
    TASK_ORDER,
    TASK_SCORES,
    TASKS,
    not_run_claim,
    order_verdict,
    pretraining_claim,
    spread,
    tasks_claim,
)
from mmoe.study.claims.xmoe_routing import (
    TRAINED,
    collapse_claim,
    collapse_keys,
    consistency_claim,
    fluctuation_claim,
    judged_window,
    mean_correlation,
)

__all__ = [
    "TASK_ORDER",
    "TASK_SCORES",
    "TASKS",
    "TRAINED",
    "Claim",
    "Statement",
    "activation_claim",
    "average_ranks",
    "capacity_claim",
    "collapse_claim",
    "collapse_keys",
    "consistency_claim",
    "diversity_claim",
    "empty_claim",
    "fluctuation_claim",
    "frequency_claim",
    "mean_correlation",
    "modality_claim",
    "not_run_claim",
    "order_verdict",
    "pretraining_claim",
    "random_activation",
    "spearman",
    "spread",
    "tasks_claim",
    "judged_window",
]
