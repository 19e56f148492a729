"""The stages the demo and the claims study share, each a typed call of mmoe's own functions (no command line in
between): the corpus, the codebook, a pre-training, a backbone export, a fine-tuning and its scored evaluation, and a
randomly initialised backbone."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmoe.config.run_spec import RunSpec
from mmoe.data.shards import MANIFEST
from mmoe.data.synth.layout import PRETRAIN_IMAGE_SPLIT, PRETRAIN_PAIR_SPLIT, PRETRAIN_TEXT_SPLIT
from mmoe.io import write_json
from mmoe.pipeline.benchmarks import Benchmark
from mmoe.pipeline.launch import finetune_spec, predict_spec, pretrain_spec, run_in_stage, train
from mmoe.pipeline.layout import PipelineRun
from mmoe.pipeline.stages import Stage, StageKey
from mmoe.runtime.layout import RunLayout


def corpus_stage(run: PipelineRun) -> Stage:
    """``mmoe data synth --shards``: the synthetic corpus of the run's size under ``DIR/data``, each split
    converted."""

    def build() -> dict:
        from mmoe.data.cli import synthesize_corpus

        sizes = {} if run.settings.nlvr2_eval_sets is None else {"nlvr2_eval_sets": run.settings.nlvr2_eval_sets}
        synthesize_corpus(run.data, run.settings.corpus_size, sizes=sizes, shards=True)
        return {"files": [str(run.corpus.summary), str(run.shards)]}

    return Stage(StageKey.of("corpus"), run.corpus.shard(PRETRAIN_TEXT_SPLIT) / MANIFEST, build)


def codebook_stage(run: PipelineRun) -> Stage:
    """``mmoe tokenizer fit``: the visual codebook (the targets of masked image modeling) of the pre-training
    images."""

    def fit() -> dict:
        from mmoe.tasks.visual_codebook import fit_codebook_file

        shards = [run.corpus.shard(PRETRAIN_IMAGE_SPLIT), run.corpus.shard(PRETRAIN_PAIR_SPLIT)]
        fit_codebook_file(shards, run.codebook, run.settings.codebook_size, run.settings.image_size)
        return {"files": [str(run.codebook)]}

    return Stage(StageKey.of("codebook"), run.codebook, fit)


def pretrain_stage(key: StageKey, spec: Callable[[], RunSpec], layout: RunLayout) -> Stage:
    """The pre-training ``spec()`` builds, into ``layout`` (resumed from its latest checkpoint); built when the stage
    runs, not when a done stage is listed."""

    def fit() -> dict:
        record = train(str(key), spec())
        return record | {"files": [*record["files"], str(layout.routing_stats)]}

    return Stage(key, layout.last_checkpoint, fit)


def variant_pretrain_stage(run: PipelineRun, variant: str) -> Stage:
    """The pre-training of the tiny configs of ``variant`` (:func:`mmoe.pipeline.launch.pretrain_spec`) for the
    settings' pre-training steps into ``DIR/pretrain/<variant>``: the demo's, and where a script that pre-trains as
    the demo does finds it; its zero-shot probes are measured once, after the last step
    (:mod:`mmoe.pipeline.probes`)."""
    layout = run.pretraining(variant)
    spec = functools.partial(pretrain_spec, run, variant, layout, run.settings.pretrain_steps, watched=True)
    return pretrain_stage(StageKey.of(variant, "pretrain"), spec, layout)


def export_stage(key: StageKey, checkpoint: Path, target: Path) -> Stage:
    """The backbone of a training checkpoint as an exported backbone file."""

    def export() -> dict:
        from mmoe.runtime.checkpoint import export_backbone, load_backbone

        export_backbone(load_backbone(checkpoint), target)
        return {"files": [str(target)]}

    return Stage(key, target, export)


@dataclass(frozen=True)
class FineTuning:
    """One fine-tuning of a benchmark, what its training stage and its evaluation stage both run.

    Attributes:
        run: the work folder and settings.
        benchmark: the benchmark whose task is fine-tuned.
        backbone: the exported backbone it starts from.
        layout: its run folder.
        steps: optimiser steps.
        seed: the training seed (the config's when None).
        routing_every: steps between routing statistics.
        model_options: added to the benchmark's task options (e.g. ``frozen_routing``).
    """

    run: PipelineRun
    benchmark: Benchmark
    backbone: Path
    layout: RunLayout
    steps: int
    seed: int | None = None
    routing_every: int = 20
    model_options: Mapping[str, Any] = field(default_factory=dict)

    def spec(self) -> RunSpec:
        """The ``mmoe fit`` of this fine-tuning (:func:`mmoe.pipeline.launch.finetune_spec`)."""
        options = self.benchmark.model_options(self.run) | dict(self.model_options)
        task = self.benchmark.task
        return finetune_spec(
            self.run, task, options, self.backbone, self.layout, self.steps, self.seed, self.routing_every
        )


def finetune_stage(key: StageKey, tuning: FineTuning) -> Stage:
    """``mmoe fit`` of ``tuning`` (resumed from its run folder's latest checkpoint)."""
    return Stage(key, tuning.layout.last_checkpoint, lambda: train(str(key), tuning.spec()))


def evaluate_stage(key: StageKey, tuning: FineTuning) -> Stage:
    """``mmoe predict`` of the fine-tuning ``tuning`` on its benchmark's evaluation split, scored by the official
    scorers into its run folder's ``scores.json``."""
    run, benchmark, layout = tuning.run, tuning.benchmark, tuning.layout

    def evaluate() -> dict:
        predictions = layout.predictions(benchmark.predictions)
        spec = predict_spec(tuning.spec(), run.corpus.shard(benchmark.eval_split), predictions)
        run_in_stage(str(key), spec)
        scores = benchmark.score(run, predictions)
        write_json(layout.scores, scores)
        return {"scores": scores, "launch": spec.to_json(), "files": [str(predictions), str(layout.scores)]}

    return Stage(key, layout.scores, evaluate)


def scored_stages(key: StageKey, tuning: FineTuning) -> list[Stage]:
    """The fine-tuning ``tuning`` as stage ``key`` and its scored evaluation as ``key/eval``."""
    return [finetune_stage(key, tuning), evaluate_stage(StageKey.of(*key.parts, "eval"), tuning)]


def random_backbone_stage(key: StageKey, source: Path, target: Path, seed: int = 0) -> Stage:
    """``target``: a backbone with the architecture of the exported backbone ``source`` and fresh weights from the
    backbone's own initialisation under ``seed``."""

    def initialise() -> dict:
        import torch

        from mmoe.model import MultiwayTransformer
        from mmoe.runtime.checkpoint import export_backbone, read_backbone_state

        config, _ = read_backbone_state(source)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            backbone = MultiwayTransformer(config)
        target.parent.mkdir(parents=True, exist_ok=True)
        export_backbone(backbone, target)
        return {"files": [str(target)], "seed": seed}

    return Stage(key, target, initialise)
