"""Settings of ``mmoe study claims``: :data:`DEFAULT` (60 minutes on the 2-core CPU, ``docs/claims.md``),
:data:`FAST` (the slow test's: the default's structure at tiny scale) and :data:`GPU` (``--scale gpu``: the designs
that need 8 or more runs per arm, several tiny runs per GPU at once).

The default spends its budget on independent runs per arm (the training run is the unit of every decision): 3
pre-training seeds of each routing arm (Switch and X-MoE at 32 experts, MH-MoE h = 4 and 8 at 32 experts), all 100
steps with the same schedule (warm-up, then a constant learning rate); 4 VQA fine-tuning seeds per router under each
fine-tuning rule (both routers frozen, both trained); 3 pre-trainings with the demo's recipe against 3 random inits,
each fine-tuned on VQA at the demo's steps. The task order (claim 6) does not fit beside them and runs under
``--scale gpu`` only; the router table is pre-trained 60 steps instead of 100.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from mmoe.pipeline.settings import DEMO as DEMO_SETTINGS
from mmoe.pipeline.settings import TrainingSettings

#: The routers the study measures beside its claims: Switch top-1 at the tiny part's 8 experts (the baseline), then
#: fine-grained and shared experts, loss-free bias, expert choice, and the LIMoE, MoMa and DeepSeek-style recipes.
ROUTER_VARIANTS = (
    "switch",
    "fine_grained",
    "shared_experts",
    "loss_free",
    "expert_choice",
    "limoe",
    "moma",
    "deepseek",
)
#: The fine-tuning rules of the inter-run consistency, each a row of its own: both routers' routing frozen (X-MoE
#: §3.3), both fine-tuned whole.
CONSISTENCY_RULES = ("frozen", "trained")


@dataclass(frozen=True)
class StudySettings:
    """What the study trains and measures.

    Attributes:
        training: corpus, codebook, backbone, batch size, pre-training and fine-tuning steps of the task runs, the
            Stratified MoE run and the router table (the pipeline's settings type).
        task_variants: the variants whose task scores are compared (MH-MoE Table 4: dense, X-MoE, MH-MoE).
        task_seeds: fine-tuning seeds of every compared task cell.
        run_tasks: whether the task order (claim 6) is trained; without, its row says which preset runs it.
        many_experts: experts per MoE layer of the routing arms (X-MoE §4.5 and MH-MoE Fig. 1a: 32).
        routing_seeds: pre-training seeds of every routing arm (claims 1, 3, 4): the runs each decision is over.
        router_steps: pre-training steps of every routing arm (Switch, X-MoE, MH-MoE at ``many_experts``), the same
            schedule on every side; the diversity runs train as many.
        snapshot_every: steps between the Switch and X-MoE runs' backbone snapshots.
        routing_min_lr_ratio: the routing arms' final learning rate as a share of the peak (1.0: constant after the
            warm-up, so fluctuation is measured at a constant rate).
        heads: MH-MoE heads h of the activation-ratio arms (MH-MoE Fig. 5: 4 and 8).
        diversity_runs: (heads, experts) of the MH-MoE runs whose sub-token diversity has headroom below min(h, E).
        seeds: VQA fine-tuning seeds per router and fine-tuning rule (claim 5; X-MoE Fig. 3b: 12).
        consistency_steps: steps of those fine-tunings.
        consistency_every: fine-tuning steps per load window of the inter-run consistency (X-MoE: 100).
        pretraining_recipe: the settings of claim 7's pre-trainings and fine-tunings: the demo's recipe (contrastive
            loss, output vocabulary, its learning rates and VQA optimiser) on the study's corpus and codebook.
        pretraining_backbones: pre-training seeds of claim 7, and random inits (seeds) against them.
        router_table_steps: pre-training steps of each router of the router table.
        analysis_batches: held-out batches every routing measurement runs on.
        analysis_batch_size: their size.
        analysis_rows: router-input rows per MoE layer kept for the representation collapse.
        router_variants: tiny pre-training parts of the router table (``configs/pretrain/tiny/<name>.yaml``).
        diversity_seeds: pre-training seeds of each diversity run (claim 2 is decided over them from 2 on).
    """

    training: TrainingSettings
    task_variants: tuple[str, ...]
    task_seeds: int
    run_tasks: bool
    many_experts: int
    routing_seeds: int
    router_steps: int
    snapshot_every: int
    routing_min_lr_ratio: float
    heads: tuple[int, ...]
    diversity_runs: tuple[tuple[int, int], ...]
    seeds: int
    consistency_steps: int
    consistency_every: int
    pretraining_recipe: TrainingSettings
    pretraining_backbones: int
    router_table_steps: int
    analysis_batches: int
    analysis_batch_size: int
    analysis_rows: int
    router_variants: tuple[str, ...] = ROUTER_VARIANTS
    diversity_seeds: int = 1

    def __post_init__(self) -> None:
        if self.router_steps % self.snapshot_every:
            raise ValueError(f"router_steps ({self.router_steps}) must be a multiple of snapshot_every "
                             f"({self.snapshot_every}): the last snapshot is the run's end")  # fmt: skip
        if self.routing_seeds < 1 or self.pretraining_backbones < 1 or self.seeds < 1:
            raise ValueError("routing_seeds, pretraining_backbones and seeds must each be at least 1")
        if "vqav2" not in self.pretraining_recipe.finetune_steps:
            raise ValueError("pretraining_recipe must give VQA (vqav2) fine-tuning steps")

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

#: Claim 7's recipe: the demo's (contrastive loss, output vocabulary, pre-training learning rate 3e-4, VQA's optimiser,
#: 80 pre-training and 300 VQA steps) on the study's corpus and 64-token codebook, VQA only.
DEMO_RECIPE = DEMO_SETTINGS.replace(
    nlvr2_eval_sets=None, codebook_size=64, finetune_steps={"vqav2": DEMO_SETTINGS.finetune_steps["vqav2"]}, num_beams=1
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
    run_tasks=False,
    many_experts=32,
    routing_seeds=3,
    router_steps=100,
    snapshot_every=10,
    routing_min_lr_ratio=1.0,
    heads=(4, 8),
    diversity_runs=((8, 8),),
    seeds=4,
    consistency_steps=80,
    consistency_every=20,
    pretraining_recipe=DEMO_RECIPE,
    pretraining_backbones=3,
    router_table_steps=60,
    analysis_batches=4,
    analysis_batch_size=32,
    analysis_rows=2000,
)

_FAST_TRAINING = DEMO.replace(
    corpus_size="tiny",
    codebook_size=32,
    backbone={"dim": 96, "num_heads": 2, "ffn_dim": 192},
    pretrain_steps=8,
    finetune_steps={"vqav2": 4, "nlvr2": 4, "captioning": 4},
    batch_size=8,
    num_beams=1,
    figure_images=2,
)

FAST = dataclasses.replace(
    DEFAULT,
    training=_FAST_TRAINING,
    many_experts=8,
    routing_seeds=2,
    router_steps=8,
    snapshot_every=4,
    heads=(2, 8),
    diversity_runs=((4, 4),),
    seeds=3,
    consistency_steps=8,
    consistency_every=4,
    pretraining_recipe=DEMO_RECIPE.replace(
        corpus_size="tiny",
        codebook_size=32,
        backbone=_FAST_TRAINING.backbone,
        pretrain_steps=8,
        finetune_steps={"vqav2": 4},
        batch_size=8,
        figure_images=2,
    ),  # fmt: skip
    pretraining_backbones=2,
    router_table_steps=8,
    analysis_batches=2,
    analysis_batch_size=16,
    analysis_rows=500,
)

_GPU_TRAINING = DEMO.replace(
    corpus_size="large",
    finetune_steps={"vqav2": 1000, "nlvr2": 1000, "captioning": 1000},
    pretrain_steps=2000,
    batch_size=64,
    checkpoint_every=500,
    precision="bf16-mixed",
)

#: ``--scale gpu``: the designs that decide claims 2, 4, 6 and 7 with 8 or more runs per arm (claim 2: the diversity
#: run with headroom, h = 8 over 16 experts, 8 seeds x 1,000 steps; claim 4: Switch and X-MoE, 8 seeds x 1,000
#: steps, a snapshot every 100; claim 6: 3 variants x 9 fine-tuning seeds per task; claim 7: 8 pre-trainings against 8
#: random inits at the demo's recipe), meant to run several tiny runs per GPU at once (``--jobs 8``).
GPU = dataclasses.replace(
    DEFAULT,
    training=_GPU_TRAINING,
    task_seeds=9,
    run_tasks=True,
    diversity_seeds=8,
    routing_seeds=8,
    router_steps=1000,
    snapshot_every=100,
    diversity_runs=((8, 16),),
    seeds=8,
    consistency_steps=400,
    consistency_every=50,
    pretraining_recipe=DEMO_RECIPE.replace(corpus_size="large", precision="bf16-mixed"),
    pretraining_backbones=8,
    router_table_steps=500,
    analysis_batches=16,
    analysis_batch_size=64,
    analysis_rows=10_000,
)

#: The presets by the name the plan records.
PRESETS = {"default": DEFAULT, "fast": FAST, "gpu": GPU}
