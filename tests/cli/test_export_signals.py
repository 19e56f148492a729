"""``mmoe export`` stopped from outside, as a scheduler, ``timeout`` or Ctrl-C stops it: SIGTERM or SIGINT during the
write ends it with one line and exit 128 + the signal's number, its staging folder removed and an earlier export
kept whole; the staging folder a SIGKILL left is removed by the next export of the same folder, and nothing else is
(links, files, other folders' staging, a young one, one a live write holds locked)."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mmoe.model import MultiwayConfig, MultiwayTransformer, from_pretrained
from mmoe.runtime.checkpoint import export_backbone
from tests.cli_fixtures import run_mmoe

pytestmark = pytest.mark.slow

#: ``mmoe <argv>`` with the function ``{stretched}`` of ``mmoe.model.pretrained`` taking a long time after its work: a
#: large model's weights file being written (``save_file``), or the rest of the command after the folder is in place
#: (``write_folder``), stretched so that a signal lands inside it.
SLOW_EXPORT = """
import sys, time
import mmoe.model.pretrained as pretrained

work = pretrained.{stretched}


def stretched(*args, **kwargs):
    done = work(*args, **kwargs)
    time.sleep(600)
    return done


pretrained.{stretched} = stretched
from mmoe.cli import main

sys.exit(main(sys.argv[1:]))
"""

#: Generous bound for the subprocess to reach its write (import of torch and Lightning included).
STARTUP_S = 120.0


@pytest.fixture
def backbone_file(tmp_path) -> Path:
    torch.manual_seed(0)
    path = tmp_path / "backbone.pt"
    export_backbone(MultiwayTransformer(MultiwayConfig.preset("test")), path)
    return path


def staging_folders(out: Path) -> list[Path]:
    return sorted(path for path in out.parent.iterdir() if path.name.startswith(f".{out.name}."))


def start_slow_export(ckpt: Path, out: Path, stretched: str = "save_file") -> subprocess.Popen:
    """A real ``mmoe export`` process, returned once its staging folder holds the weights file (``save_file``
    stretched) or once its folder is in place (``write_folder``)."""
    script = SLOW_EXPORT.format(stretched=stretched)
    argv = [sys.executable, "-c", script, "export", "--ckpt", str(ckpt), "--out", str(out), "--backbone-only"]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + STARTUP_S

    def reached() -> bool:
        if stretched == "write_folder":
            return (out / "config.json").exists()
        return any((folder / "model.safetensors").exists() for folder in staging_folders(out))

    while not reached():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the export never reached its write"
        time.sleep(0.05)
    return process


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=lambda stop: stop.name)
def test_a_stop_signal_during_the_write_is_one_line_and_leaves_the_earlier_export_whole(
    backbone_file, tmp_path, stop, capsys
):
    out = tmp_path / "exported"
    code, _, err = run_mmoe(["export", "--ckpt", str(backbone_file), "--out", str(out), "--backbone-only"], capsys)
    assert code == 0, err
    earlier = from_pretrained(out).state_dict()
    process = start_slow_export(backbone_file, out)
    process.send_signal(stop)
    stdout, stderr = process.communicate(timeout=STARTUP_S)
    assert process.returncode == 128 + stop, stderr
    assert stderr == f"mmoe export: stopped by {stop.name}: {out} was not written\n" and stdout == ""
    assert staging_folders(out) == []
    back = from_pretrained(out).state_dict()
    assert all(torch.equal(back[name], tensor) for name, tensor in earlier.items())


def test_a_stop_signal_after_the_folder_is_in_place_says_it_was_written(backbone_file, tmp_path):
    out = tmp_path / "exported"
    process = start_slow_export(backbone_file, out, stretched="write_folder")
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=STARTUP_S)
    assert process.returncode == 128 + signal.SIGTERM, stderr
    assert stderr == f"mmoe export: stopped by SIGTERM: {out} was written whole\n"
    assert staging_folders(out) == [] and from_pretrained(out).config == MultiwayConfig.preset("test")


def backdate(folder: Path, seconds: float = 3600.0) -> None:
    """Sets the times of ``folder`` and of everything in it (links themselves, not followed) ``seconds`` back."""
    past = time.time() - seconds
    for parent, folders, files in os.walk(folder):
        for name in folders + files:
            os.utime(os.path.join(parent, name), (past, past), follow_symlinks=False)
    os.utime(folder, (past, past), follow_symlinks=False)


def test_a_killed_exports_staging_folder_is_removed_by_the_next_export_and_nothing_else(
    backbone_file, tmp_path, capsys
):
    out = tmp_path / "exported"
    process = start_slow_export(backbone_file, out)
    process.kill()
    process.communicate(timeout=STARTUP_S)
    [left] = staging_folders(out)  # what a SIGKILL (or a power cut) leaves: nothing runs to clean up
    backdate(left)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    (tmp_path / ".exported.linktoit").symlink_to(elsewhere)  # a link named like a staging folder: never followed
    (tmp_path / ".exported.afilexyz").write_text("mine")
    young, other, locked = (
        tmp_path / ".exported.youngone",
        tmp_path / ".another.abcdefgh",
        tmp_path / ".exported.heldlock",
    )
    for folder in (young, other, locked):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"partial")
    backdate(other)
    backdate(locked)
    lock = os.open(locked, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(lock, fcntl.LOCK_EX)  # as a live export holds its own
    try:
        code, _, err = run_mmoe(["export", "--ckpt", str(backbone_file), "--out", str(out), "--backbone-only"], capsys)
        assert code == 0, err
    finally:
        os.close(lock)
    assert not left.exists()
    assert (tmp_path / ".exported.linktoit").is_symlink() and (elsewhere / "keep.txt").read_text() == "mine"
    assert (tmp_path / ".exported.afilexyz").read_text() == "mine"
    assert all((folder / "model.safetensors").read_bytes() == b"partial" for folder in (young, other, locked))
    code, _, err = run_mmoe(["export", "--ckpt", str(backbone_file), "--out", str(out), "--backbone-only"], capsys)
    assert code == 0, err
    assert not locked.exists() and young.exists()  # its lock released, it is stale too
    assert sorted(path.name for path in out.iterdir()) == ["config.json", "model.safetensors"]
