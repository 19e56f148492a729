"""Settings of ``mmoe study claims``: :data:`DEFAULT` (60 minutes on the 2-core CPU, ``docs/claims.md``),
:data:`FAST` (the slow test's: the default's structure at tiny scale), :data:`GPU` (``--scale gpu``: claims 2, 4 and 7
with 8 runs per arm, several tiny runs per GPU at once, ``docs/claims/plan_gpu.md``) and :data:`GPU_TASKS`
(``--scale gpu-tasks``: the task order, claim 6, over 3 pre-training seeds per variant, for a longer loan,
``docs/claims/plan_gpu_tasks.md``).

The default spends its budget on independent runs per arm (the training run is the unit of every decision): 3
pre-training seeds of each routing arm (Switch and X-MoE at 32 experts, MH-MoE h = 4 and 8 at 32 experts), all 100
steps with the same schedule (warm-up, then a constant learning rate); 4 VQA fine-tuning seeds per router under each
fine-tuning rule (both routers frozen, both trained); 3 pre-trainings with the demo's recipe against 3 random inits,
each fine-tuned on VQA at the demo's steps. The task order (claim 6) does not fit beside them (its plan, fixed before
the GPU presets were split, names ``--scale gpu``; ``--scale gpu-tasks`` runs it now); the router table is pre-trained
60 steps instead of 100.

A preset decides the claims in :attr:`StudySettings.claims` (each other claim's plan row says "not run" and which
preset runs it); a count of 0 (routing seeds, fine-tuning seeds of claim 5, backbones of claim 7) trains none of that
claim's runs.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from mmoe.pipeline.launch import VARIANTS
from mmoe.pipeline.settings import DEMO as DEMO_SETTINGS
from mmoe.pipeline.settings import TrainingSettings

#: The routers the study measures beside its claims: Switch top-1 at the tiny part's 8 experts (the baseline), then
#: fine-grained and shared experts, loss-free bias, expert choice, and the LIMoE, MoMa and DeepSeek-style recipes: the
#: pipeline's variants less the dense backbone and the three the claims themselves compare.
ROUTER_VARIANTS = tuple(variant for variant in VARIANTS if variant not in ("dense", "xmoe", "mhmoe", "stratified"))
#: The fine-tuning rules of the inter-run consistency, each a row of its own: both routers' routing frozen (X-MoE
#: §3.3), both fine-tuned whole.
CONSISTENCY_RULES = ("frozen", "trained")
#: Every claim of the study by id, in the report's order (:mod:`mmoe.study.claims`).
CLAIM_IDS = (
    "activation",
    "diversity",
    "collapse",
    "fluctuation",
    "consistency",
    "consistency_trained",
    "tasks",
    "pretraining",
    "capacity",
    "frequency",
)
#: The window of claims 3 and 4 in the default: from 30% of the snapshots on, i.e. from the warm-up's end (step 30 of
#: 100) where the learning rate is constant (the paper's fluctuation is read after 15K of 125K steps, 12%).
ROUTING_WINDOW = 0.3


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
        claims: the claims the preset trains and decides (:data:`CLAIM_IDS`); the task order (claim 6) where
            ``run_tasks`` too. Each other claim's plan row says it is not run and which preset runs it.
        task_pretraining_seeds: pre-training seeds of each task variant (claim 6 is decided over them from 2 on, the
            fine-tuning seeds averaged within each).
        routing_window: share of the snapshots (in order) before the judged window of claims 3 and 4: from the
            warm-up's end on.
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
    claims: tuple[str, ...] = CLAIM_IDS
    task_pretraining_seeds: int = 1
    routing_window: float = ROUTING_WINDOW

    def __post_init__(self) -> None:
        if self.router_steps % self.snapshot_every:
            raise ValueError(
                f"router_steps ({self.router_steps}) must be a multiple of snapshot_every "
                f"({self.snapshot_every}): the last snapshot is the run's end"
            )
        counts = {
            "routing_seeds": self.routing_seeds,
            "pretraining_backbones": self.pretraining_backbones,
            "seeds": self.seeds,
            "task_seeds": self.task_seeds,
            "task_pretraining_seeds": self.task_pretraining_seeds,
        }
        for name, count in counts.items():
            if count < 0:
                raise ValueError(f"{name} must be at least 0, got {count}")
        unknown = [claim for claim in self.claims if claim not in CLAIM_IDS]
        if unknown:
            raise ValueError(f"claims holds {unknown[0]!r}, expected claims among {', '.join(CLAIM_IDS)}")
        if self.run_tasks and "tasks" not in self.claims:
            raise ValueError("run_tasks trains the task order, but claims leaves out 'tasks'")
        for claim, runs in self._runs_by_claim().items():
            if self.runs_claim(claim) and not runs:
                raise ValueError(f"claims holds {claim!r}, but the settings train none of its runs")
        if not 0.0 <= self.routing_window < 1.0:
            raise ValueError(f"routing_window must be in [0, 1), got {self.routing_window}")
        if "vqav2" not in self.pretraining_recipe.finetune_steps:
            raise ValueError("pretraining_recipe must give VQA (vqav2) fine-tuning steps")

    def _runs_by_claim(self) -> dict[str, int]:
        """Per claim, how many runs its arms get from the counts (0: none trained)."""
        routing = self.routing_seeds
        return {
            "activation": routing * len(self.heads),
            "diversity": routing * len(self.heads) + len(self.diversity_runs) * self.diversity_seeds,
            "collapse": routing,
            "fluctuation": routing,
            "consistency": routing and self.seeds,
            "consistency_trained": routing and self.seeds,
            "tasks": len(self.task_variants) * self.task_pretraining_seeds * self.task_seeds,
            "pretraining": self.pretraining_backbones,
            "capacity": 1,
            "frequency": 1,
        }

    def runs_claim(self, claim: str) -> bool:
        """Whether this preset trains and decides ``claim`` (an id of :data:`CLAIM_IDS`)."""
        return claim in self.claims and (claim != "tasks" or self.run_tasks)

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
    ),
    pretraining_backbones=2,
    router_table_steps=8,
    analysis_batches=2,
    analysis_batch_size=16,
    analysis_rows=500,
)

#: The GPU presets' training: bf16, batch 64, on the medium corpus (10,000 training images, 1,000 test images: a
#: 1,000-step run at batch 64 sees its pairs about once; the large corpus would add minutes of generation and codebook
#: fitting the estimate does not count), the audit's 2,000 pre-training and 1,000 fine-tuning steps for the task order.
_GPU_TRAINING = DEMO.replace(
    corpus_size="medium",
    finetune_steps={"vqav2": 1000, "nlvr2": 1000, "captioning": 1000},
    pretrain_steps=2000,
    batch_size=64,
    checkpoint_every=500,
    precision="bf16-mixed",
)

#: ``--scale gpu``: claims 2, 4 and 7 at the designs that decide them with 8 runs per arm, for one GPU loan (several
#: tiny runs at once, ``--jobs 8``): claim 2, MH-MoE h = 8 over 16 experts (headroom below min(h, E)), 8 seeds x 1,000
#: steps; claim 4, Switch and X-MoE at 32 experts, 8 seeds x 1,000 steps, a snapshot every 100, a constant learning
#: rate after the warm-up and the window from the warm-up's end (the first snapshot after step 30 is step 100:
#: ``routing_window`` 0.1); claim 7, 8 pre-trainings with the demo's recipe against 8 random inits, VQA fine-tuned at
#: the demo's steps. Claims 1, 3, 5, 8 and 9 and the router table are the default's, the task order ``--scale
#: gpu-tasks``'s (none of their runs is trained: ``heads``, ``seeds`` and ``router_variants`` are empty).
GPU = dataclasses.replace(
    DEFAULT,
    training=_GPU_TRAINING,
    claims=("diversity", "fluctuation", "pretraining"),
    run_tasks=False,
    routing_seeds=8,
    router_steps=1000,
    snapshot_every=100,
    routing_window=0.1,
    heads=(),
    diversity_runs=((8, 16),),
    diversity_seeds=8,
    seeds=0,
    pretraining_recipe=DEMO_RECIPE.replace(corpus_size="medium", precision="bf16-mixed"),
    pretraining_backbones=8,
    router_variants=(),
    analysis_batches=8,
    analysis_batch_size=64,
)

#: ``--scale gpu-tasks``: the task order (claim 6, MH-MoE Table 4) at the audit's design, for a loan longer than one
#: GPU's 15 minutes (about 20-35 minutes): dense, X-MoE and MH-MoE each pre-trained under 3 seeds x 2,000 steps, each
#: pre-training fine-tuned on VQA, NLVR2 and captioning under 3 seeds x 1,000 steps; decided over the pre-training
#: seeds (the fine-tuning seeds averaged within each), Holm over the order's gaps, uninformative where a variant is
#: not above its task's baseline. No other claim's runs are trained.
GPU_TASKS = dataclasses.replace(
    GPU,
    claims=("tasks",),
    run_tasks=True,
    task_pretraining_seeds=3,
    task_seeds=3,
    routing_seeds=0,
    diversity_runs=(),
    diversity_seeds=1,
    pretraining_backbones=0,
    routing_window=ROUTING_WINDOW,
)

#: The presets by the name the plan records (``--scale`` takes the GPU ones).
PRESETS = {"default": DEFAULT, "fast": FAST, "gpu": GPU, "gpu-tasks": GPU_TASKS}
#: The presets ``--scale`` names.
SCALES = ("gpu", "gpu-tasks")
