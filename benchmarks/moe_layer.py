"""MoE layer cost relative to a dense FFN with the same active parameters per token.

Every case times two callables in one process, interleaved round by round (the order alternating), and reports the
median over the rounds of each and their ratio. Baseline: ``Linear(D, k*H) -> GELU -> Linear(k*H, D)``, the dense
FFN whose FLOPs equal the MoE's active FLOPs. fwd+bwd in fp32 on CPU unless the case says otherwise; the routing
is X-MoE (d_e = 16), dropless unless noted.

Output: one JSON line per case ``{"case", "moe_s", "baseline_s", "ratio", "target", "ok", ...}`` and a final
``{"summary": ...}`` line. ``--cuda`` adds the GPU cases (bf16, 16K tokens, and a sync-free forward+backward check);
the ``_triton`` ones run the layer with ``expert_kernels="triton"`` (row moves fused into the expert GEMMs); the
``_graphed`` ones replay both sides as CUDA graphs (``torch.cuda.make_graphed_callables``), which the layer allows
because it never syncs with the host and keeps its shapes static: that takes the per-operator launch cost out, which
at this size is larger than the MoE layer's GPU time.

Run: ``.venv/bin/python benchmarks/moe_layer.py [--rounds 9] [--cuda]``
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch import nn

from mmoe.moe import MoEConfig, MoEFeedForward, MoELayer, build_moe_layer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import interleaved_medians  # noqa: E402


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
    name: str
    target: float | None
    moe: Callable[[], None]
    baseline: Callable[[], None]
    info: dict


class TensorOutputs(nn.Module):
    """``(y, balance_loss)`` of an MoE layer: tensors only, as CUDA-graphed callables must return."""

    def __init__(self, layer: MoEFeedForward) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, routing = self.layer(x)
        return y, routing.balance_loss


def step(module: nn.Module, x: torch.Tensor, grad: torch.Tensor | None, is_moe: bool) -> Callable[[], None]:
    """One forward (+ backward of ``(y * grad).sum()`` plus the balance loss); an MoE side is a :class:`TensorOutputs`,
    plain or CUDA-graphed."""

    def run() -> None:
        if grad is None:
            with torch.no_grad():
                module(x)
            return
        out = module(x)
        y, extra = out if is_moe else (out, 0.0)
        ((y * grad).sum() + extra).backward()
        module.zero_grad(set_to_none=True)
        x.grad = None

    return run


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
) -> Case:
    torch.manual_seed(0)
    config = MoEConfig(dim, hidden, experts, top_k=top_k, heads=heads, capacity_factor=capacity_factor, strata=strata,
                       expert_kernels=expert_kernels)  # fmt: skip
    moe = build_moe_layer(config).to(device, dtype)
    x = torch.randn(1, tokens, dim, device=device, dtype=dtype, requires_grad=backward)
    grad = torch.randn(1, tokens, dim, device=device, dtype=dtype) if backward else None
    if strata is not None:
        versus_experts = experts  # a plain top-2 MoE over the same experts
    if versus_experts is not None:
        other = MoELayer(MoEConfig(dim, hidden, versus_experts, top_k=top_k)).to(device, dtype)
        baseline, baseline_is_moe = other, True
    else:
        baseline, baseline_is_moe = DenseFFN(dim, top_k * hidden, projections=heads > 1).to(device, dtype), False
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
    )
    if versus_experts is not None:
        info["baseline_experts"] = versus_experts
    if strata is not None:
        with torch.no_grad():
            info["strata"] = strata
            info["requested_capacity"] = round(moe(x)[1].requested_capacity.item(), 3)
    moe_side = TensorOutputs(moe)
    if baseline_is_moe:
        baseline = TensorOutputs(baseline)
    if graphed:
        info["cuda_graph"] = True
        moe_side = torch.cuda.make_graphed_callables(moe_side, (x,))
        baseline = torch.cuda.make_graphed_callables(baseline, (x,))
    return Case(name, target, step(moe_side, x, grad, True), step(baseline, x, grad, baseline_is_moe), info)


def measure(case: Case, rounds: int) -> dict:
    """Both sides' median seconds and their ratio; ``ok`` is None for cases reported without a target."""
    moe_s, base_s = interleaved_medians([case.moe, case.baseline], rounds, case.info["device"])
    ratio = moe_s / base_s
    return {
        "case": case.name,
        "moe_s": round(moe_s, 5),
        "baseline_s": round(base_s, 5),
        "ratio": round(ratio, 3),
        "target": case.target,
        "ok": None if case.target is None else ratio <= case.target,
        **case.info,
    }


