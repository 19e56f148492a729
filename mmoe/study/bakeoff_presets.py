"""The presets of ``mmoe study routers`` (``--scale fast | cpu | gpu``): the training settings every router's runs
share, the seeds and the held-out batches the routing is measured on. Each becomes a plan
(:func:`mmoe.study.bakeoff_plan.design`) with its estimated cost (:mod:`mmoe.study.bakeoff_cost`)."""

from __future__ import annotations

from dataclasses import dataclass

from mmoe.pipeline.settings import TrainingSettings
from mmoe.study.bakeoff_cost import BAKEOFF_CPU_COSTS, BAKEOFF_GPU_COSTS, Estimate, estimate
from mmoe.study.cost import StepCosts
from mmoe.study.settings import DEFAULT, FAST


@dataclass(frozen=True)
class BakeoffPreset:
    """One scale of the bake-off.

    Attributes:
        name: ``fast``, ``cpu`` or ``gpu``.
        training: the settings of every pre-training and VQA fine-tuning (the same for each router and seed).
        seeds: pre-training seeds per router (each also the seed of its VQA fine-tuning).
        analysis_batches: held-out batches the routing (load CV, experts per token) is measured on.
        analysis_batch_size: pairs per such batch.
        costs: the seconds per step its estimate is made from.
        notes: why the preset is what it is (the plan's design notes).
    """

    name: str
    training: TrainingSettings
    seeds: int
    analysis_batches: int
    analysis_batch_size: int
    costs: StepCosts
    notes: tuple[str, ...] = ()

    def estimate(self, seeds: int, routers: int, jobs: int = 1) -> Estimate:
        steps = self.training.finetune_steps["vqav2"]
        return estimate(seeds * routers, self.training.pretrain_steps, steps, self.costs, jobs)


#: The claims study's default training (BEiT-3's masked data modelling alone, the tiny configs' width 192 and learning
#: rate, batch 32, the small corpus) with VQA alone fine-tuned.
_CPU_TRAINING = DEFAULT.training.replace(pretrain_steps=100, finetune_steps={"vqav2": 100})

PRESETS = {
    "fast": BakeoffPreset(
        "fast",
        FAST.training.replace(pretrain_steps=3, finetune_steps={"vqav2": 3}),
        seeds=3,
        analysis_batches=1,
        analysis_batch_size=8,
        costs=BAKEOFF_CPU_COSTS,
        notes=("A test of the command's whole path at a width of 96 for 3 steps: its numbers decide nothing.",),
    ),
    "cpu": BakeoffPreset(
        "cpu",
        _CPU_TRAINING,
        seeds=3,
        analysis_batches=4,
        analysis_batch_size=32,
        costs=BAKEOFF_CPU_COSTS,
        notes=(
            "The claims study's training (BEiT-3's masked data modelling, so the matching probes read the pooled "
            "features) for 100 pre-training and 100 VQA steps, every router and seed alike; 3 seeds per router, the "
            "fewest a Welch interval takes, so that the default fits 60 minutes on the 2-core CPU.",
        ),
    ),
    "gpu": BakeoffPreset(
        "gpu",
        DEFAULT.training.replace(
            corpus_size="medium",
            pretrain_steps=1000,
            finetune_steps={"vqav2": 500},
            batch_size=64,
            checkpoint_every=500,
            precision="bf16-mixed",
        ),
        seeds=5,
        analysis_batches=8,
        analysis_batch_size=64,
        costs=BAKEOFF_GPU_COSTS,
        notes=(
            "The claims study's GPU corpus and batch (medium corpus, batch 64, bf16) with 1,000 pre-training and 500 "
            "VQA steps, and 5 seeds per router for a smaller detectable effect than 3 give.",
        ),
    ),
}
