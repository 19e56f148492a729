"""Shared fixtures: a small synthetic corpus converted to shards, with a visual codebook (built once per session)."""

from __future__ import annotations

import os

import pytest

# On pytest-xdist's worker processes, the machine's cores are shared between the workers: each worker's torch (and
# every process a test starts, which inherits the environment) gets its share of threads instead of all of them.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    share = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = share


@pytest.fixture(scope="session")
def synthetic_corpus(tmp_path_factory):
    """Root of a ``tiny`` synthetic corpus with ``shards/<name>/`` and ``codebook.pt`` (16 codes, 16-px patches)."""
    from mmoe.data.cli import data_command
    from mmoe.tasks.visual_codebook import tokenizer_command

    root = tmp_path_factory.mktemp("synthetic")
    assert data_command(["synth", "--out", str(root), "--size", "tiny", "--shards"]) == 0
    shards = root / "shards"
    assert (
        tokenizer_command(
            [
                "fit",
                "--data",
                str(shards / "pretrain-images"),
                str(shards / "pretrain-pairs"),
                "--out",
                str(root / "codebook.pt"),
                "--size",
                "16",
                "--image-size",
                "32",
            ]
        )
        == 0
    )
    return root


#: Test files whose module fixtures train for minutes (the default demo, the fast claims study): first in the
#: collection, so a run in one process starts with them. On worker processes (``pytest -n 2 --dist loadfile``)
#: pytest-xdist hands files out by their number of tests instead, unless ``--no-loadscope-reorder`` is given.
RUN_FIRST = ("tests/demo/test_demo.py", "tests/study/test_study.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {path: index for index, path in enumerate(RUN_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(RUN_FIRST)))
