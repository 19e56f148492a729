"""The multi-process test harness (tests/gloo.py) passes a passing body and fails on a failing rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessRaisedException

from tests.gloo import spawn_gloo


def summed_ranks(rank: int, expected: float) -> None:
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    assert total.item() == expected, f"rank {rank}: sum {total.item()}"


def test_a_passing_body_passes(tmp_path):
    spawn_gloo(summed_ranks, 2, tmp_path, 1.0)


def test_an_assertion_on_one_rank_fails_the_caller(tmp_path):
    with pytest.raises(ProcessRaisedException, match="sum 1.0"):
        spawn_gloo(summed_ranks, 2, tmp_path, 5.0)
