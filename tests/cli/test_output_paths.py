"""An output that cannot be written (a read-only folder, ``--out`` naming a folder) is one line naming the user's path
(never the hidden temporary file beside it), exit 2, before the command does its work: ``mmoe infer``,
``mmoe export-backbone``, ``mmoe upcycle``, ``mmoe tokenizer fit``."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from mmoe.io import OutputPathError, check_output_path, write_json, writing_output
from mmoe.model import MultiwayConfig, MultiwayTransformer
from mmoe.runtime.checkpoint import export_backbone
from mmoe.tasks.captioning import CaptioningFineTuning
from mmoe.tasks.catalog import class_path
from tests.cli_fixtures import run_mmoe

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

BACKBONE = MultiwayConfig.preset("test", depth=1)


@pytest.fixture
def read_only(tmp_path):
    """A folder nothing can be written in: a read-only tmpfs mount as root (chmod does not stop root), else a
    folder without write permission."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"root ignores folder permissions and a read-only tmpfs cannot be mounted: {mounted.stderr!r}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


@pytest.fixture
def inputs(tmp_path):
    """A folder of three images and an untrained captioning checkpoint; a dense backbone file and an MoE config."""
    images = tmp_path / "images"
    images.mkdir()
    for index in range(3):
        Image.fromarray(np.full((40, 40, 3), 60 * index, dtype=np.uint8)).save(images / f"{index + 1}.png")
    task = CaptioningFineTuning(backbone=BACKBONE, max_length=3, num_beams=1)
    checkpoint = tmp_path / "caption.ckpt"
    torch.save({"hyper_parameters": {**task.hparams, "_class_path": class_path(CaptioningFineTuning)},
                "state_dict": task.state_dict()}, checkpoint)  # fmt: skip
    export_backbone(MultiwayTransformer(BACKBONE), tmp_path / "dense.pt")
    moe = {"model": {"class_path": class_path(CaptioningFineTuning),
                     "init_args": {"backbone": {"moe": {"num_experts": 2, "every": 1}}}}}  # fmt: skip
    (tmp_path / "moe.yaml").write_text(yaml.safe_dump(moe))
    return {"images": images, "caption": checkpoint, "dense": tmp_path / "dense.pt", "moe": tmp_path / "moe.yaml"}


def commands(inputs: dict, out: Path) -> dict[str, list[str]]:
    return {
        "infer --image DIR": ["infer", "caption", "--ckpt", str(inputs["caption"]), "--image", str(inputs["images"]),
                              "--out", str(out)],
        "infer --routing": ["infer", "caption", "--ckpt", str(inputs["caption"]), "--image",
                            str(inputs["images"] / "1.png"), "--routing", str(out)],
        "export-backbone": ["export-backbone", "--ckpt", str(inputs["caption"]), "--out", str(out)],
        "upcycle": ["upcycle", "--ckpt", str(inputs["dense"]), "--config", str(inputs["moe"]), "--out", str(out)],
        "tokenizer fit": ["tokenizer", "fit", "--data", str(inputs["images"]), "--size", "2", "--out", str(out)],
    }  # fmt: skip


#: command -> (its error prefix, the output option)
COMMANDS = {"infer --image DIR": ("infer", "--out"), "infer --routing": ("infer", "--routing"),
            "export-backbone": ("export-backbone", "--out"), "upcycle": ("upcycle", "--out"),
            "tokenizer fit": ("tokenizer fit", "--out")}  # fmt: skip


@pytest.mark.parametrize("command", COMMANDS)
def test_an_output_in_a_read_only_folder_is_one_line_before_the_work(command, inputs, read_only, capsys):
    out = read_only / "result.out"
    code, stdout, err = run_mmoe(commands(inputs, out)[command], capsys)
    assert (code, stdout) == (2, "")
    name, option = COMMANDS[command]
    # One line: no progress bar, no result, no traceback; the user's path, not the temporary file's.
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"mmoe {name}: error: {option} {out} cannot be written: {read_only}: ")
    assert "Read-only file system" in err or "Permission denied" in err
    assert f".{out.name}." not in err


@pytest.mark.parametrize("command", COMMANDS)
def test_an_output_naming_a_folder_is_one_line_before_the_work(command, inputs, tmp_path, capsys):
    out = tmp_path / "existing"
    out.mkdir()
    code, stdout, err = run_mmoe(commands(inputs, out)[command], capsys)
    assert (code, stdout) == (2, "")
    name, option = COMMANDS[command]
    assert err == f"mmoe {name}: error: {option} {out} is a folder; expected the path of a file to write\n"
    assert list(out.iterdir()) == []


def test_a_write_that_fails_after_the_check_names_the_users_path(read_only):
    out = read_only / "scores.json"
    with pytest.raises(OutputPathError) as raised:
        with writing_output(out, "--out"):
            write_json(out, {"score": 1})
    assert str(raised.value).startswith(f"--out {out} cannot be written: ")
    assert f".{out.name}." not in str(raised.value)


def test_a_writable_output_passes_the_check_and_its_missing_parents_are_not_made(tmp_path):
    out = tmp_path / "new" / "folders" / "result.json"
    assert check_output_path(out) == out
    assert not (tmp_path / "new").exists() and list(tmp_path.iterdir()) == []
    (tmp_path / "a_file").write_text("")
    with pytest.raises(OutputPathError, match="is a file, not a folder"):
        check_output_path(tmp_path / "a_file" / "result.json")
