"""VQ-KD tokenizer files through ``mmoe fit`` and ``mmoe info`` as a user hands them over: a codebook too small to be
MIM targets stops the run in one line (exit 2) before anything is written; a file of a tokenizer with layer scale and
its training arguments (``args``) beside the weights is read and counted whole."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
import yaml

from mmoe.model.vqkd import load_vqkd
from tests.cli_fixtures import TINY_PRETRAINING, run_mmoe, tiny_pretraining
from tests.model.vqkd_reference import released_state, save_released

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SMALL = {"dim": 64, "depth": 1, "mlp": 128, "grid": 2, "codes": 64}


def tokenizer_options(path: Path) -> list[str]:
    return ["--model.init_args.visual_codebook=null", f"--model.init_args.vqkd_tokenizer={path}"]


@pytest.mark.parametrize("codes", [0, 1])
def test_fit_refuses_a_codebook_of_fewer_than_two_codes(synthetic_corpus, tmp_path, capsys, monkeypatch, codes):
    monkeypatch.chdir(tmp_path)
    path = save_released(
        tmp_path / "small.pth", released_state(**SMALL) | {"quantize.embedding.weight": torch.ones(codes, 32)}
    )
    corpus = f"--data.init_args.data_root={synthetic_corpus}"
    code, _, err = run_mmoe(["fit", "--config", str(TINY_PRETRAINING), corpus, *tokenizer_options(path)], capsys)
    assert code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (
        f"mmoe fit: error: model.vqkd_tokenizer {path}: quantize.embedding.weight has shape ({codes}, 32), expected "
        "at least 2 codebook rows (one per code) of the code dimension"
    )
    assert sorted(tmp_path.iterdir()) == [path]


def test_info_reads_a_layer_scale_file_with_its_training_arguments(tmp_path, capsys, monkeypatch):
    """The file of a tokenizer built with ``init_values`` > 0, saved with its ``args``: ``mmoe info`` reads it under
    ``weights_only`` and counts the gammas among the tokenizer's parameters."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "vqkd.pth"
    torch.save({"model": released_state(**SMALL, layer_scale=True), "args": argparse.Namespace(codebook_dim=32)}, path)
    config = tiny_pretraining("dense")
    config["model"]["init_args"].update(visual_codebook=None, vqkd_tokenizer=str(path))
    (tmp_path / "vqkd.yaml").write_text(yaml.safe_dump(config))
    code, out, err = run_mmoe(["info", "--config", str(tmp_path / "vqkd.yaml"), "--json"], capsys)
    assert code == 0, err
    tokenizer = load_vqkd(path, grid=json.loads(out)["visual_tokenizer"]["grid"]).tokenizer
    reported = json.loads(out)["visual_tokenizer"]
    assert reported["parameters"] == sum(value.numel() for value in tokenizer.state_dict().values())
    assert any(key.endswith("gamma_1") for key in tokenizer.state_dict())
