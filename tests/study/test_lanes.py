"""``mmoe study claims --jobs``: every training stage of the study belongs to one lane group (a pre-training with its
export, a fine-tuning folder with its scoring), the stages the main process runs (corpus, codebook, random inits)
to none, and every pre-training group comes before the fine-tunings that read its backbone."""

from __future__ import annotations

from collections import Counter

from mmoe.study.lanes import group_of, study_stages
from mmoe.study.runs import StudyRun, pretrainings
from mmoe.study.settings import FAST


def test_every_training_stage_is_in_exactly_one_lane_group(tmp_path):
    stages = study_stages(StudyRun(tmp_path, FAST.training), FAST)
    groups = [group_of(stage) for stage in stages]
    outside = [str(stage.key) for stage, group in zip(stages, groups, strict=True) if group is None]
    assert outside == ["corpus", "codebook"] + [f"pretrain/mhmoe-demo-random-init-seed{seed}" for seed in (0, 1)]
    sizes = Counter(group for group in groups if group is not None)
    # each pre-training with its export; each fine-tuning folder: its seeds' trainings (and scorings)
    assert {f"pretrain/{run.name}" for run in pretrainings(FAST)} == {g for g in sizes if g.startswith("pretrain/")}
    assert all(sizes[f"pretrain/{run.name}"] == 2 for run in pretrainings(FAST))
    assert sizes["finetune/xmoe-e8-seed0-frozen"] == FAST.seeds and sizes["finetune/mhmoe-demo-seed1"] == 2
    assert all(str(stage.key).startswith(group) for stage, group in zip(stages, groups, strict=True) if group)
    # the lanes' rounds: every pre-training before every fine-tuning, as the stages are listed
    kinds = [group.split("/")[0] for group in groups if group is not None]
    assert kinds == sorted(kinds, key=lambda kind: kind != "pretrain")
