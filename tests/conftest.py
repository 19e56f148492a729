"""Shared fixtures: a small synthetic corpus converted to shards, with a visual codebook (built once per session)."""

from __future__ import annotations

import pytest


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
