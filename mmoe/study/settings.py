"""Settings of ``mmoe study claims``: :data:`DEFAULT` (a 45-minute budget on the 2-core CPU, ``docs/claims.md``),
:data:`FAST` (the slow test's) and :data:`SCALE` (longer runs for a GPU, not yet run).

The default spends its budget where the routing claims can appear: Switch and X-MoE with 32 experts pre-trained 200
steps with snapshots every 25 (the papers: 32 experts, 125K steps), MH-MoE at 32 experts with h = 4 and 8, five VQA
fine-tuning seeds per router with X-MoE's routing frozen (X-MoE §3.3). The task runs stay below what the demo gives
one variant (60 pre-training steps; VQA 120 / NLVR2 100 / captioning 150), so their scores sit near the chance
levels and the task claims say so; ``--scale`` is the setting meant to separate them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from mmoe.pipeline.settings import DEMO as DEMO_SETTINGS
from mmoe.pipeline.settings import TrainingSettings

#: The routers the study measures beside its claims: Switch top-1 at the tiny part's 8 experts (the baseline), then
#: fine-grained and shared experts, loss-free bias, expert choice.
ROUTER_VARIANTS = ("switch", "fine_grained", "shared_experts", "loss_free", "expert_choice")


@dataclass(frozen=True)
class StudySettings:
    """What the study trains and measures.

    Attributes:
        training: corpus, codebook, backbone, batch size, pre-training and fine-tuning steps of the task runs (the
            pipeline's settings type; each of ``task_variants`` pre-trains ``training.pretrain_steps`` and fine-tunes
            each task its steps).
        task_variants: the variants whose task scores are compared (MH-MoE Table 4: dense, X-MoE, MH-MoE).
        task_seeds: fine-tuning seeds of every compared task cell, and of the fine-tunings from random init that show
            what pre-training adds.
        many_experts: experts per MoE layer of the Switch and X-MoE runs through pre-training (X-MoE §4.5: 32) and of
            the activation-ratio runs (MH-MoE Fig. 1a: 32).
        router_steps: pre-training steps of the Switch and X-MoE runs with snapshots (RC, fluctuation).
        snapshot_every: steps between their backbone snapshots.
        heads: MH-MoE heads h of the activation-ratio runs (MH-MoE Fig. 5: 4 and 8).
        many_experts_steps: pre-training steps of the activation-ratio runs; X-MoE is compared at its snapshot of the
            same step (a multiple of ``snapshot_every``).
        diversity_runs: (heads, experts) of extra MH-MoE runs whose sub-token diversity has headroom below its
            ceiling min(h, E) (h = 8 over 8 experts: a random router reaches 5.25 of 8 distinct experts).
        seeds: fine-tuning seeds of Switch and X-MoE on VQA for the inter-run consistency (X-MoE Fig. 3b: 12).
        consistency_steps: steps of those fine-tunings.
        consistency_every: fine-tuning steps per load window of the inter-run consistency (X-MoE: 100).
        analysis_batches: held-out batches every routing measurement runs on.
        analysis_batch_size: their size.
        analysis_rows: router-input rows per MoE layer kept for the representation collapse.
        router_variants: tiny pre-training parts of the routers beyond top-1 token choice and of their baseline
            (``configs/pretrain/tiny/<name>.yaml``), each pre-trained ``many_experts_steps`` steps with its own plan and
            measured like the activation-ratio runs (activation ratio, load balance per modality): a table, not a claim.
    """

    training: TrainingSettings
    task_variants: tuple[str, ...]
    task_seeds: int
    many_experts: int
    router_steps: int
    snapshot_every: int
    heads: tuple[int, ...]
    many_experts_steps: int
    diversity_runs: tuple[tuple[int, int], ...]
    seeds: int
    consistency_steps: int
    consistency_every: int
    analysis_batches: int
    analysis_batch_size: int
    analysis_rows: int
    router_variants: tuple[str, ...] = ROUTER_VARIANTS

    def __post_init__(self) -> None:
        if self.many_experts_steps % self.snapshot_every or self.many_experts_steps > self.router_steps:
            raise ValueError(
                f"many_experts_steps ({self.many_experts_steps}) must be a snapshot step of the X-MoE run "
                f"(a multiple of snapshot_every = {self.snapshot_every}, at most router_steps = {self.router_steps})"
            )

    def to_json(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self)))


#: The demo's settings with the tiny configs' width and fine-tuning learning rates, 400 NLVR2 dev pairs and BEiT-3's
#: pre-training objective (masked data modelling over the whole vocabulary, the tiny config's learning rate): the
#: study measures the MoE variants under the papers' objective.
DEMO = DEMO_SETTINGS.replace(
    nlvr2_eval_sets=None,
    backbone={},
    pretrain_learning_rate=None,
    contrastive_coefficient=0.0,
    pretrain_output_vocab=False,
    finetune_optimizer={},
)


DEFAULT = StudySettings(
    training=DEMO.replace(
        codebook_size=64,
        pretrain_steps=60,
        finetune_steps={"vqav2": 120, "nlvr2": 100, "captioning": 150},
        finetune_optimizer={"captioning": {"learning_rate": 6e-4}},
        num_beams=1,
    ),
    task_variants=("dense", "xmoe", "mhmoe"),
    task_seeds=2,
    many_experts=32,
    router_steps=200,
    snapshot_every=25,
    heads=(4, 8),
    many_experts_steps=100,
    diversity_runs=((8, 8),),
    seeds=5,
    consistency_steps=100,
    consistency_every=20,
    analysis_batches=4,
    analysis_batch_size=32,
    analysis_rows=2000,
)


FAST = dataclasses.replace(
    DEFAULT,
    training=DEMO.replace(
        corpus_size="tiny",
        codebook_size=32,
        backbone={"dim": 96, "num_heads": 2, "ffn_dim": 192},
        pretrain_steps=8,
        finetune_steps={"vqav2": 4, "nlvr2": 4, "captioning": 4},
        batch_size=8,
        num_beams=1,
        figure_images=2,
    ),
    task_seeds=2,
    many_experts=8,
    router_steps=12,
    snapshot_every=4,
    heads=(2, 8),
    many_experts_steps=8,
    diversity_runs=((4, 4),),
    seeds=3,
    consistency_steps=12,
    consistency_every=4,
    analysis_batches=2,
    analysis_batch_size=16,
    analysis_rows=500,
)


SCALE = dataclasses.replace(
    DEFAULT,
    training=DEMO.replace(
        corpus_size="large",
        finetune_steps={"vqav2": 2000, "nlvr2": 2000, "captioning": 2000},
        pretrain_steps=2000,
        batch_size=64,
        checkpoint_every=500,
        precision="bf16-mixed",
    ),
    task_seeds=3,
    router_steps=4000,
    snapshot_every=250,
    many_experts_steps=2000,
    seeds=12,
    consistency_steps=1200,
    consistency_every=100,
    analysis_batches=16,
    analysis_batch_size=64,
    analysis_rows=10_000,
)
