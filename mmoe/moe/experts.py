"""Grouped expert FFNs run on rows already sorted by expert.

Each expert is ``fc2(act(fc1(x)))`` (optionally with BEiT-3's Sub-LN before ``fc2``), ``dim -> hidden -> dim``. The
weights of all experts are stacked (``fc1_weight: (E, D, H)``) and applied to contiguous row slices in one of two
ways, chosen per call:

* GPU: one grouped GEMM per linear (``torch._grouped_mm``, slice ends ``offsets`` kept on the device: no host sync).
* CPU with >= 256 rows per expert, or where the grouped GEMM is unavailable for the device / dtype / alignment: a
  per-expert ``addmm`` loop over ``unbind``-ed weights. On a CPU reading the counts costs nothing, and the fused
  bias saves the (R, H) gathered bias of the grouped path (faster fwd+bwd at >= 512 rows per expert:
  ``benchmarks/moe_layer.py``, README.md's Benchmarks section). ``unbind`` keeps the backward O(E); indexing
  ``W[e]`` in a loop would write E full-size zero gradients.

Shape legend: R rows (sorted choices), E experts, D model (or head) width, H expert hidden width.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mmoe.moe.dispatch import DispatchPlan
from mmoe.moe.expert_parallel import (
    EXPERT_PARALLEL_ATTRIBUTE,
    ExpertShard,
    gather_full_experts,
    keep_local_experts,
    scale_gradient,
)

#: Mean rows per expert from which the CPU per-expert addmm loop beats the grouped GEMM (benchmarks/moe_layer.py).
CPU_LOOP_MIN_ROWS = 256


def _grouped_mm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm") or x.dtype != weight.dtype:
        return False
    if x.device.type == "cuda":
        # The fused kernel exists for bf16 on Hopper (SM90) and newer.
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device)[0] < 9:
            return False
    elif x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    # Strides must be multiples of 16 bytes.
    elements = 16 // x.element_size()
    return all(size % elements == 0 for size in weight.shape[1:])


class GroupedExperts(nn.Module):
    """E expert FFNs ``D -> H -> D`` with GELU, stacked for grouped GEMMs.

    Args:
        num_experts: E.
        dim: input and output width D (the sub-token width D/h for MH-MoE).
        hidden_dim: inner width H (``ffn_dim * beta``).
        subln: LayerNorm over the hidden activation before the second linear (BEiT-3 Sub-LN).

    Attributes:
        num_experts: the experts held here: E, or E/W once sharded (:meth:`keep_shard`).
        shard: which of the layer's experts this rank holds when expert-parallel; None: all of them.
    """

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, subln: bool = False) -> None:
        super().__init__()
        self.num_experts, self.dim, self.hidden_dim = num_experts, dim, hidden_dim
        self.shard: ExpertShard | None = None
        self.fc1_weight = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.fc1_bias = nn.Parameter(torch.empty(num_experts, hidden_dim))
        self.fc2_weight = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.fc2_bias = nn.Parameter(torch.empty(num_experts, dim))
        if subln:
            self.ln_weight = nn.Parameter(torch.ones(num_experts, hidden_dim))
            self.ln_bias = nn.Parameter(torch.zeros(num_experts, hidden_dim))
        else:
            self.register_parameter("ln_weight", None)
            self.register_parameter("ln_bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert initialised as ``nn.Linear`` would be (kaiming-uniform weights, uniform biases)."""
        for weight, bias, fan_in in (
            (self.fc1_weight, self.fc1_bias, self.dim),
            (self.fc2_weight, self.fc2_bias, self.hidden_dim),
        ):
            bound = 1.0 / math.sqrt(fan_in)
            nn.init.uniform_(weight, -bound, bound)
            nn.init.uniform_(bias, -bound, bound)

    @torch.no_grad()
    def keep_shard(self, shard: ExpertShard) -> None:
        """Keep only this rank's experts ``shard.first .. shard.first + shard.local - 1`` (expert parallelism,
        :mod:`mmoe.moe.expert_parallel`).

        The expert parameters become new (E/W, ...) parameters marked ``expert_parallel = True``, with their
        ``requires_grad``; their gradients are scaled by 1/W. ``state_dict`` then gathers every rank's experts (a
        collective) and ``load_state_dict`` takes a full (E, ...) stack and keeps this rank's slice.
        """
        if self.shard is not None:
            raise ValueError(f"these experts are sharded already ({self.shard.local} of {self.shard.num_experts} here)")
        if shard.num_experts != self.num_experts:
            raise ValueError(f"a shard of {shard.num_experts} experts does not fit {self.num_experts} experts")
        for name, parameter in list(self.named_parameters(recurse=False)):
            local = nn.Parameter(
                parameter[shard.first : shard.first + shard.local].clone(), requires_grad=parameter.requires_grad
            )
            setattr(local, EXPERT_PARALLEL_ATTRIBUTE, True)
            if shard.size > 1 and local.requires_grad:
                local.register_hook(scale_gradient(1.0 / shard.size))
            setattr(self, name, local)
        self.num_experts = shard.local
        self.shard = shard
        self.register_state_dict_post_hook(gather_full_experts)
        self.register_load_state_dict_pre_hook(keep_local_experts)

    def forward(self, x_RD: torch.Tensor, expert_R: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        """Apply expert ``expert_R[r]`` to row r; rows are sorted by expert and ``offsets_E`` ends each slice."""
        # GPU: always grouped (no host sync). CPU: the addmm loop wins once experts get >= 256 rows on average;
        # below that small GEMMs dominate and the grouped kernel is faster.
        prefer_grouped = x_RD.device.type == "cuda" or x_RD.shape[0] < CPU_LOOP_MIN_ROWS * self.num_experts
        if prefer_grouped and _grouped_mm_supported(x_RD, self.fc1_weight.to(x_RD.dtype)):
            return self.forward_grouped(x_RD, expert_R, offsets_E)
        return self.forward_loop(x_RD, offsets_E)

    def forward_every_expert(self, x_SD: torch.Tensor) -> torch.Tensor:
        """The sum of every expert's output on every row (always-on experts: DeepSeekMoE §3.2, Eq. 9), (S, D)."""
        num_rows = x_SD.shape[0]
        experts_E = torch.arange(self.num_experts, device=x_SD.device)
        expert_R = experts_E.repeat_interleave(num_rows)
        offsets_E = ((experts_E + 1) * num_rows).to(torch.int32)
        out_RD = self(x_SD.repeat(self.num_experts, 1), expert_R, offsets_E)
        width = out_RD.shape[-1]
        # A product with ones rather than .sum(0): its backward materialises the gradient, where sum's passes on a
        # stride-0 view that the grouped GEMM's backward refuses.
        ones_E = out_RD.new_ones(self.num_experts)
        return (ones_E @ out_RD.view(self.num_experts, num_rows * width)).view(num_rows, width)

    def forward_grouped(self, x_RD: torch.Tensor, expert_R: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        """One grouped GEMM per linear, slice ends on the device: no host sync (the GPU path).

        Per-expert vectors (biases, Sub-LN affine) reach their rows as ``one_hot @ vectors`` (fused into ``addmm``
        where it adds), so their gradients are (E, R) x (R, H) GEMMs rather than a scatter-add of R rows onto E rows,
        which on a GPU serialises on atomics.
        """
        dtype = x_RD.dtype
        one_hot_RE = (expert_R[:, None] == torch.arange(self.num_experts, device=expert_R.device)).to(dtype)
        hidden_RH = torch._grouped_mm(x_RD, self.fc1_weight.to(dtype), offs=offsets_E)
        # .to(dtype): under an autocast of another dtype addmm and @ return the autocast dtype.
        hidden_RH = F.gelu(torch.addmm(hidden_RH, one_hot_RE, self.fc1_bias.to(dtype)).to(dtype))
        if self.ln_weight is not None:
            # Autocast runs layer_norm in fp32; the grouped GEMM is no autocast op and needs both operands in dtype.
            hidden_RH = F.layer_norm(hidden_RH, (self.hidden_dim,)).to(dtype)
            ln_weight_RH = (one_hot_RE @ self.ln_weight.to(dtype)).to(dtype)
            hidden_RH = torch.addcmul((one_hot_RE @ self.ln_bias.to(dtype)).to(dtype), hidden_RH, ln_weight_RH)
        out_RD = torch._grouped_mm(hidden_RH, self.fc2_weight.to(dtype), offs=offsets_E)
        return torch.addmm(out_RD, one_hot_RE, self.fc2_bias.to(dtype)).to(dtype)

    def forward_fused(self, x_SD: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        """The experts on the (sub-)tokens ``x_SD`` with the dispatch gather fused into the first linear and the
        inverse permutation into the second (:mod:`mmoe.moe.triton_experts`); returns the (K*S, D) outputs in choice
        order, for :func:`mmoe.moe.dispatch.combine_unsorted`."""
        from mmoe.moe.triton_experts import fused_expert_ffn

        return fused_expert_ffn(
            x_SD, self.fc1_weight, self.fc1_bias, self.fc2_weight, self.fc2_bias, self.ln_weight, self.ln_bias,
            plan.token_C, plan.order_C, plan.expert_C, plan.offsets_E, plan.kept_SK.shape[1],
        )  # fmt: skip

    def forward_loop(self, x_RD: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        """One fused ``addmm`` per expert and linear over its slice (the CPU path: reading the counts is free there,
        and the bias rides in the GEMM instead of an (R, H) gathered bias)."""
        dtype = x_RD.dtype
        counts = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1)).tolist()
        ln_weights = self.ln_weight.unbind(0) if self.ln_weight is not None else [None] * self.num_experts
        ln_biases = self.ln_bias.unbind(0) if self.ln_bias is not None else [None] * self.num_experts
        outputs = []
        for rows, fc1_w, fc1_b, ln_w, ln_b, fc2_w, fc2_b in zip(
            torch.split(x_RD, counts),
            self.fc1_weight.to(dtype).unbind(0),
            self.fc1_bias.to(dtype).unbind(0),
            ln_weights,
            ln_biases,
            self.fc2_weight.to(dtype).unbind(0),
            self.fc2_bias.to(dtype).unbind(0),
            strict=True,
        ):
            hidden = F.gelu(torch.addmm(fc1_b, rows, fc1_w))
            if ln_w is not None:
                hidden = F.layer_norm(hidden, (self.hidden_dim,), ln_w.to(dtype), ln_b.to(dtype))
            outputs.append(torch.addmm(fc2_b, hidden, fc2_w))
        return torch.cat(outputs)
