"""``mmoe study claims``: the X-MoE and MH-MoE papers' analysis claims, trained and measured at tiny scale.

```
mmoe study claims [--out runs/claims] [--fast | --scale gpu] [--plan FILE] [--dry-run] [--precision bf16-mixed]
```

:mod:`~mmoe.study.settings` (DEFAULT, FAST, GPU), :mod:`~mmoe.study.runs` (the stages, from the pipeline kit
:mod:`mmoe.pipeline`: corpus and codebook, pre-training of every routing arm at each routing seed, fine-tuning),
:mod:`~mmoe.study.measure_runs` (every run measured), :mod:`~mmoe.study.cost` (each preset's estimated cost),
:mod:`~mmoe.study.measures` (routing measurements on held-out batches), :mod:`~mmoe.study.claims` (each claim from the
saved measurements, by the rules of the plan), :mod:`~mmoe.study.plan` and :mod:`~mmoe.study.plan_design` (the plan
fixed before the runs: arms, runs, seeds, steps, layers, windows, gates, noise rule, multiplicity, rule changes;
``docs/claims/plan.json``), :mod:`~mmoe.study.plan_runs` (its hash in every stage's marker; a report over runs made
under another plan refused), :mod:`~mmoe.study.run_statistics`, :mod:`~mmoe.study.decisions` and
:mod:`~mmoe.study.routing_decisions` (each claim decided over training runs: Welch's t, the detectable effect, Holm's
correction, each :mod:`mmoe.stats`'; 1 run per arm is not decided), :mod:`~mmoe.study.judged` (every claim judged
from the measures under a plan), :mod:`~mmoe.study.report` (``report.md``, ``report.json``; its figures
:mod:`~mmoe.study.report_figures`, claim 1's two statements and the runs under one plan :mod:`~mmoe.study.report_runs`),
:mod:`~mmoe.study.provenance` (the run's facts, the decision code's commit, the stages' plan records),
:mod:`~mmoe.study.reruns` (the runs under one plan, read by its rerun rule, ``docs/claims/reruns.json``),
:mod:`~mmoe.study.rerender` (``mmoe study report``: a report written again from its files) and
:mod:`~mmoe.study.command`. Done stages are reused on a re-run and an interrupted
training resumes, as in ``mmoe demo``; a directory made with other settings is refused.
"""

from mmoe.study.command import claims_from, study_command

__all__ = ["claims_from", "study_command"]
