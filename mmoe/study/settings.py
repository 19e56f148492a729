"""Settings of ``mmoe study claims``: :data:`DEFAULT` (26 minutes on the 2-core CPU, ``docs/claims.md``), :data:`FAST`
(the slow test's) and :data:`SCALE` (longer runs for a GPU, not yet run).

The default fits its budget with 17 trainings: 5 variants and 4 activation-ratio runs pre-trained, 5 x 3 task
fine-tunings plus 4 extra VQA seeds. That is below what the demo gives one variant (80 pre-training steps, VQA
300 / NLVR2 250 / captioning 450), so the task scores sit near their chance levels and claim 5 mostly measures noise;
``--scale`` is the setting meant to separate the variants.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from mmoe.demo.settings import FULL as DEMO
from mmoe.demo.settings import DemoSettings


@dataclass(frozen=True)
class StudySettings:
    """What the study trains and measures.

    Attributes:
        training: corpus, codebook, backbone, batch size, pre-training and fine-tuning steps of every run (the demo's
            settings type; every variant pre-trains ``training.pretrain_steps`` and fine-tunes each task its steps).
        seeds: fine-tuning seeds of Switch and X-MoE on VQA (X-MoE Fig. 3b correlates the runs' loads; they also
            give those cells of claim 5 a spread).
        many_experts: experts per MoE layer of the activation-ratio runs (MH-MoE Fig. 1a uses 32).
        heads: MH-MoE heads h of the activation-ratio runs.
        many_experts_steps: pre-training steps of each activation-ratio run.
        snapshot_every: steps between backbone snapshots of the Switch and X-MoE pre-training (RC, fluctuation).
        consistency_every: fine-tuning steps per load window of the inter-run consistency (X-MoE: 100).
        analysis_batches: held-out batches every routing measurement runs on.
        analysis_batch_size: their size.
        analysis_rows: router-input rows per MoE layer kept for the representation collapse.
    """

    training: DemoSettings
    seeds: int
    many_experts: int
    heads: tuple[int, ...]
    many_experts_steps: int
    snapshot_every: int
    consistency_every: int
    analysis_batches: int
    analysis_batch_size: int
    analysis_rows: int

    def to_json(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self)))


DEFAULT = StudySettings(
    training=DEMO.replace(
        codebook_size=64,
        pretrain_steps=60,
        finetune_steps={"vqav2": 120, "nlvr2": 100, "captioning": 150},
        finetune_learning_rates={"captioning": 6e-4},
        num_beams=1,
    ),
    seeds=3,
    many_experts=32,
    heads=(2, 4, 8),
    many_experts_steps=40,
    snapshot_every=10,
    consistency_every=10,
    analysis_batches=4,
    analysis_batch_size=32,
    analysis_rows=2000,
)


FAST = dataclasses.replace(
    DEFAULT,
    training=DEMO.replace(
        synth=("--size", "tiny"),
        codebook_size=32,
        backbone={"dim": 96, "num_heads": 2, "ffn_dim": 192},
        pretrain_steps=12,
        finetune_steps={"vqav2": 8, "nlvr2": 4, "captioning": 4},
        batch_size=8,
        num_beams=1,
        figure_images=2,
    ),
    seeds=2,
    heads=(2, 8),
    many_experts_steps=6,
    snapshot_every=4,
    consistency_every=4,
    analysis_batches=2,
    analysis_batch_size=16,
    analysis_rows=500,
)


SCALE = dataclasses.replace(
    DEFAULT,
    training=DEMO.replace(
        synth=("--size", "large"),
        finetune_steps={"vqav2": 2000, "nlvr2": 2000, "captioning": 2000},
        pretrain_steps=2000,
        batch_size=64,
        checkpoint_every=500,
        precision="bf16-mixed",
    ),
    seeds=5,
    many_experts_steps=2000,
    snapshot_every=200,
    consistency_every=100,
    analysis_batches=16,
    analysis_batch_size=64,
    analysis_rows=10_000,
)
