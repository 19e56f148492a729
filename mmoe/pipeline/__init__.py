"""The pipeline kit below the demo and the claims study: restartable stages (:mod:`~mmoe.pipeline.stages`) and a pool
of processes that runs them at once (:mod:`~mmoe.pipeline.pool`), training settings and their presets
(:mod:`~mmoe.pipeline.settings`), the work-folder layout both recipes share (:mod:`~mmoe.pipeline.layout`), the run
specs of ``mmoe fit`` / ``predict`` on the shipped configs (:mod:`~mmoe.pipeline.launch`), the stages both recipes
share (:mod:`~mmoe.pipeline.standard_stages`), one record per benchmark (:mod:`~mmoe.pipeline.benchmarks`, item by
item in :mod:`~mmoe.pipeline.items`), the paired comparison of two runs (:mod:`~mmoe.pipeline.compare`) and result
tables (:mod:`~mmoe.pipeline.tables`). The demo and the study import this package and never each other; scripts,
benchmarks and tests reach the pipeline through it."""

from mmoe.pipeline.benchmarks import BENCHMARKS, Benchmark, benchmark_named, trained_benchmarks
from mmoe.pipeline.launch import CONFIGS, VARIANTS, finetune_spec, predict_spec, pretrain_spec
from mmoe.pipeline.layout import RANDOM_INIT, PipelineRun, WorkLayout, random_init_name
from mmoe.pipeline.settings import DEMO, DEMO_FAST, TrainingSettings
from mmoe.pipeline.stages import PipelineError, Stage, StageKey, run_stage

__all__ = [
    "BENCHMARKS",
    "CONFIGS",
    "DEMO",
    "DEMO_FAST",
    "RANDOM_INIT",
    "VARIANTS",
    "Benchmark",
    "PipelineError",
    "PipelineRun",
    "Stage",
    "StageKey",
    "TrainingSettings",
    "WorkLayout",
    "benchmark_named",
    "finetune_spec",
    "predict_spec",
    "pretrain_spec",
    "random_init_name",
    "run_stage",
    "trained_benchmarks",
]
