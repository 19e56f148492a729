"""One run per run folder: `mmoe fit` into a folder another run holds, or into one it cannot write, stops at start
with one line and exit code 2, and leaves the other run's files alone."""

from __future__ import annotations

import csv
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from mmoe.runtime.run_lock import LOCK_FILE
from mmoe.runtime.run_logs import CSV_LOGGER
from tests.cli_fixtures import run_mmoe
from tests.tasks.test_pretraining_run import tiny_config
from tests.tasks.test_run_lock import holding_process, read_only, running_run

ENV = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def fit_command(config: Path, *extra: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from mmoe.cli import main; sys.exit(main(sys.argv[1:]))", "fit",
            "--config", str(config), *extra]  # fmt: skip


def tiny_config_file(corpus: Path, tmp_path: Path, root: Path) -> Path:
    """The tiny pre-training config (written in ``tmp_path``) into the run folder ``root``, with its default
    loggers."""
    path = tiny_config("xmoe", corpus, tmp_path, steps=2)
    config = yaml.safe_load(path.read_text())
    config["trainer"]["default_root_dir"] = str(root)
    del config["trainer"]["logger"]
    path.write_text(yaml.safe_dump(config))
    return path


def error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    return stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("subcommand", ["fit", "validate", "test", "predict"])
def test_a_command_into_a_folder_another_process_holds_is_refused_naming_its_host_and_pid(
    subcommand, synthetic_corpus, tmp_path, capsys
):
    root = tmp_path / "run"
    root.mkdir()
    with holding_process(root) as holder:
        config = tiny_config_file(synthetic_corpus, tmp_path, root)
        code, _, stderr = run_mmoe([subcommand, "--config", str(config)], capsys)
        assert code == 2
        assert error_line(stderr).startswith(
            f"mmoe {subcommand}: error: run folder {root} is in use by another run (host {socket.gethostname()} "
            f"pid {holder.pid} started now; lock file {root / LOCK_FILE}): wait for it to end, or give this run "
            "another trainer.default_root_dir"
        )
        assert sorted(path.name for path in root.iterdir()) == [LOCK_FILE]  # nothing written beside it


def test_fit_into_a_read_only_run_folder_is_one_line_at_start(synthetic_corpus, tmp_path, capsys):
    with read_only(tmp_path / "ro") as folder:
        config = tiny_config_file(synthetic_corpus, tmp_path, folder / "run")
        code, _, stderr = run_mmoe(["fit", "--config", str(config)], capsys)
    assert code == 2
    assert error_line(stderr).startswith(f"mmoe fit: error: run folder {folder / 'run'} cannot be written: ")


def test_fit_with_a_read_only_checkpoint_folder_is_one_line_at_start(synthetic_corpus, tmp_path, capsys):
    root = tmp_path / "run"
    with read_only(root / "checkpoints") as checkpoints:
        code, _, stderr = run_mmoe(["fit", "--config", str(tiny_config_file(synthetic_corpus, tmp_path, root))], capsys)
        assert code == 2
        assert error_line(stderr).startswith(f"mmoe fit: error: checkpoint folder {checkpoints} cannot be written: ")
        assert sorted(path.name for path in root.iterdir()) == ["checkpoints"]  # no lock left, nothing written


def metrics_steps(root: Path) -> list[int]:
    with open(root / "csv" / "version_0" / "metrics.csv") as handle:
        return [int(row["step"]) for row in csv.DictReader(handle) if row.get("train/loss")]


