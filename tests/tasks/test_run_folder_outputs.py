"""Every output of a run lies in its run folder (``trainer.default_root_dir``) unless the user names another: a real
``mmoe fit`` of the shipped captioning config, with a validation, writes nothing outside the folder it is given."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli_fixtures import run_mmoe, small_shards

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CAPTIONING = Path(__file__).resolve().parents[2] / "configs" / "finetune" / "captioning_tiny.yaml"


def files_under(root: Path) -> set[Path]:
    return {path for path in root.rglob("*") if path.is_file()}


def caption_fit(tmp_path: Path, run_folder: str, *options: str) -> list[str]:
    """``mmoe fit`` of ``configs/finetune/captioning_tiny.yaml`` on a small synthetic corpus for 2 steps with one
    validation at step 2, run folder ``run_folder``."""
    shards = small_shards(tmp_path / "data")
    return [
        "fit",
        "--config",
        str(CAPTIONING),
        f"--data.init_args.data_root={shards.parent}",
        f"--model.init_args.output_vocab={shards / 'coco-karpathy-train-restval' / 'caption_tokens.json'}",
        f"--trainer.default_root_dir={run_folder}",
        "--trainer.max_steps=2",
        "--trainer.val_check_interval=2",
        "--trainer.limit_val_batches=1",
        "--data.init_args.batch_size=4",
        "--data.init_args.eval_batch_size=4",
        "--data.init_args.num_workers=0",
        "--model.init_args.num_beams=1",
        "--model.init_args.max_length=4",
        *options,
    ]


@pytest.mark.parametrize("run_folder", ["mine_captioning", "ABSOLUTE"], ids=["relative", "absolute"])
def test_captioning_fit_writes_only_into_its_run_folder(tmp_path, capsys, monkeypatch, run_folder):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    argv = caption_fit(tmp_path, str(tmp_path / "elsewhere" / "run") if run_folder == "ABSOLUTE" else run_folder)
    root = tmp_path / "elsewhere" / "run" if run_folder == "ABSOLUTE" else work / run_folder
    before = files_under(tmp_path)
    code, _, err = run_mmoe(argv, capsys)
    assert code == 0, err
    written = files_under(tmp_path) - before
    assert written and all(root in path.parents for path in written), sorted(map(str, written - files_under(root)))
    assert (root / "results" / "captions_val_step2.json").is_file()  # the validation's captions, in the run folder
    assert (root / "checkpoints" / "last.ckpt").is_file()
