"""``mmoe study claims``: the X-MoE and MH-MoE papers' analysis claims, trained and measured at tiny scale.

```
mmoe study claims [--out runs/claims] [--fast | --scale] [--precision bf16-mixed]
```

:mod:`~mmoe.study.settings` (DEFAULT, FAST, SCALE), :mod:`~mmoe.study.runs` (the stages, from the pipeline kit
:mod:`mmoe.pipeline`: corpus and codebook, pre-training of every variant and of the 32-expert runs, fine-tuning,
measurements), :mod:`~mmoe.study.measures` (routing measurements on held-out batches), :mod:`~mmoe.study.claims`
(each claim from the saved measurements), :mod:`~mmoe.study.report` (figures, ``report.md``, ``report.json``) and
:mod:`~mmoe.study.command`. Done stages are reused on a re-run and an interrupted training resumes, as in ``mmoe
demo``; a directory made with other settings is refused.
"""

from mmoe.study.command import claims_from, study_command

__all__ = ["claims_from", "study_command"]
