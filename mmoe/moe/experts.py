"""Grouped expert FFNs run on rows already sorted by expert.

Each expert is ``fc2(act(fc1(x)))`` (optionally with BEiT-3's Sub-LN before ``fc2``), ``dim -> hidden -> dim``. The
weights of all experts are stacked (``fc1_weight: (E, D, H)``) and applied to contiguous row slices in one of two
ways, chosen per call:

* Every expert's slice the same length (expert choice's C rows, the shared experts' S rows: known by the caller, on
  any device; a CPU plan whose counts happen to be equal): one batched GEMM per linear (``baddbmm`` over an
  (E, R/E, D) view, biases fused).
* GPU: one grouped GEMM per linear (``torch._grouped_mm``, slice ends ``offsets`` kept on the device: no host sync).
* CPU, uneven slices (reading the counts costs nothing there): below 256 rows per expert the grouped GEMM. From
  there, while padding every slice to the longest adds at most :data:`CPU_PAD_TOLERANCE` rows per row, the rows are
  padded with zeros into (E, max count, D) and run batched: a few kernels per linear whatever E, where a per-expert
  loop issues E small GEMMs, each its own parallel region (on a shared 2-core CPU a descheduled thread stalls each of
  them; ``benchmarks/moe_layer.py``). Otherwise, and always on one torch thread (no parallel region to stall, so
  the padding is only extra rows: top-2's layer 1.25-1.3x a dense FFN padded, 1.0x not, in CPU seconds,
  ``benchmarks/moe_layer.py --cpu-time``), a per-expert ``addmm`` loop over ``unbind``-ed weights (the fused
  bias saves the (R, H) gathered bias of the grouped path). ``unbind`` keeps the backward O(E); indexing ``W[e]`` in
  a loop would write E full-size zero gradients.

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
#: Padded rows (E x the longest slice) per real row up to which the CPU pads uneven slices and runs them batched.
CPU_PAD_TOLERANCE = 1.25


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
        subln_eps: that LayerNorm's epsilon (a backbone's ``MultiwayConfig.layernorm_eps``).

    Attributes:
        num_experts: the experts held here: E, or E/W once sharded (:meth:`keep_shard`).
        shard: which of the layer's experts this rank holds when expert-parallel; None: all of them.
    """

    def __init__(
        self, num_experts: int, dim: int, hidden_dim: int, subln: bool = False, subln_eps: float = 1e-5
    ) -> None:
        super().__init__()
        self.num_experts, self.dim, self.hidden_dim, self.subln_eps = num_experts, dim, hidden_dim, subln_eps
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

    def forward(
        self, x_RD: torch.Tensor, expert_R: torch.Tensor, offsets_E: torch.Tensor, rows_per_expert: int | None = None
    ) -> torch.Tensor:
        """Apply expert ``expert_R[r]`` to row r; rows are sorted by expert and ``offsets_E`` ends each slice.
        ``rows_per_expert``: every slice has this many rows (a static shape the caller knows), run batched."""
        if rows_per_expert is not None:
            return self.forward_batched(x_RD)
        if x_RD.device.type == "cuda":  # no host sync: the counts stay on the device
            if _grouped_mm_supported(x_RD, self.fc1_weight.to(x_RD.dtype)):
                return self.forward_grouped(x_RD, expert_R, offsets_E)
            return self.forward_loop(x_RD, offsets_E)
        counts = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1)).tolist()
        longest = max(counts, default=0)
        if longest * self.num_experts == x_RD.shape[0]:  # equal slices
            return self.forward_batched(x_RD)
        if x_RD.shape[0] < CPU_LOOP_MIN_ROWS * self.num_experts and _grouped_mm_supported(
            x_RD, self.fc1_weight.to(x_RD.dtype)
        ):
            return self.forward_grouped(x_RD, expert_R, offsets_E)
        if torch.get_num_threads() > 1 and longest * self.num_experts <= CPU_PAD_TOLERANCE * x_RD.shape[0]:
            return self.forward_padded(x_RD, counts)
        return self.forward_loop(x_RD, offsets_E)

    def forward_batched(self, x_RD: torch.Tensor) -> torch.Tensor:
        """Every expert on its R/E rows (equal slices), one ``baddbmm`` per linear with the bias fused."""
        return self._batched(x_RD.reshape(self.num_experts, -1, self.dim)).reshape(x_RD.shape[0], self.dim)

    def _batched(self, x_ECD: torch.Tensor) -> torch.Tensor:
        dtype = x_ECD.dtype
        # .to(dtype): under an autocast of another dtype baddbmm returns the autocast dtype.
        hidden_ECH = F.gelu(torch.baddbmm(self.fc1_bias.to(dtype)[:, None], x_ECD, self.fc1_weight.to(dtype)).to(dtype))
        if self.ln_weight is not None:
            normed_ECH = F.layer_norm(hidden_ECH, (self.hidden_dim,), eps=self.subln_eps).to(dtype)
            hidden_ECH = torch.addcmul(self.ln_bias.to(dtype)[:, None], normed_ECH, self.ln_weight.to(dtype)[:, None])
        return torch.baddbmm(self.fc2_bias.to(dtype)[:, None], hidden_ECH, self.fc2_weight.to(dtype)).to(dtype)

    def forward_padded(self, x_RD: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Uneven slices (``counts`` rows each, read on the host) padded with zero rows to the longest and run
        batched; the padding's outputs are dropped, so it gets no gradient."""
        longest = max(counts)
        counts_E = torch.tensor(counts, device=x_RD.device)
        starts_E = counts_E.cumsum(0) - counts_E
        slot_shift_E = torch.arange(self.num_experts, device=x_RD.device) * longest - starts_E
        slot_R = torch.arange(x_RD.shape[0], device=x_RD.device) + slot_shift_E.repeat_interleave(counts_E)
        padded_PD = x_RD.new_zeros(self.num_experts * longest, self.dim).index_copy(0, slot_R, x_RD)
        return self.forward_batched(padded_PD).index_select(0, slot_R)

    def forward_every_expert(self, x_SD: torch.Tensor) -> torch.Tensor:
        """The sum of every expert's output on every row (always-on experts: DeepSeekMoE §3.2, Eq. 9), (S, D)."""
        return self._batched(x_SD.expand(self.num_experts, -1, -1)).sum(0)

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
            hidden_RH = F.layer_norm(hidden_RH, (self.hidden_dim,), eps=self.subln_eps).to(dtype)
            ln_weight_RH = (one_hot_RE @ self.ln_weight.to(dtype)).to(dtype)
            hidden_RH = torch.addcmul((one_hot_RE @ self.ln_bias.to(dtype)).to(dtype), hidden_RH, ln_weight_RH)
        out_RD = torch._grouped_mm(hidden_RH, self.fc2_weight.to(dtype), offs=offsets_E)
        return torch.addmm(out_RD, one_hot_RE, self.fc2_bias.to(dtype)).to(dtype)

    def forward_fused(self, x_SD: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        """The experts on the (sub-)tokens ``x_SD`` with the dispatch gather fused into the first linear and the
        inverse permutation into the second (:mod:`mmoe.moe.triton_experts`); returns the (K*S, D) outputs in choice
        order, for :func:`mmoe.moe.dispatch.combine_unsorted`."""
        return self._fused(x_SD, plan.token_C, plan.order_C, plan.expert_C, plan.offsets_E, plan.kept_SK.shape[1])

    def forward_fused_rows(
        self, x_SD: torch.Tensor, token_C: torch.Tensor, expert_C: torch.Tensor, offsets_E: torch.Tensor
    ) -> torch.Tensor:
        """The fused path for rows that are not K choices per token (expert choice): row r is expert
        ``expert_C[r]`` on (sub-)token ``token_C[r]``, gathered inside the first linear; (C, D) outputs in row order."""
        rows_C = torch.arange(token_C.numel(), device=token_C.device)
        return self._fused(x_SD, token_C, rows_C, expert_C, offsets_E, None)

    def _fused(self, x_SD, token_C, order_C, expert_C, offsets_E, top_k: int | None) -> torch.Tensor:
        from mmoe.moe.triton_expert_ffn import fused_expert_ffn

        weights = (self.fc1_weight, self.fc1_bias, self.fc2_weight, self.fc2_bias, self.ln_weight, self.ln_bias)
        return fused_expert_ffn(x_SD, *weights, self.subln_eps, token_C, order_C, expert_C, offsets_E, top_k)

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
                hidden = F.layer_norm(hidden, (self.hidden_dim,), ln_w.to(dtype), ln_b.to(dtype), self.subln_eps)
            outputs.append(torch.addmm(fc2_b, hidden, fc2_w))
        return torch.cat(outputs)
