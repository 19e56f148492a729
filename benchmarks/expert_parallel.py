"""Expert parallelism on 2 CPU processes (gloo): a MoE layer's fwd+bwd time with every expert on every rank (EP = 1)
against its experts split over the two ranks (EP = 2), each rank routing its own tokens, and the time split of each
(route, plan, permute, all-to-all, experts, combine, from the layer's ``record_function`` labels under torch.profiler).

EP = 2 moves rows twice per forward and twice per backward; per rank and direction that is about
``K * T * D * (W - 1) / W`` elements with T tokens per rank, K choices per token, D the width and W the group size (the
share of a rank's choices whose expert lives elsewhere, balanced routing): it grows linearly with the tokens and
with k, and does not depend on the number of experts E (E only changes how the rows split). The benchmark prints
the rows each rank actually sent.

Output: one JSON line per case and a ``{"summary": ...}`` line with ratio EP2 / EP1 (rank 0's medians).
Run: ``.venv/bin/python benchmarks/expert_parallel.py [--rounds 7] [--tokens 4096]``
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mmoe.moe import MoEConfig
from mmoe.moe.expert_parallel import expert_parallel_groups
from mmoe.moe.layer import MoELayer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import interleaved_medians, labelled_seconds  # noqa: E402

WORLD = 2
PHASES = ("route", "plan", "permute", "all_to_all", "experts", "combine")


def phase_split(layer: MoELayer, x: torch.Tensor, grad: torch.Tensor, steps: int = 3) -> dict[str, float]:
    """Mean seconds per fwd+bwd spent under each of the layer's labels (CPU time of the labelled regions; the
    backward of each phase is not labelled and shows in the total only)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        for _ in range(steps):
            run(layer, x, grad)
    seconds = labelled_seconds(profile, steps)
    return {phase: round(seconds.get(phase, 0.0), 5) for phase in PHASES}


def run(layer: MoELayer, x: torch.Tensor, grad: torch.Tensor) -> None:
    y, routing = layer(x)
    ((y * grad).sum() + routing.balance_loss).backward()


def worker(rank: int, init_file: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # the two ranks share the machine's cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    config = MoEConfig(args.dim, args.hidden, num_experts=args.experts, top_k=args.top_k)
    single, parallel = MoELayer(config), MoELayer(config)
    parallel.load_state_dict(single.state_dict())
    parallel.shard_experts(expert_parallel_groups(WORLD))
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(1, args.tokens, args.dim, generator=generator)
    grad = torch.randn(1, args.tokens, args.dim, generator=generator)
    ep1, ep2 = interleaved_medians([lambda: run(single, x, grad), lambda: run(parallel, x, grad)], args.rounds)
    splits = {"ep1": phase_split(single, x, grad), "ep2": phase_split(parallel, x, grad)}
    with torch.no_grad():
        _, routing = single(x)
    local = args.experts // WORLD
    counts = routing.expert_counts
    sent_rows = int(counts.sum() - counts[rank * local : (rank + 1) * local].sum())
    dist.barrier()
    if rank == 0:
        info = {"dim": args.dim, "hidden": args.hidden, "experts": args.experts, "top_k": args.top_k,
                "tokens_per_rank": args.tokens, "world": WORLD, "threads_per_rank": 1}  # fmt: skip
        for name, seconds in (("ep1", ep1), ("ep2", ep2)):
            print(json.dumps({"case": name, "seconds": round(seconds, 5), "split": splits[name], **info}))
        expected = args.top_k * args.tokens * (WORLD - 1) / WORLD
        volume = {"rows_sent_rank0": sent_rows, "rows_expected_balanced": expected, "row_bytes": args.dim * 4}
        print(json.dumps({"summary": {"ep2_over_ep1": round(ep2 / ep1, 3), "all_to_all_rows": volume}}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(worker, args=(str(Path(folder) / "init"), args), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
