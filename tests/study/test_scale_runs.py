"""What ``mmoe study claims --scale gpu`` / ``--scale gpu-tasks`` runs: refused without ``--dry-run`` while its runs
do not follow its plan."""

from __future__ import annotations

import pytest

from mmoe.study.command import study_command


@pytest.mark.parametrize("preset", ["gpu", "gpu-tasks"])
def test_a_gpu_preset_without_dry_run_is_refused_in_one_line(preset, tmp_path, capsys):
    out = tmp_path / "out"
    assert study_command(["claims", "--scale", preset, "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert error == (
        f"mmoe study: error: --scale {preset}: this preset's runs are not implemented yet; --dry-run prints its plan\n"
    )
    assert not out.exists()
