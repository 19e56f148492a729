"""MoE layer cost relative to a dense FFN with the same active parameters per token, and to its experts' floor.

Every case times its callables in one process, interleaved round by round (the order alternating), and reports the
median of each and their ratios. Baseline: ``Linear(D, k*H) -> GELU -> Linear(k*H, D)``, the dense FFN whose FLOPs
equal the MoE's active FLOPs (k = top-k plus shared experts, or expert choice's c; H the expert width, so fine-grained
experts compare with the dense FFN of the coarse layer they split). An MoELayer case also times the layer with
forced-balanced routing and its experts' grouped-GEMM floor (:mod:`moe_balanced`), so that imbalance and routing
overhead show apart; a Soft MoE case (balanced by construction) its plain-GEMM floor, the dispatch and combine matmuls
around the experts' batched GEMMs on their slots (``moe_balanced.SoftMoEFloor``). fwd+bwd in fp32 on CPU unless
noted; X-MoE routing (d_e = 16), dropless unless noted.
``load_cv`` (std / mean of the expert loads) and ``load_max_over_mean`` are the layer's at initialisation.

The ``train_`` cases time the layer as a training step sees it: a batch of 4 sequences of 1,024 tokens with their
padding (a padding mask, 0 to 25 % of each sequence; the dense FFN computes every position, as the backbone's does),
the balance loss, the input requiring grad, and the parameters' gradients set to None after each step as the
optimiser leaves them (``_accumulate``: kept, so that each backward adds into them, as under gradient accumulation).

Output: one JSON line per case ``{"case", "moe_s", "baseline_s", "balanced_s", "floor_s", "ratio", "floor_ratio",
"balanced_floor_ratio", "target", "ok", "floor_target", "floor_ok", ...}`` (:func:`measure`) and a final
``{"summary": ..., "floor_summary": ...}`` line. ``--cuda`` adds the GPU cases (bf16, 16K tokens) and a sync-free
forward+backward check of the layer on both expert paths (``cuda_no_host_sync`` and ``cuda_no_host_sync_triton``);
the ``_triton`` cases run the layer with ``expert_kernels="triton"`` (row moves fused into the expert GEMMs); the
``_graphed`` ones replay every side as CUDA graphs (``torch.cuda.make_graphed_callables``), which the layer allows
because it never syncs with the host and keeps its shapes static: that takes the per-operator launch cost out.

``--split`` adds to each case's line a field ``"split"``: the MoE side's seconds per step under each of the layer's
``mmoe.moe.*`` labels (route, plan, permute, experts, combine; the fused path has no permute) and in its backward,
from torch.profiler (:func:`time_split`).

``--cpu-time`` times each side by this thread's CPU seconds (:func:`time.thread_time`) with one torch thread: on a
machine shared with other jobs the wall clock stretches the side with more operators more (each one's thread is
descheduled in turn), the CPU seconds do not.

Run: ``.venv/bin/python benchmarks/moe_layer.py [--rounds 9] [--cuda] [--split]``, or
``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/moe_layer.py --cpu-time``
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch import nn

from mmoe.moe import MoEConfig, MoEFeedForward, MoELayer, SoftMoELayer, build_moe_layer
from mmoe.moe.cost import routed_experts, soft_slots

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_balanced import ExpertFloor, SoftMoEFloor, forced_balanced  # noqa: E402
from timing import interleaved_medians, labelled_seconds  # noqa: E402

#: The layer's ``record_function`` labels (``mmoe.moe.<label>``) in forward order, and the autograd engine's range
#: around each backward node.
SPLIT_LABELS = ("route", "plan", "permute", "experts", "combine", "shared_experts")


class DenseFFN(nn.Module):
    def __init__(self, dim: int, hidden: int, projections: bool = False) -> None:
        super().__init__()
        self.pre = nn.Linear(dim, dim) if projections else nn.Identity()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.post = nn.Linear(dim, dim) if projections else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.fc2(nn.functional.gelu(self.fc1(self.pre(x)))))


@dataclass
class Case:
    """The timed steps and the case's description; ``eager_moe`` is ``moe`` run eagerly (the same step unless the
    case is graphed). ``balanced``: the layer with forced-balanced routing (None: the same as ``moe``, expert choice;
    or not defined, Stratified); ``floor``: its experts' grouped-GEMM floor (None for Stratified),
    :mod:`moe_balanced`. ``floor_target`` bounds ``balanced / floor``."""

    name: str
    target: float | None
    moe: Callable[[], None]
    baseline: Callable[[], None]
    info: dict
    eager_moe: Callable[[], None]
    balanced: Callable[[], None] | None = None
    floor: Callable[[], None] | None = None
    floor_target: float | None = None


class TensorOutputs(nn.Module):
    """``(y, balance_loss)`` of an MoE layer: tensors only, as CUDA-graphed callables must return. ``padding_mask``:
    the (B, L) padding the layer is given on every call (None: none)."""

    def __init__(self, layer: MoEFeedForward, padding_mask: torch.Tensor | None = None) -> None:
        super().__init__()
        self.layer, self.padding_mask = layer, padding_mask

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, routing = self.layer(x, self.padding_mask)
        return y, routing.balance_loss


def step(
    module: nn.Module, x: torch.Tensor, grad: torch.Tensor | None, is_moe: bool, accumulate: bool = False
) -> Callable[[], None]:
    """One forward (+ backward of ``(y * grad).sum()`` plus the balance loss); an MoE side is a :class:`TensorOutputs`,
    plain or CUDA-graphed. The parameters' gradients are set to None after each step, as the optimiser leaves them,
    or with ``accumulate`` kept, so that each backward adds into them (gradient accumulation)."""

    def run() -> None:
        if grad is None:
            with torch.no_grad():
                module(x)
            return
        out = module(x)
        y, extra = out if is_moe else (out, 0.0)
        ((y * grad).sum() + extra).backward()
        if not accumulate:
            module.zero_grad(set_to_none=True)
        x.grad = None

    return run


def training_padding(batch: int, length: int, padded: float, device: str) -> torch.Tensor | None:
    """A (B, L) padding mask as a training batch has one: sequence b ends ``padded * b / (B - 1)`` of L early (the
    first whole, the last ``padded`` short); None without padding."""
    if not padded:
        return None
    padding = torch.zeros(batch, length, dtype=torch.bool, device=device)
    for row in range(batch):
        padding[row, length - round(length * padded * row / max(batch - 1, 1)) :] = True
    return padding


def make_case(
    name: str,
    target: float | None,
    dim: int,
    hidden: int,
    experts: int,
    tokens: int,
    top_k: int = 1,
    heads: int = 1,
    capacity_factor: float | None = None,
    backward: bool = True,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    versus_experts: int | None = None,
    strata: list[int] | None = None,
    graphed: bool = False,
    expert_kernels: str = "torch",
    floor_target: float | None = None,
    batch: int = 1,
    padded: float = 0.0,
    accumulate: bool = False,
    **routing,
) -> Case:
    """``tokens`` tokens as ``batch`` sequences, their padding :func:`training_padding`, the gradients accumulated
    across steps with ``accumulate`` (:func:`step`); ``routing``: further :class:`MoEConfig` fields
    (``shared_experts``, ``bias_update_rate``, ``routing``)."""
    torch.manual_seed(0)
    config = MoEConfig(dim, hidden, num_experts=experts, top_k=top_k, heads=heads, capacity_factor=capacity_factor,
                       strata=strata, expert_kernels=expert_kernels, **routing)  # fmt: skip
    active_hidden = round((routed_experts(config) + config.shared_experts) * config.expert_dim)
    if config.routing == "soft":  # n*p slots per sequence of tokens / batch tokens
        active_hidden = round(soft_slots(config) * batch / tokens * config.expert_dim)
    moe = build_moe_layer(config).to(device, dtype)
    shape = (batch, tokens // batch, dim)
    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=backward)
    grad = torch.randn(shape, device=device, dtype=dtype) if backward else None
    padding = training_padding(batch, tokens // batch, padded, device)
    if config.target_active_experts is not None:
        routing["calibrated_top_p"] = calibrate_top_p(moe, x, padding, config.target_active_experts)
    if strata is not None:
        versus_experts = experts  # a plain top-2 MoE over the same experts
    if versus_experts is not None:
        other = MoELayer(MoEConfig(dim, hidden, num_experts=versus_experts, top_k=top_k)).to(device, dtype)
        baseline, baseline_is_moe = other, True
    else:
        baseline, baseline_is_moe = DenseFFN(dim, active_hidden, projections=heads > 1).to(device, dtype), False
    info = dict(
        dim=dim,
        hidden=hidden,
        experts=experts,
        tokens=tokens,
        top_k=top_k,
        heads=heads,
        capacity_factor=capacity_factor,
        backward=backward,
        device=device,
        dtype=str(dtype).split(".")[-1],
        expert_kernels=expert_kernels,
        batch=batch,
        padded=padded,
        accumulate=accumulate,
        **routing,
    )
    if versus_experts is not None:
        info["baseline_experts"] = versus_experts
    else:
        info["baseline_hidden"] = active_hidden
    with torch.no_grad():
        routing_record = moe(x, padding)[1]
    counts = routing_record.expert_counts.double()
    info["load_cv"] = round((counts.std(correction=0) / counts.mean()).item(), 3)  # at initialisation, random tokens
    info["load_max_over_mean"] = round((counts.max() / counts.mean()).item(), 3)  # the padded CPU path's row factor
    if routing_record.unrouted_fraction is not None:
        info["unrouted_fraction"] = round(routing_record.unrouted_fraction.item(), 3)
    if strata is not None:
        info["strata"] = strata
        info["requested_capacity"] = round(routing_record.requested_capacity.item(), 3)
    eager_side = moe_side = TensorOutputs(moe, padding)
    if baseline_is_moe:
        baseline = TensorOutputs(baseline, padding)
    if graphed:
        info["cuda_graph"] = True
        moe_side = torch.cuda.make_graphed_callables(TensorOutputs(moe, padding), (x,))  # eager_side stays eager
        baseline = torch.cuda.make_graphed_callables(baseline, (x,))
    moe_step = step(moe_side, x, grad, True, accumulate)
    baseline_step = step(baseline, x, grad, baseline_is_moe, accumulate)
    eager_step = step(eager_side, x, grad, True, accumulate)
    case = Case(name, target, moe_step, baseline_step, info, eager_step, floor_target=floor_target)
    if isinstance(moe, MoELayer):
        case.balanced, case.floor = balanced_and_floor_steps(moe, x, grad, padding, graphed, accumulate)
    elif isinstance(moe, SoftMoELayer):  # balanced by construction: every expert takes its slots
        floor = SoftMoEFloor(moe, batch, tokens // batch).to(device, dtype)
        case.floor = step(floor, x, grad, False, accumulate)
    return case


def calibrate_top_p(moe: MoELayer, x: torch.Tensor, padding: torch.Tensor | None, target: float) -> float:
    """Top-p routing at its target, as its controller holds it in training: the p (bisection) at which the layer
    routes ``x`` to ``target`` experts per non-padding (sub-)token on average, set as the router's p and returned."""
    low, high = 0.0, 1.0
    moe.eval()  # the controller moves p in training only
    with torch.no_grad():
        for _ in range(30):
            moe.router.top_p.p.fill_((low + high) / 2)
            used = moe(x, padding)[1].expert_index >= 0
            mean = used.sum() / used[..., 0].sum()
            low, high = (low, (low + high) / 2) if mean > target else ((low + high) / 2, high)
    moe.train()
    return round(float(moe.router.top_p.p), 4)


