"""Freed host memory kept for reuse (:mod:`mmoe.host_memory`): the ``mmoe`` command keeps it, and a user's own
allocator settings are left alone. What it does to a training step's page faults is measured by
``benchmarks/host_memory.py`` (its smoke test in ``tests/test_benchmarks_smoke.py`` asserts the faults fall), and a
pipeline lane's process is checked in ``tests/demo/test_demo.py``."""

from __future__ import annotations

from mmoe import cli
from mmoe.host_memory import keep_freed_memory


def test_the_command_keeps_freed_memory_before_it_runs_a_subcommand(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(cli, "keep_freed_memory", lambda: calls.append(len(calls)) or True)
    assert cli.main(["moe-info", "--moe.dim", "8", "--moe.ffn_dim", "16", "--moe.num_experts", "2"]) == 0
    assert calls == [0] and capsys.readouterr().out.startswith("{")


def test_a_users_own_allocator_settings_are_left_alone():
    """Thresholds set by environment variables or glibc tunables, and an explicit opt-out, win."""
    assert not keep_freed_memory({"MMOE_KEEP_FREED_MEMORY": "0"})
    assert not keep_freed_memory({"MALLOC_MMAP_THRESHOLD_": "1048576"})
    assert not keep_freed_memory({"MALLOC_TRIM_THRESHOLD_": "0"})
    assert not keep_freed_memory({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"})
