"""A real `mmoe predict` whose process group gets SIGTERM mid-split (as `timeout` and SLURM send it, DataLoader worker
included) stops with one line naming the signal and saying the predictions file was not written, exit code 143, no
traceback and no file."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.cli.test_predict_partial import predict_config
from tests.cli_fixtures import small_shards

pytestmark = pytest.mark.slow

ENV = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def children(pid: int) -> list[int]:
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def forked_children(pid: int) -> set[int]:
    """The children of ``pid`` that run its own program (forked, not exec'd: a DataLoader worker), not a helper
    program some library starts (a short-lived subprocess during start-up is a child too)."""
    try:
        program = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return set()
    forked = set()
    for child in children(pid):
        try:
            if Path(f"/proc/{child}/cmdline").read_bytes() == program:
                forked.add(child)
        except FileNotFoundError:
            pass
    return forked


def test_sigterm_to_the_process_group_stops_predict_without_a_file(tmp_path):
    shards = small_shards(tmp_path, val_images=60)
    config = Path(predict_config(tmp_path, shards, shards / "vqav2-val2014"))
    values = yaml.safe_load(config.read_text())
    values["data"]["init_args"].update(num_workers=1, eval_batch_size=1)
    config.write_text(yaml.safe_dump(values))
    predictions = tmp_path / "answers.json"
    assert values["model"]["init_args"]["predictions_file"] == str(predictions)

    command = [sys.executable, "-c", "import sys; from mmoe.cli import main; sys.exit(main(sys.argv[1:]))",
               "predict", "--config", str(config)]  # fmt: skip
    process = subprocess.Popen(command, cwd=tmp_path, env=ENV, start_new_session=True, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 300
    seen: set[int] = set()
    while True:  # the loader's worker runs once the predict loop has started
        forked = forked_children(process.pid)
        if forked & seen:  # the same program in two polls: a worker, not a fork about to exec another program
            break
        seen = forked
        assert process.poll() is None, process.stderr.read()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGTERM)
    _, stderr = process.communicate(timeout=300)

    assert process.returncode == 143, stderr[-3000:]
    assert "Traceback" not in stderr and "DataLoader worker" not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    not_written = f"{re.escape(str(predictions))} was not written"
    stopped = rf"mmoe predict: stopped by SIGTERM after predicting \d+ batch(es)?: {not_written}"
    assert re.fullmatch(stopped, last), stderr[-3000:]
    assert not predictions.exists()
    assert not list(tmp_path.glob(".answers.json*"))  # no temporary file left either
