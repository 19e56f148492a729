"""What the bake-off's runs cost: each router's active FLOPs per token, counted by ``mmoe info``'s closed forms
(:func:`mmoe.model.cost.backbone_cost`) on the backbone the run trains, against the dense FFN's; and each preset's
estimated time, from measured seconds per step (:class:`mmoe.study.cost.StepCosts`): an estimate, not a measurement.

The FLOPs gap of a router is (F_router - F_dense) / F_ffn: F the backbone's forward FLOPs per token in the weights
(attention projections, FFNs or MoE layers with their routers), F_ffn the dense backbone's FFNs alone. Attention is
the same in every router today, so the gap is the MoE layers' FFN FLOPs against the dense FFNs' (routers included);
a router that also changes what a token passes besides its FFN (a token skipping a block) shows that too.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mmoe.model.config import MultiwayConfig, config_from_dict
from mmoe.model.cost import backbone_cost, ffn_flops_per_token
from mmoe.pipeline.settings import TrainingSettings
from mmoe.study.cost import CPU_COSTS, GPU_COSTS, StepCosts


@functools.cache
def _tiny_backbone() -> dict[str, Any]:
    """The backbone fields of ``configs/pretrain/tiny.yaml`` as the CLI's parser reads them (about a second, once)."""
    from mmoe.config.launch import read_config
    from mmoe.pipeline.launch import pretrain_configs

    return read_config(pretrain_configs("dense")).fit.model.init_args.backbone.as_dict()


def trained_backbone(settings: TrainingSettings, overrides: Mapping[str, Any]) -> MultiwayConfig:
    """The backbone a bake-off run trains: the tiny configs' with ``settings``' changes and the router's
    ``overrides`` (:attr:`mmoe.study.bakeoff_routers.RouterPreset.backbone`) laid over it, as the run's spec lays
    them."""
    fields = _tiny_backbone() | dict(settings.backbone) | {"image_size": settings.image_size} | dict(overrides)
    return config_from_dict(fields)


def active_flops(config: MultiwayConfig) -> int:
    """Forward FLOPs per token in the backbone's weights (``mmoe info``'s ``flops_per_token``; an adaptive router's
    expected count)."""
    return int(backbone_cost(config, config.num_patches + 1)["flops_per_token"])


def dense_ffn_flops(config: MultiwayConfig) -> int:
    """Forward FLOPs per token of the backbone's FFNs were every one dense (one per layer)."""
    return config.depth * ffn_flops_per_token(config.dim, config.ffn_dim)


def router_flops(settings: TrainingSettings, overrides: Mapping[str, Any]) -> dict[str, float]:
    """A router's ``active_flops_per_token`` and its ``flops_gap`` to the dense backbone, as a share of the dense
    FFNs' FLOPs (the module docstring)."""
    dense = trained_backbone(settings, {})
    flops = active_flops(trained_backbone(settings, overrides))
    return {"active_flops_per_token": flops, "flops_gap": (flops - active_flops(dense)) / dense_ffn_flops(dense)}


#: The claims study's CPU step costs (:data:`mmoe.study.cost.CPU_COSTS`), measured on the idle 2-core machine under
#: the training settings the ``cpu`` preset shares (width 192, batch 32, masked data modelling alone, the small corpus;
#: the claims study's default run took 56.7 min against the 57 min they estimate), one training at a time; a run's
#: measurement (the routing pass and the masked image modelling pass over the held-out batches) 5 s.
BAKEOFF_CPU_COSTS = dataclasses.replace(CPU_COSTS, machine="the 2-core CPU", snapshot=0.0, measure=5.0)
#: The claims study's GPU step costs (the tiny configs on one H100 in bf16, docs/tutorials/demo_details.md), one
#: training at a time: ``mmoe study routers`` runs no lanes.
BAKEOFF_GPU_COSTS = dataclasses.replace(
    GPU_COSTS, machine="one H100 (the claims study's GPU step costs)", snapshot=0.0, streams=1
)


@dataclass(frozen=True)
class Estimate:
    """A preset's estimated cost.

    Attributes:
        trainings: pre-trainings and fine-tunings.
        seconds: the whole run's estimated seconds on ``machine`` (the corpus and codebook stages left out).
        machine: the step costs' machine, in words.
        lanes: runs at once.
    """

    trainings: int
    seconds: float
    machine: str
    lanes: int = 1

    def text(self) -> str:
        hours = f" ({self.seconds / 3600:.2f} GPU-hours)" if "H100" in self.machine else ""
        lanes = f", {self.lanes} lanes at once" if self.lanes > 1 else ", one run at a time"
        return (
            f"{self.trainings} trainings, about {self.seconds / 60:.0f} min{hours} on {self.machine}{lanes} (estimated "
            "from seconds per step and per training, `mmoe.study.bakeoff_cost`; not a measurement)"
        )


def estimate(runs: int, pretrain_steps: int, finetune_steps: int, costs: StepCosts, jobs: int = 1) -> Estimate:
    """The cost of ``runs`` (router, seed) runs: each a pre-training with its held-out validation, a VQA fine-tuning
    with its scored prediction and the routing measurement of its backbone; ``jobs`` lanes at once each take their
    share, as if they did not slow each other (on the 2-core CPU, 2 at most: the demo's measurement)."""
    per_run = (
        pretrain_steps * costs.pretrain
        + finetune_steps * costs.finetune
        + 2 * costs.per_training
        + costs.evaluation
        + costs.measure
    )
    lanes = max(1, min(jobs, runs))
    return Estimate(2 * runs, math.ceil(runs / lanes) * per_run, costs.machine, lanes)