def balanced_and_floor_steps(
    moe: MoELayer,
    x: torch.Tensor,
    grad: torch.Tensor | None,
    padding: torch.Tensor | None,
    graphed: bool,
    accumulate: bool = False,
):
    """Steps of the forced-balanced layer (None for expert choice: balanced already) and of the experts'
    grouped-GEMM floor on the same rows, graphed like the case."""
    floor = ExpertFloor(moe, x.shape[0] * x.shape[1])
    rows_x = torch.randn(floor.rows, floor.width, device=x.device, dtype=x.dtype, requires_grad=x.requires_grad)
    rows_grad = None if grad is None else torch.randn_like(rows_x)
    balanced_layer = forced_balanced(moe)
    balanced = None if balanced_layer is moe else TensorOutputs(balanced_layer, padding)
    if graphed:
        floor = torch.cuda.make_graphed_callables(floor, (rows_x,))
        balanced = balanced and torch.cuda.make_graphed_callables(balanced, (x,))
    balanced_step = None if balanced is None else step(balanced, x, grad, True, accumulate)
    return balanced_step, step(floor, rows_x, rows_grad, False, accumulate)


def measure(case: Case, rounds: int, clock: Callable[[], float] = time.perf_counter) -> dict:
    """Every step's median seconds, interleaved in one run, and the ratios: ``ratio`` (routed / baseline, bounded by
    ``target``), ``balanced_ratio`` (forced-balanced / baseline), ``floor_ratio`` (routed / floor: imbalance and
    routing overhead) and ``balanced_floor_ratio`` (forced-balanced / floor: the routing overhead alone, bounded by
    ``floor_target``). ``ok`` / ``floor_ok`` are None without a target."""
    steps = {"moe": case.moe, "baseline": case.baseline, "balanced": case.balanced, "floor": case.floor}
    steps = {name: fn for name, fn in steps.items() if fn is not None}
    medians = interleaved_medians(list(steps.values()), rounds, case.info["device"], clock=clock)
    seconds = dict(zip(steps, medians, strict=True))
    seconds.setdefault("balanced", seconds["moe"] if case.floor is not None else None)  # expert choice: balanced
    result = {"case": case.name, **{f"{name}_s": round(value, 5) for name, value in seconds.items() if value}}
    ratios = {"ratio": ("moe", "baseline"), "balanced_ratio": ("balanced", "baseline"),
              "floor_ratio": ("moe", "floor"), "balanced_floor_ratio": ("balanced", "floor")}  # fmt: skip
    for name, (over, under) in ratios.items():
        if seconds.get(over) and seconds.get(under):
            result[name] = round(seconds[over] / seconds[under], 3)
    result["target"] = case.target
    result["ok"] = None if case.target is None else result["ratio"] <= case.target
    if case.floor_target is not None:
        result["floor_target"] = case.floor_target
        result["floor_ok"] = result["balanced_floor_ratio"] <= case.floor_target
    return result | case.info


