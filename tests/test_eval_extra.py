"""The tests that need the ``eval`` extra (CLIP_benchmark's own evaluation; SciPy's Welch test as the claims study's
independent reference), run with ``.venv-eval/bin/python``: scripts/setup.sh installs the extra there, in an
environment layered over ``.venv/``, not in ``.venv/`` itself, because torchmetrics (which Lightning imports) imports
transformers and SciPy whenever they are installed, about 1.3 s more CPU for each of the suite's ~110 processes that
import Lightning. Where this environment has the extra (``pip install -e .[dev,eval]``), those tests ran here and this
one has nothing to add."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EVAL_PYTHON = ROOT / ".venv-eval" / "bin" / "python"
#: The tests that skip without the extra, each a test id pytest takes.
NEEDS_THE_EXTRA = [
    "tests/harness/test_clip_benchmark.py",
    "tests/study/test_bakeoff_statistics.py::test_the_welch_p_values_equal_scipys",
    "tests/study/test_scale_runs.py::test_claim_6_is_decided_over_the_pre_trainings_means_with_holm",
    "tests/test_stats.py::test_the_t_tests_equal_scipys",
]


def test_the_tests_that_need_the_eval_extra_pass_in_its_environment(tmp_path):
    if importlib.util.find_spec("clip_benchmark") and importlib.util.find_spec("scipy"):
        pytest.skip("the eval extra is installed in this environment: its tests ran here")
    if not EVAL_PYTHON.exists():
        pytest.skip("no .venv-eval/ (bash scripts/setup.sh makes it)")
    report = tmp_path / "report.xml"
    environment = {name: value for name, value in os.environ.items() if not name.startswith("PYTEST_")}
    command = [str(EVAL_PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
               *NEEDS_THE_EXTRA]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    suite = ElementTree.parse(report).getroot().find("testsuite")
    counts = {name: int(suite.get(name)) for name in ("tests", "failures", "errors", "skipped")}
    assert counts["tests"] >= 10 and counts["failures"] == counts["errors"] == counts["skipped"] == 0, counts
    ran = {case.get("name").split("[")[0] for case in suite.iter("testcase")}
    assert {"test_clip_benchmark_retrieval_recalls_equal_mmoe_eval_retrieval",
            "test_the_command_runs_clip_benchmark_with_the_mmoe_model_type",
            "test_claim_6_is_decided_over_the_pre_trainings_means_with_holm",
            "test_the_t_tests_equal_scipys"} <= ran  # fmt: skip