def cpu_cases() -> list[partial[Case]]:
    """Case builders (the name is each one's first argument), built only when selected."""
    d, h = 384, 1536
    return [
        partial(make_case, "top1_4096", 1.25, d, h, 8, 4096),
        partial(make_case, "top2_4096", 1.15, d, h, 8, 4096, top_k=2),
        partial(make_case, "top1_4096_forward", 1.15, d, h, 8, 4096, backward=False),
        partial(make_case, "top1_1024", 1.8, d, h, 8, 1024),
        partial(make_case, "e32_vs_e8_4096", 1.6, d, h, 32, 4096, versus_experts=8),
        partial(make_case, "mhmoe_h4_vs_dense_plus_proj", 2.0, d, h, 8, 4096, heads=4),
        partial(make_case, "capacity1_4096", 1.25, d, h, 8, 4096, capacity_factor=1.0),
        partial(make_case, "stratified_4_4_vs_top2_4096", None, d, h, 8, 4096, top_k=2, strata=[4, 4]),
    ]


def cuda_cases() -> list[partial[Case]]:
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    fused = dict(expert_kernels="triton", **bf16)
    return [
        partial(make_case, "cuda_bf16_top1_16k", 1.3, 768, 3072, 8, 16384, **bf16),
        partial(make_case, "cuda_bf16_top2_16k", 1.3, 768, 3072, 8, 16384, top_k=2, **bf16),
        partial(make_case, "cuda_bf16_top1_16k_graphed", 1.3, 768, 3072, 8, 16384, graphed=True, **bf16),
        partial(make_case, "cuda_bf16_top2_16k_graphed", 1.3, 768, 3072, 8, 16384, top_k=2, graphed=True, **bf16),
        partial(make_case, "cuda_bf16_top1_64k_graphed", 1.3, 768, 3072, 8, 65536, graphed=True, **bf16),
        partial(make_case, "cuda_bf16_mhmoe_h4_16k_graphed", 1.6, 768, 3072, 8, 16384, heads=4, graphed=True, **bf16),
        # The fused gather/scatter kernels (MoEConfig.expert_kernels="triton"): targets of the GPU-speed work.
        partial(make_case, "cuda_bf16_top1_16k_triton", 1.3, 768, 3072, 8, 16384, **fused),
        partial(make_case, "cuda_bf16_top2_16k_triton", 1.4, 768, 3072, 8, 16384, top_k=2, **fused),
        partial(make_case, "cuda_bf16_top1_64k_triton", 1.3, 768, 3072, 8, 65536, **fused),
        partial(make_case, "cuda_bf16_e32_top1_16k_triton", 1.4, 768, 3072, 32, 16384, **fused),
        partial(make_case, "cuda_bf16_mhmoe_h4_16k_triton", 1.6, 768, 3072, 8, 16384, heads=4, **fused),
    ]


def check_no_sync() -> dict:
    """Forward+backward under ``set_sync_debug_mode("error")``: any host-device sync raises."""
    layer = MoELayer(MoEConfig(768, 3072, 8, top_k=2)).to("cuda", torch.bfloat16)
    x = torch.randn(4, 1024, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
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
    return {"case": "cuda_no_host_sync", "ok": error is None, "error": error}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds per case (median reported)")
    parser.add_argument("--cuda", action="store_true", help="also run the CUDA bf16 cases")
    parser.add_argument("--only", nargs="*", help="case names to run")
    parser.add_argument("--profile", type=Path, help="write a torch.profiler table of each MoE case to this folder")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    builders = cpu_cases() + (cuda_cases() if args.cuda else [])
    if args.only:
        builders = [build for build in builders if build.args[0] in args.only]
    results = []
    for build in builders:
        case = build()
        result = measure(case, args.rounds)
        results.append(result)
        print(json.dumps(result), flush=True)
        if args.profile:
            profile(case, args.profile)
    if args.cuda:
        result = check_no_sync()
        results.append(result)
        print(json.dumps(result), flush=True)
    summary = {
        "summary": {r["case"]: r.get("ratio", r["ok"]) for r in results},
        "all_ok": all(r["ok"] for r in results if r["ok"] is not None),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
