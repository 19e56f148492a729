"""``mmoe demo``: the whole pipeline on the embedded synthetic corpus, in minutes on a CPU.

```
mmoe demo [--out runs/demo] [--variant dense|switch|xmoe|mhmoe|stratified|all] [--fast] [--random-init]
          [--precision bf16-mixed]
```

The package: :mod:`~mmoe.demo.settings` (FULL, FAST, the run directory), :mod:`~mmoe.demo.stages` (a pipeline of
stages with markers), :mod:`~mmoe.demo.training` (``mmoe fit`` / ``predict`` in process, :class:`Launch`),
:mod:`~mmoe.demo.benchmarks` (each fine-tuning task's corpus files, evaluation split and scorer),
:mod:`~mmoe.demo.pipeline` (the stages), :mod:`~mmoe.demo.report`, :mod:`~mmoe.demo.compare` (pre-trained
against random init: a paired bootstrap over the evaluation items) and :mod:`~mmoe.demo.command`. Stages, in order
(each a call of the package's own commands or Python APIs):

1. ``corpus``       ``mmoe data synth --out DIR/data --shards``: the synthetic world in the benchmarks' formats, shards;
2. ``codebook``     ``mmoe tokenizer fit``: the visual codebook, the targets of masked image modeling;

then for each variant, under ``DIR/<variant>/``:

3. ``pretrain``     ``mmoe fit`` with ``configs/pretrain/tiny.yaml`` and the variant's part
   ``configs/pretrain/tiny/<variant>.yaml`` (none for dense), its ``data_root`` and codebook set to ``DIR/data`` and
   its step counts to the demo's (typed options and callback objects, no argv);
4. ``export``       the pre-trained backbone as ``backbone_pretrained.pt``;
5. ``vqav2``, ``nlvr2``, ``captioning``, ``retrieval``: ``mmoe fit`` with ``configs/finetune/<task>_tiny.yaml`` from
   that backbone, ``mmoe predict`` on the evaluation split, and the official scorers (:mod:`mmoe.metrics`; retrieval's
   chance levels are a random ranking's of the test split);
6. ``figures``      ``mmoe viz subtoken-map`` (pre-trained vs VQA fine-tuned backbone) and ``mmoe viz heatmap``;
7. with ``--random-init``, under ``DIR/<variant>/random-init/``: ``init`` (a backbone of the pre-trained one's
   architecture with fresh weights, seed 0), then step 5 from it: what pre-training adds at equal steps, and per
   metric a 95% paired bootstrap interval of the difference over the evaluation items with its verdict.

A stage is done when its output file exists and its marker ``DIR/stages/<stage>.json`` says so; a re-run reuses done
stages, and an interrupted training resumes from its last checkpoint. Every file is written atomically or under its
stage's folder, so an interruption loses nothing already finished. The run ends with a table (task, metric, value,
chance level from ``DIR/data/synth.json``) and the files written, also saved as ``DIR/results.json``.
"""

from mmoe.demo.benchmarks import BENCHMARKS, Benchmark
from mmoe.demo.command import check_settings, demo_command, parse
from mmoe.demo.report import format_table, results, say
from mmoe.demo.settings import FAST, FULL, VARIANTS, DemoError, DemoRun, DemoSettings
from mmoe.demo.stages import Stage, StageKey, run_stage
from mmoe.demo.training import Launch, finetune_launch, predict_launch, pretrain_launch

__all__ = [
    "BENCHMARKS",
    "FAST",
    "FULL",
    "VARIANTS",
    "Benchmark",
    "DemoError",
    "DemoRun",
    "DemoSettings",
    "Launch",
    "Stage",
    "StageKey",
    "check_settings",
    "demo_command",
    "finetune_launch",
    "format_table",
    "parse",
    "predict_launch",
    "pretrain_launch",
    "results",
    "run_stage",
    "say",
]
