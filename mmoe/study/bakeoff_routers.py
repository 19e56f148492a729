"""The routers of ``mmoe study routers`` (the bake-off at equal active compute), one typed entry each: a name and the
fields it lays over the backbone of ``configs/pretrain/tiny.yaml`` (dense, no MoE layer), nothing else. A router
joins the bake-off by one more entry in :data:`ROUTERS`; the plan counts its active FLOPs per token
(:mod:`mmoe.study.bakeoff_cost`) and refuses it unless they equal the dense FFN's within the plan's tolerance.

Every MoE entry keeps Switch's layout (an MoE FFN in every other layer, one pool per modality, a linear router with a
softmax gate) and changes only how tokens meet experts, so that the routers differ in routing alone:

* ``switch`` (Fedus et al., 2022): top-1 over 8 experts as wide as the dense FFN.
* ``top2`` (GShard top-2 with DeepSeekMoE §3.1's fine-grained segmentation): 16 experts half the FFN wide, top-2, so a
  token passes two half-width experts (the same expert parameters as Switch's 8 full-width ones).
* ``expert_choice`` (Zhou et al., 2022, §3.2): each of 8 experts takes its top C = c n / E tokens, capacity factor
  c = 1, one full-width expert per token on average.
* ``remoe`` (Wang et al., ICLR 2025): ReLU gates over 8 full-width experts, the adaptive L1 penalty holding k = 1
  expert per token on average (its target, which ``mmoe info`` counts), its coefficient starting from
  ``configs/pretrain/tiny/remoe.yaml``'s lambda_0 (:data:`REMOE_L1_INITIAL`, not the paper's 1e-8: from 1e-8 the
  coefficient only matters after about 60 of the plan's 100 steps, so the router would run near 4 experts per token
  for most of the training).
* ``top_p`` (Huang et al., 2024, with mmoe's controller): 16 half-width experts as ``top2``'s, each token taking its
  experts up to a cumulative probability p that a controller moves to hold 2 of them on average (one full-width
  expert's FLOPs); the dynamic loss at the paper's 1e-4.
* ``null_experts`` (AdaMoE, Zeng et al., 2024): top-2 over 8 full-width experts and 8 null experts that output 0, one
  real expert per token at balance over the pool.

Soft MoE and Mixture-of-Depths are not in the bake-off: a Soft MoE layer's FLOPs per token follow each modality's
sequence length (its slots are per sequence, so one slot count cannot give both the image and the text pools the
dense FFN's FLOPs), and Mixture-of-Depths changes the block's compute, not the FFN's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RouterPreset:
    """One router of the bake-off.

    Attributes:
        name: what the plan, the run folders and the report call it.
        backbone: :class:`mmoe.model.MultiwayConfig` fields laid over the tiny configs' backbone (``moe``: the
            :class:`mmoe.model.MoEPlan` fields of its MoE layers; none for the dense baseline).
    """

    name: str
    backbone: Mapping[str, Any]


#: The MoE layout every MoE entry shares: Switch's in ``configs/pretrain/tiny/switch.yaml``.
SWITCH_LAYOUT = {"router": "linear", "gate": "softmax", "every": 2, "mode": "per_modality"}

#: ReMoE's lambda_0 at tiny scale, as ``configs/pretrain/tiny/remoe.yaml`` sets it (a test holds the two equal).
REMOE_L1_INITIAL = 3.0e-4

#: The router every other is tested against.
BASELINE = "switch"

#: Top-2's experts: each of Switch's 8 split in two (DeepSeekMoE's segmentation m = 2), a token routed to 2 of them.
TOP2_SEGMENTS = 2

ROUTERS = (
    RouterPreset("dense", {}),
    RouterPreset(BASELINE, {"moe": {**SWITCH_LAYOUT, "num_experts": 8, "top_k": 1}}),
    RouterPreset(
        "top2",
        {"moe": {**SWITCH_LAYOUT, "num_experts": 8 * TOP2_SEGMENTS, "top_k": TOP2_SEGMENTS, "beta": 1 / TOP2_SEGMENTS}},
    ),
    RouterPreset(
        "expert_choice",
        {"moe": {**SWITCH_LAYOUT, "num_experts": 8, "routing": "expert_choice", "capacity_factor": 1.0}},
    ),
    RouterPreset(
        "remoe",
        {
            "moe": {
                **SWITCH_LAYOUT,
                "num_experts": 8,
                "top_k": 1,
                "gate": "relu",
                "renormalize": False,
                "relu_l1_initial": REMOE_L1_INITIAL,
            }
        },
    ),
    RouterPreset(
        "top_p",
        {
            "moe": {
                **SWITCH_LAYOUT,
                "num_experts": 8 * TOP2_SEGMENTS,
                "beta": 1 / TOP2_SEGMENTS,
                "top_p": 0.4,
                "target_active_experts": float(TOP2_SEGMENTS),
                "renormalize": False,
                "dynamic_loss_weight": 1.0e-4,
            }
        },
    ),
    RouterPreset("null_experts", {"moe": {**SWITCH_LAYOUT, "num_experts": 8, "top_k": 2, "null_experts": 8}}),
)
