"""scripts/setup.sh: pip's index settings become the options of its ``uv pip install`` (scripts/uv_index_options.py),
and the environment it makes is byte-compiled."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "uv_index_options.py"
spec = importlib.util.spec_from_file_location("uv_index_options", SCRIPT)
uv_index_options = importlib.util.module_from_spec(spec)
spec.loader.exec_module(uv_index_options)

#: ``pip config list`` on a machine with a local mirror beside PyPI, a wheel folder and a constraint file: the
#: environment's variables (``:env:``) first, then the files' sections.
MACHINE = """\
:env:.cert='/etc/ssl/certs/ca-certificates.crt'
:env:.default-timeout='180'
:env:.find-links='/opt/wheels'
global.cert='/etc/ssl/certs/ca-certificates.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/opt/wheels'
"""


def test_a_machine_s_mirrors_wheel_folder_and_constraints_are_passed_on():
    assert uv_index_options.uv_index_options(MACHINE) == [
        "--extra-index-url", "file:///opt/pypi/simple", "--extra-index-url", "file:///opt/pypi-more/simple",
        "--find-links", "/opt/wheels",
        "--constraint", "/etc/xdg/pip/constraints.txt",
    ]  # fmt: skip


def test_the_install_section_overrides_global_and_the_environment_both_in_any_order():
    lines = [":env:.index-url='https://env.example/simple'", "install.index-url='https://install.example/simple'",
             "global.index-url='https://global.example/simple'", "download.find-links='/elsewhere'",
             "install.find-links='/wheels/a\\n/wheels/b'", "global.find-links='/wheels/global'"]  # fmt: skip
    assert uv_index_options.uv_index_options("\n".join(lines)) == [
        "--index-url", "https://env.example/simple", "--find-links", "/wheels/a", "--find-links", "/wheels/b",
    ]  # fmt: skip
    assert uv_index_options.uv_index_options("\n".join(lines[1:])) == [
        "--index-url", "https://install.example/simple", "--find-links", "/wheels/a", "--find-links", "/wheels/b",
    ]  # fmt: skip


def test_no_index_is_passed_on_only_when_set_true():
    assert uv_index_options.uv_index_options("global.no-index='yes'\nglobal.find-links='/w'") == [
        "--find-links", "/w", "--no-index",
    ]  # fmt: skip
    assert uv_index_options.uv_index_options("global.no-index='true'\n:env:.no-index='0'") == []


def test_a_machine_without_pip_settings_gives_no_option_and_no_empty_line():
    """An empty line would reach ``uv pip install`` as an empty requirement (setup.sh reads one option per line)."""
    for config in ("", ":env:.default-timeout='60'\n"):
        done = subprocess.run([sys.executable, str(SCRIPT)], input=config, capture_output=True, text=True, check=True)
        assert done.stdout == ""
    done = subprocess.run([sys.executable, str(SCRIPT)], input=MACHINE, capture_output=True, text=True, check=True)
    assert done.stdout.splitlines() == uv_index_options.uv_index_options(MACHINE)


@pytest.mark.parametrize(
    "name", ["torch.nn.modules.linear", "lightning.pytorch.trainer.trainer", "jsonargparse", "mmoe.config.launch"]
)
def test_the_modules_every_process_imports_are_byte_compiled(name):
    """Where PYTHONDONTWRITEBYTECODE is set (as where CI runs), no process writes .pyc files, so the set-up writes them:
    uv only when asked (``--compile-bytecode``), mmoe's own by ``compileall``. Without them every process compiled
    torch and Lightning from source again, and the suite ran over 25 minutes instead of 19."""
    module = importlib.import_module(name)
    assert Path(importlib.util.cache_from_source(module.__file__)).is_file(), module.__file__