def cpu_cases() -> list[partial[Case]]:
    """Case builders (the name is each one's first argument), built only when selected."""
    d, h = 384, 1536
    floor = dict(floor_target=1.25)
    expert_choice = dict(routing="expert_choice", **floor)
    training = dict(batch=4, padded=0.25)
    top_p = dict(top_p=0.4, target_active_experts=2.0, renormalize=False)
    moe_plus_plus = dict(null_experts=2, copy_experts=2, constant_experts=4, **floor)
    return [
        partial(make_case, "top1_4096", 1.25, d, h, 8, 4096),
        partial(make_case, "top2_4096", 1.15, d, h, 8, 4096, top_k=2),
        partial(make_case, "top1_4096_forward", 1.15, d, h, 8, 4096, backward=False),
        partial(make_case, "top1_1024", 1.8, d, h, 8, 1024),
        # As a training step sees the layer: 4 sequences of 1,024 tokens, their padding (0 to 25 % of each), the
        # balance loss, the gradients None after each step as the optimiser leaves them, or accumulated.
        partial(make_case, "train_top1_4x1024", 1.15, d, h, 8, 4096, **training),
        partial(make_case, "train_top1_4x1024_accumulate", 1.15, d, h, 8, 4096, accumulate=True, **training),
        partial(make_case, "train_top2_4x1024", 1.15, d, h, 8, 4096, top_k=2, **training),
        partial(make_case, "train_top2_4x1024_accumulate", 1.15, d, h, 8, 4096, top_k=2, accumulate=True, **training),
        partial(make_case, "e32_vs_e8_4096", 1.6, d, h, 32, 4096, versus_experts=8),
        partial(make_case, "mhmoe_h4_vs_dense_plus_proj", 2.0, d, h, 8, 4096, heads=4),
        partial(make_case, "capacity1_4096", 1.25, d, h, 8, 4096, capacity_factor=1.0),
        partial(make_case, "stratified_4_4_vs_top2_4096", None, d, h, 8, 4096, top_k=2, strata=[4, 4]),
        # The routers of configs/pretrain/tiny/{fine_grained,shared_experts,loss_free,expert_choice}.yaml, each against
        # the dense FFN of its active FLOPs (H for the first five, 2H for c = 2) without a target; the modern shapes'
        # forced-balanced layer within floor_target of their experts' grouped-GEMM floor.
        partial(make_case, "fine_grained_e32_top4_4096", None, d, h // 4, 32, 4096, top_k=4, **floor),
        partial(make_case, "fine_grained_e64_top8_4096", None, d, h // 8, 64, 4096, top_k=8, **floor),
        partial(
            make_case,
            "shared1_fine_grained_e32_top3_4096",
            None,
            d,
            h // 4,
            32,
            4096,
            top_k=3,
            shared_experts=1,
            **floor,
        ),  # fmt: skip
        partial(make_case, "loss_free_bias_top1_4096", None, d, h, 8, 4096, bias_update_rate=1e-3),
        partial(make_case, "expert_choice_c1_4096", None, d, h, 8, 4096, capacity_factor=1.0, **expert_choice),
        partial(make_case, "expert_choice_c2_4096", None, d, h, 8, 4096, capacity_factor=2.0, **expert_choice),
        # Soft MoE (Puigcerver et al., 2024): 16 sequences of 256 tokens (ViT-like), 8 experts; n*p = 256 slots per
        # sequence (the experts' FLOPs of a dense FFN of width H) or 128 (the paper's B/16: 128 slots per ~200
        # tokens). Against the dense FFN of those FLOPs and the plain-GEMM floor (moe_balanced.SoftMoEFloor).
        partial(
            make_case, "soft_e8_p32_16x256", None, d, h, 8, 4096, batch=16, routing="soft", slots_per_expert=32, **floor
        ),
        partial(
            make_case, "soft_e8_p16_16x256", None, d, h, 8, 4096, batch=16, routing="soft", slots_per_expert=16, **floor
        ),
        # configs/pretrain/tiny/top_p.yaml's router (Huang et al., 2024) with p set where it holds 2 experts per token,
        # against the dense FFN of 2H and the floor on the 2 * 4096 rows it computes.
        partial(make_case, "top_p_target2_4096", None, d, h, 8, 4096, **top_p, **floor),
        partial(make_case, "train_top_p_target2_4x1024", None, d, h, 8, 4096, **top_p, **floor, **training),
        # configs/pretrain/tiny/{null_experts,moe_plus_plus}.yaml: top-2 over 8 experts and 8 zero-computation
        # experts, one real expert per token at balance (the dense FFN of H, the floor on those rows).
        partial(make_case, "null_experts_e8_n8_top2_4096", None, d, h, 8, 4096, top_k=2, null_experts=8, **floor),
        partial(make_case, "moe_plus_plus_e8_z8_top2_4096", None, d, h, 8, 4096, top_k=2, **moe_plus_plus),
        # ReMoE's ReLU gates at their target: at initialisation about half of the 8 gates are open, so k = 4 (the
        # dense FFN 4H wide, the floor on 4 rows a token); the experts run on the open gates' rows only.
        partial(
            make_case,
            "relu_e8_target4_4096",
            None,
            d,
            h,
            8,
            4096,
            top_k=4,
            router="linear",
            gate="relu",
            renormalize=False,
            **floor,
        ),
    ]


def cuda_cases() -> list[partial[Case]]:
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    fused = dict(expert_kernels="triton", **bf16)
    fused_graphed = dict(graphed=True, **fused)
    d, h = 768, 3072
    return [
        partial(make_case, "cuda_bf16_top1_16k", 1.3, d, h, 8, 16384, **bf16),
        partial(make_case, "cuda_bf16_top2_16k", 1.3, d, h, 8, 16384, top_k=2, **bf16),
        partial(make_case, "cuda_bf16_top1_16k_graphed", 1.3, d, h, 8, 16384, graphed=True, **bf16),
        partial(make_case, "cuda_bf16_top2_16k_graphed", 1.3, d, h, 8, 16384, top_k=2, graphed=True, **bf16),
        partial(make_case, "cuda_bf16_top1_64k_graphed", 1.3, d, h, 8, 65536, graphed=True, **bf16),
        partial(make_case, "cuda_bf16_mhmoe_h4_16k_graphed", 1.6, d, h, 8, 16384, heads=4, graphed=True, **bf16),
        # The fused gather/scatter kernels (MoEConfig.expert_kernels="triton"), eager and graphed: targets of the
        # GPU-speed work.
        partial(make_case, "cuda_bf16_top1_16k_triton", 1.3, d, h, 8, 16384, **fused),
        partial(make_case, "cuda_bf16_top1_16k_triton_graphed", 1.15, d, h, 8, 16384, **fused_graphed),
        partial(make_case, "cuda_bf16_top2_16k_triton", 1.5, d, h, 8, 16384, top_k=2, **fused),
        partial(make_case, "cuda_bf16_top2_16k_triton_graphed", 1.35, d, h, 8, 16384, top_k=2, **fused_graphed),
        partial(make_case, "cuda_bf16_top1_64k_triton", 1.35, d, h, 8, 65536, **fused),
        partial(make_case, "cuda_bf16_top1_64k_triton_graphed", 1.2, d, h, 8, 65536, **fused_graphed),
        partial(make_case, "cuda_bf16_e32_top1_16k_triton", 1.45, d, h, 32, 16384, **fused),
        partial(make_case, "cuda_bf16_e32_top1_16k_triton_graphed", 1.3, d, h, 32, 16384, **fused_graphed),
        partial(make_case, "cuda_bf16_mhmoe_h4_16k_triton", 1.65, d, h, 8, 16384, heads=4, **fused),
        partial(make_case, "cuda_bf16_mhmoe_h4_16k_triton_graphed", 1.5, d, h, 8, 16384, heads=4, **fused_graphed),
    ]


def check_no_sync(expert_kernels: str) -> dict:
    """Forward+backward under ``set_sync_debug_mode("error")`` with ``MoEConfig.expert_kernels``: any host-device
    sync raises. The fused kernels' check fails where they do not run (it would check the reference path)."""
    name = "cuda_no_host_sync" if expert_kernels == "torch" else f"cuda_no_host_sync_{expert_kernels}"
    config = MoEConfig(768, 3072, num_experts=8, top_k=2, expert_kernels=expert_kernels)
    layer = MoELayer(config).to("cuda", torch.bfloat16)
    x = torch.randn(4, 1024, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    if expert_kernels == "triton" and not layer.use_fused_kernels(x):
        return {"case": name, "ok": False, "error": "the fused kernels do not run here"}
    padding = torch.zeros(4, 1024, dtype=torch.bool, device="cuda")
    padding[:, 900:] = True
    layer(x, padding)  # warm up lazy initialisation outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y, routing = layer(x, padding)
        (y.float().square().mean() + routing.balance_loss).backward()
        error = None
    except RuntimeError as exc:
        error = str(exc).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return {"case": name, "ok": error is None, "error": error}


def profile(case: Case, folder: Path, steps: int = 5) -> None:
    """The MoE side's operators over ``steps`` steps, by self time on the case's device, as ``<case>.txt``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    device = case.info["device"]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        for _ in range(steps):
            case.moe()
        if device == "cuda":
            torch.cuda.synchronize()
    sort_by = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{case.name}.txt").write_text(prof.key_averages().table(sort_by=sort_by, row_limit=40))


def time_split(case: Case, steps: int = 3) -> dict[str, float]:
    """Seconds per step of the MoE side under each ``mmoe.moe.*`` label of its forward, and in its backward.

    A label's time is the CPU time of its range on CPU; on CUDA it is the sum of the kernels launched inside it (the
    host-side event's ``device_time_total``; the ``gpu_user_annotation`` event spans the idle gaps between them too).
    ``"backward"`` is timed the same way over the autograd engine's outermost ``evaluate_function`` ranges, so the
    backward's own operators count and no node twice. Labels a path lacks do not appear (the fused path has no
    permute); the MH-MoE projections and the routing record are under no label. A graphed case is split running its
    layer eagerly: a graph replay records no labels.
    """
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = case.info["device"] == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    case.eager_moe()  # lazy initialisation outside the profile
    if cuda:
        torch.cuda.synchronize()
    with torch_profile(activities=activities) as prof:
        for _ in range(steps):
            case.eager_moe()
        if cuda:
            torch.cuda.synchronize()
    seconds = labelled_seconds(prof, steps, device_time=cuda)
    order = [label for label in (*SPLIT_LABELS, "backward") if label in seconds]
    return {label: float(f"{seconds[label]:.5g}") for label in order}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds per case (median reported)")
    parser.add_argument("--cuda", action="store_true", help="also run the CUDA bf16 cases")
    parser.add_argument("--only", nargs="*", help="case names to run")
    parser.add_argument("--profile", type=Path, help="write a torch.profiler table of each MoE case to this folder")
    parser.add_argument("--split", action="store_true", help="add each MoE side's time per layer phase (time_split)")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time by this thread's CPU seconds instead of wall seconds (needs one torch thread: OMP_NUM_THREADS=1); "
        "other jobs on the machine then stretch no side",
    )
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.cpu_time and torch.get_num_threads() != 1:
        parser.error(
            f"--cpu-time counts one thread's CPU seconds: run with OMP_NUM_THREADS=1 "
            f"(torch has {torch.get_num_threads()} threads)"
        )
    clock = time.thread_time if args.cpu_time else time.perf_counter
    builders = cpu_cases() + (cuda_cases() if args.cuda else [])
    if args.only:
        builders = [build for build in builders if build.args[0] in args.only]
    results = []
    for build in builders:
        case = build()
        result = measure(case, args.rounds, clock) | {"clock": "thread_cpu" if args.cpu_time else "wall"}
        if args.split:
            result["split"] = time_split(case)
        results.append(result)
        print(json.dumps(result), flush=True)
        if args.profile:
            profile(case, args.profile)
    if args.cuda:
        for expert_kernels in ("torch", "triton"):
            result = check_no_sync(expert_kernels)
            results.append(result)
            print(json.dumps(result), flush=True)
    summary = {
        "summary": {r["case"]: r.get("ratio", r["ok"]) for r in results},
        "floor_summary": {r["case"]: r["balanced_floor_ratio"] for r in results if "balanced_floor_ratio" in r},
        "all_ok": all(r[ok] for r in results for ok in ("ok", "floor_ok") if r.get(ok) is not None),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