@pytest.mark.slow
def test_a_second_fit_into_a_running_fit_s_folder_is_refused_and_the_first_finishes_untouched(
    synthetic_corpus, tmp_path
):
    steps = 12
    root = tmp_path / "run"
    root.mkdir()
    path = tiny_config("xmoe", synthetic_corpus, root, steps=steps)
    config = yaml.safe_load(path.read_text())
    config["seed_everything"] = 1
    csv_logs = {"save_dir": str(root), "name": "csv", "version": 0, "flush_logs_every_n_steps": 1}
    config["trainer"]["logger"] = [{"class_path": CSV_LOGGER, "init_args": csv_logs}]
    path.write_text(yaml.safe_dump(config))
    first = subprocess.Popen(fit_command(path), cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        metrics = root / "csv" / "version_0" / "metrics.csv"
        deadline = time.monotonic() + 600
        while not metrics.is_file() and first.poll() is None:  # training has started
            assert time.monotonic() < deadline
            time.sleep(0.05)
        first.send_signal(signal.SIGSTOP)  # paused, holding the folder, while the second run starts
        second = subprocess.run(fit_command(path, "--seed_everything", "2"), cwd=tmp_path, env=ENV,
                                capture_output=True, text=True, timeout=600)  # fmt: skip
        first.send_signal(signal.SIGCONT)
        assert second.returncode == 2, second.stderr[-3000:]
        assert error_line(second.stderr).startswith(
            f"mmoe fit: error: run folder {root} is in use by another run (host {socket.gethostname()} "
            f"pid {first.pid} started "
        )
        _, stderr = first.communicate(timeout=600)
    finally:
        first.kill()
        first.wait()
    assert first.returncode == 0, stderr[-3000:]
    assert metrics_steps(root) == list(range(steps))
    assert yaml.safe_load((root / "csv" / "version_0" / "config.yaml").read_text())["seed_everything"] == 1
    assert sorted(path.name for path in (root / "checkpoints").iterdir()) == ["last.ckpt"]
    checkpoint = torch.load(root / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["global_step"] == steps
    assert not (root / LOCK_FILE).exists()


def test_fit_into_a_folder_whose_lock_file_is_a_symbolic_link_is_one_line_and_its_target_is_untouched(
    synthetic_corpus, tmp_path, capsys
):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious data line 1\nline 2\n")
    root = tmp_path / "run"
    root.mkdir()
    (root / LOCK_FILE).symlink_to(victim)
    code, _, stderr = run_mmoe(["fit", "--config", str(tiny_config_file(synthetic_corpus, tmp_path, root))], capsys)
    assert code == 2
    assert "precious" not in stderr and "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == (
        f"mmoe fit: error: run folder {root}: its lock file {root / LOCK_FILE} is a symbolic link, not a regular "
        "file: remove it (mmoe makes its lock files itself)"
    )
    assert victim.read_text() == "precious data line 1\nline 2\n"
    assert sorted(path.name for path in root.iterdir()) == [LOCK_FILE]  # nothing trained, the link left as it was


def test_fit_whose_checkpoint_folder_lies_in_a_running_run_s_folder_is_refused_in_one_line(
    synthetic_corpus, tmp_path, capsys
):
    """As a second run given the first one's checkpoints/ as its ModelCheckpoint dirpath, which would mix the two."""
    running, root = tmp_path / "running", tmp_path / "run"
    with running_run(running, running / "checkpoints") as holder:
        config = tiny_config_file(synthetic_corpus, tmp_path, root)
        callbacks = [f'{{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {{"dirpath": '
                     f'"{running / "checkpoints"}", "save_last": true}}}}']  # fmt: skip
        code, _, stderr = run_mmoe(["fit", "--config", str(config), f"--trainer.callbacks=[{callbacks[0]}]"], capsys)
        assert code == 2
        assert error_line(stderr).startswith(
            f"mmoe fit: error: checkpoint folder {running / 'checkpoints'} is inside {running}, which another run "
            f"holds (host {socket.gethostname()} pid {holder.pid} started "
        )
        assert sorted(path.name for path in (running / "checkpoints").iterdir()) == [LOCK_FILE]
        assert not root.exists()


def test_a_fresh_fit_is_not_warned_that_its_checkpoint_folder_is_not_empty_and_a_fit_beside_checkpoints_is(
    synthetic_corpus, tmp_path
):
    """The folder holds only the run's own lock file when Lightning looks; once it holds checkpoints, the warning is
    given as Lightning gives it."""
    root = tmp_path / "run"
    config = tiny_config_file(synthetic_corpus, tmp_path, root)
    warning = f"Checkpoint directory {root / 'checkpoints'} exists and is not empty."
    for fit, warned in [("fresh", False), ("beside the first's checkpoints", True)]:
        done = subprocess.run(fit_command(config), cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        assert (warning in done.stderr) is warned, f"{fit}: {done.stderr[-3000:]}"


#: The folders a run makes in its run folder, as the refusal of a file in the way names them.
RUN_SUBFOLDERS = {
    "tensorboard": "TensorBoard logs",
    "csv": "CSV logs",
    "checkpoints": "checkpoints",
    "snapshots": "backbone snapshots",
}


@pytest.mark.parametrize(
    ("name", "kind"),
    [*((name, "file") for name in RUN_SUBFOLDERS), ("snapshots", "dangling link"), ("routing_stats.json", "folder")],
)
def test_a_path_in_the_way_of_the_run_folders_layout_is_one_line_at_start(
    name, kind, synthetic_corpus, tmp_path, capsys
):
    expected = (
        f"is a file, where mmoe makes the folder of its {RUN_SUBFOLDERS[name]}"
        if name in RUN_SUBFOLDERS
        else "is a folder, where mmoe writes its routing statistics"
    )
    root = tmp_path / "run"
    root.mkdir()
    if kind == "file":
        (root / name).write_text("x")
    elif kind == "folder":
        (root / name).mkdir()
    else:
        (root / name).symlink_to(tmp_path / "absent")
    code, _, stderr = run_mmoe(["fit", "--config", str(tiny_config_file(synthetic_corpus, tmp_path, root))], capsys)
    assert code == 2
    assert error_line(stderr) == (
        f"mmoe fit: error: run folder {root}: {root / name} {expected}: move it aside, or give this run another "
        "trainer.default_root_dir"
    )
    assert len(stderr.strip().splitlines()) == 1 and not (root / "checkpoints").is_dir()
