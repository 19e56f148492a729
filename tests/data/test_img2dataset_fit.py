"""End to end: an img2dataset folder, indexed as it is, pre-trains with ``mmoe fit`` from its pairs alone (slow)."""

from __future__ import annotations

import re
import shutil

import pytest
import yaml

from mmoe.data.img2dataset import index_folder
from tests.cli_fixtures import run_mmoe, tiny_pretraining
from tests.data.img2dataset_layout import PLANTED_CAUSES, write_planted

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]


def pairs_only_config(pairs, codebook, out, steps: int, batch_size: int, workers: int = 0):
    """The tiny pre-training config over ``pairs`` alone (joint steps), 32-px images, one pass in order, read by
    ``workers`` DataLoader workers."""
    config = tiny_pretraining("dense")
    config["trainer"].update(
        max_steps=steps, default_root_dir=str(out), enable_progress_bar=False, accelerator="cpu",
        limit_val_batches=0, log_every_n_steps=1,
    )  # fmt: skip
    model = config["model"]["init_args"]
    model["backbone"].update(image_size=32, dim=32, num_heads=2, ffn_dim=64, depth=2)
    model["visual_codebook"] = str(codebook)
    data = config["data"]["init_args"]
    for key in ("image_shards", "text_shards", "val_pair_shards"):
        data.pop(key)
    data.update(
        data_root=None, pair_shards=str(pairs), image_size=32, batch_size=batch_size, num_workers=workers,
        batches_per_epoch=steps, shuffle_buffer=0,
    )  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    path = out / "pairs_only.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_an_indexed_img2dataset_folder_pretrains_from_its_pairs_and_reports_what_it_left_out(
    synthetic_corpus, tmp_path, capsys
):
    folder = write_planted(tmp_path / "cc")
    index_folder(folder, min_side=32)
    # 9 kept pairs in batches of 3: three steps read the shards once, every planted sample before the last batch.
    config = pairs_only_config(folder, synthetic_corpus / "codebook.pt", tmp_path / "run", steps=3, batch_size=3)
    code, _, err = run_mmoe(["fit", "--config", str(config)], capsys)
    assert code == 0, err[-2000:]
    start = err.splitlines()[:2]  # and the line on the planted failed downloads
    assert any("the image-only and text-only objectives draw from pair_shards" in line for line in start)
    report = [line for line in err.splitlines() if line.startswith("mmoe fit: samples skipped")]
    assert len(report) == 1
    read_time = {cause: n for cause, n in PLANTED_CAUSES.items() if cause != "status"}
    expected = ", ".join(f"{n} {cause}" for cause, n in sorted(read_time.items()))
    assert re.search(rf"train/pair: 3 skipped \(0 corrupt, 0 lost, 3 left out: {expected}; from ", report[0])
    assert "train/image" not in report[0] and "train/text" not in report[0]


def test_fit_refuses_an_indexed_folder_with_a_shard_added_since_in_one_line(synthetic_corpus, tmp_path, capsys):
    folder = write_planted(tmp_path / "cc")
    index_folder(folder, min_side=32)
    shutil.copy(folder / "00001.tar", folder / "00002.tar")  # an incremental img2dataset run, not indexed again
    config = pairs_only_config(folder, synthetic_corpus / "codebook.pt", tmp_path / "run", steps=1, batch_size=3)
    code, _, err = run_mmoe(["fit", "--config", str(config)], capsys)
    errors = [line for line in err.splitlines() if "00002.tar" in line]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err[-2000:]
    assert f"{folder}: shard 00002.tar was added after manifest.json was written" in errors[0]


def test_a_fit_says_once_at_its_start_how_many_samples_img2dataset_failed_to_download(
    synthetic_corpus, tmp_path, capsys
):
    folder = write_planted(tmp_path / "cc")
    index_folder(folder, min_side=32)
    config = pairs_only_config(folder, synthetic_corpus / "codebook.pt", tmp_path / "run", steps=2, batch_size=3,
                               workers=2)  # fmt: skip
    code, _, err = run_mmoe(["fit", "--config", str(config)], capsys)
    assert code == 0, err[-2000:]
    said = [line for line in err.splitlines() if "img2dataset tried" in line]
    assert len(said) == 1, err[-3000:]
    # 14 attempted rows, 2 of them failed downloads (PLANTED_CAUSES' status count).
    assert (
        f"{folder}: 2 of the 14 samples img2dataset tried (14.3%) are not in its tars (2 failed_to_download;" in said[0]
    )
    first_batch = next(i for i, line in enumerate(err.splitlines()) if "samples skipped" in line)
    assert err.splitlines().index(said[0]) < first_batch
