"""``--jobs`` of ``mmoe study claims`` and ``mmoe demo``: 0 and negative values are refused (exit 2), and a value
above the CPU cores the command may use is capped at them, said in one line (each job is a process training a model)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mmoe.io import usable_cores
from tests.cli_fixtures import run_mmoe


@pytest.mark.parametrize("jobs", ["0", "-1"])
def test_study_refuses_no_jobs_or_a_negative_count(jobs, tmp_path):
    command = [sys.executable, "-m", "mmoe.cli", "study", "claims", "--fast", "--out", str(tmp_path / "out")]
    done = subprocess.run([*command, f"--jobs={jobs}"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith(f"argument --jobs: {jobs} is below 1")
    assert not (tmp_path / "out").exists()


def test_study_caps_jobs_at_the_cores_in_one_line(capsys):
    code, out, err = run_mmoe(["study", "claims", "--fast", "--dry-run", "--jobs", "1000"], capsys)
    assert code == 0 and out
    assert err.strip().splitlines() == [
        f"mmoe study: --jobs 1000 capped at {usable_cores()}, the CPU cores this command may use"
    ]
    code, _, err = run_mmoe(["study", "claims", "--fast", "--dry-run", "--jobs", str(usable_cores())], capsys)
    assert code == 0 and "capped" not in err


def test_demo_caps_jobs_at_the_cores_in_one_line(tmp_path, capsys):
    argv = ["demo", "--fast", "--out", str(tmp_path / "demo"), "--stages", "no-such-stage", "--jobs", "1000"]
    code, _, err = run_mmoe(argv, capsys)
    lines = err.strip().splitlines()
    assert (
        code == 2
        and lines[0] == f"mmoe demo: --jobs 1000 capped at {usable_cores()}, the CPU cores this command may use"
    )
    assert len(lines) == 2 and lines[1].startswith("mmoe demo: error: ")
