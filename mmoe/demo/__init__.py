"""``mmoe demo``: the whole pipeline on the embedded synthetic corpus, in minutes on a CPU.

```
mmoe demo [--out runs/demo] [--variant dense|switch|xmoe|mhmoe|stratified|...|all] [--fast] [--random-init]
          [--precision bf16-mixed] [--jobs N] [--stages PREFIX ...]
```

A recipe over the pipeline kit (:mod:`mmoe.pipeline`: stages, launches, benchmarks, the demo's settings
:data:`mmoe.pipeline.settings.DEMO`): :mod:`~mmoe.demo.recipe` (the demo's stage list), :mod:`~mmoe.demo.report`
(``results.json``) and :mod:`~mmoe.demo.command` (the command, and :func:`~mmoe.demo.command.run_demo`, the typed
call it makes). Stages, in order (each a typed call of the package's own functions):

1. ``corpus``       the synthetic world in the benchmarks' formats, with shards (``mmoe data synth --shards``);
2. ``codebook``     the visual codebook, the targets of masked image modeling (``mmoe tokenizer fit``);

then for each variant (the work folder's layout: :class:`mmoe.pipeline.layout.WorkLayout`):

3. ``pretrain``     into ``DIR/pretrain/<variant>``: ``mmoe fit`` with ``configs/pretrain/tiny.yaml`` and the
   variant's part ``configs/pretrain/tiny/<variant>.yaml`` (none for dense), its ``data_root`` and codebook set to
   ``DIR/data`` and its step counts to the demo's (typed options and callback objects);
4. ``export``       the pre-trained backbone as ``DIR/pretrain/<variant>/backbone.pt``;
5. ``vqav2``, ``nlvr2``, ``captioning``, ``retrieval``: into ``DIR/finetune/<variant>/<task>``, ``mmoe fit`` with
   ``configs/finetune/<task>_tiny.yaml`` from that backbone, ``mmoe predict`` on the evaluation split, and the
   official scorers (:mod:`mmoe.metrics`; retrieval's chance levels are a random ranking's of the test split);
6. ``figures``      sub-token maps (pre-trained vs VQA fine-tuned backbone) and the load heatmap (``mmoe viz``), in
   ``DIR/figures/<variant>``;
7. with ``--random-init``: ``random-init/init`` (a backbone of the pre-trained one's architecture with fresh weights,
   seed 0, as ``DIR/pretrain/<variant>-random-init/backbone.pt``), then step 5 from it (into
   ``DIR/finetune/<variant>-random-init/<task>``): what pre-training adds at equal steps, and per metric a 95% paired
   bootstrap interval of the difference over the evaluation items with its verdict (:mod:`mmoe.pipeline.compare`).

A stage is done when its output file exists and its marker ``DIR/stages/<stage>.json`` says so; a re-run reuses done
stages, and an interrupted training resumes from its last checkpoint. Every file is written atomically or under its
stage's folder, so an interruption loses nothing already finished. The run ends with a table (task, metric, value,
chance level from ``DIR/data/synth.json``) and the files written, also saved as ``DIR/results.json``.
"""

from mmoe.demo.command import demo_command, parse, run_demo

__all__ = ["demo_command", "parse", "run_demo"]
