"""Config values are held to the checks config files are: an alias bomb is refused wherever it is given (on the
command line, or quoted inside a config as a value jsonargparse reads as YAML again), and a file that is not a config,
named as a value or as ``--config``, is refused without its content being quoted. A dotted key for a setting its block
leaves out is still read (one beside the same setting in its block: ``test_config_safety``), and a printed config reads
back as it was."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mmoe.config.yaml_reading import MAX_CONFIG_NODES
from tests.cli.test_config_safety import SHIPPED, fit, only_line
from tests.cli_fixtures import run_mmoe

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

#: The memory the ``mmoe`` process of the command-line bomb test may map: enough to start and parse (torch needs
#: about 3 GB of address space), far below what the bomb's 10**8 values take when expanded (over 20 GB).
MEMORY_LIMIT_BYTES = 4 * 1024**3

SECRET = "API_TOKEN=hunter2-9f8e7d6c5b4a"


def alias_bomb_value(levels: int) -> str:
    """A one-line "billion laughs" value: ``levels`` lists of ten aliases of the one before, 10**levels leaves."""
    names = "abcdefghijklmnop"
    parts = [f"a: &a [{','.join('x' * 10)}]"]
    parts += [f"{name}: &{name} [{','.join([f'*{names[i]}'] * 10)}]" for i, name in enumerate(names[1:levels])]
    return "{" + ", ".join(parts) + "}"


def expansion_refused(where: str) -> str:
    return f"mmoe fit: error: {where}: its anchors and aliases (&name, *name) expand to more than {MAX_CONFIG_NODES}"


# -- dotted keys and printed configs ----------------------------------------------------------------------------------


def test_a_dotted_key_for_a_setting_its_block_leaves_out_is_read(tmp_path, capsys):
    config = tmp_path / "dotted.yaml"
    config.write_text("trainer:\n  max_epochs: 4\ntrainer.max_steps: 7\n")
    code, out, err = fit(tmp_path, capsys, "--config", str(config))
    assert code in (0, None), err
    printed = yaml.safe_load(out)["trainer"]
    assert (printed["max_steps"], printed["max_epochs"]) == (7, 4)


def test_a_printed_config_read_back_prints_the_same(tmp_path, capsys):
    code, first, err = fit(tmp_path, capsys)
    assert code in (0, None), err
    printed = tmp_path / "printed.yaml"
    printed.write_text(first)
    code, second, err = run_mmoe(["fit", "--config", str(printed), "--print_config"], capsys)
    assert code in (0, None), err
    assert second == first


# -- alias bombs given as values -------------------------------------------------------------------------------------


def limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))


@pytest.mark.slow
def test_an_alias_bomb_on_the_command_line_ends_in_one_line_within_a_memory_bound():
    """The 302-byte value of 10**8 leaves, as a script passing a value through would give it; the process may map
    4 GB, so a bomb that expands ends it with a ``MemoryError`` instead of filling the machine."""
    bomb = alias_bomb_value(8)
    assert len(bomb) == 302
    command = [sys.executable, "-c", "import sys; from mmoe.cli import main; sys.exit(main(sys.argv[1:]))"]
    argv = ["fit", "--config", str(SHIPPED), "--seed_everything", bomb, "--print_config"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*command, *argv], capture_output=True, text=True, env=environment, timeout=120, preexec_fn=limit_memory
    )
    assert (done.returncode, done.stdout) == (2, ""), done.stderr[-2000:]
    assert only_line(done.stderr).startswith(expansion_refused("command-line value of --seed_everything"))


@pytest.mark.parametrize(
    ("option", "value", "where"),
    [
        ("--seed_everything=", alias_bomb_value(5), "command-line value of --seed_everything"),
        (
            "--model.init_args.optimizer.betas",
            f"['{alias_bomb_value(5)}', 0.9]",
            "command-line value of --model.init_args.optimizer.betas: the value on line 1",
        ),
    ],
)
def test_an_alias_bomb_in_a_command_line_value_is_refused(option, value, where, tmp_path, capsys):
    """10**5 leaves: past the bound, small enough to expand here should the check miss it."""
    args = [option + value] if option.endswith("=") else [option, value]
    code, out, err = fit(tmp_path, capsys, *args)
    assert (code, out) == (2, "")
    assert only_line(err).startswith(expansion_refused(where))


@pytest.mark.parametrize(
    ("config_text", "line"),
    [
        (yaml.safe_dump({"seed_everything": alias_bomb_value(5)}, width=1000), 1),
        (
            yaml.safe_dump({"model": {"init_args": {"optimizer": {"betas": [alias_bomb_value(5), 0.9]}}}}, width=1000),
            5,
        ),
    ],
)
def test_an_alias_bomb_quoted_as_a_value_in_a_config_file_is_refused(config_text, line, tmp_path, capsys):
    config = tmp_path / "quoted.yaml"
    config.write_text(config_text)
    assert "&a" in config.read_text()
    code, out, err = fit(tmp_path, capsys, "--config", str(config))
    assert (code, out) == (2, "")
    assert only_line(err).startswith(expansion_refused(f"config {config}: the value on line {line}"))


# -- a file that is not a config -------------------------------------------------------------------------------------


@pytest.fixture
def secret_file(tmp_path) -> Path:
    """A plain text file of the machine, as ``/etc/passwd`` is."""
    secret = tmp_path / "credentials.txt"
    secret.write_text(f"{SECRET}\nroot:x:0:0:root:/root:/bin/bash\n")
    return secret


@pytest.mark.parametrize("given", ["config file", "command line"])
def test_a_value_naming_a_file_that_is_no_config_names_the_file_and_never_quotes_it(
    given, secret_file, tmp_path, capsys
):
    if given == "config file":
        config = tmp_path / "moe_path.yaml"
        config.write_text(f"model:\n  init_args:\n    backbone:\n      moe: {secret_file}\n")
        args = ["--config", str(config)]
    else:
        args = ["--model.init_args.backbone.moe", str(secret_file)]
    code, out, err = fit(tmp_path, capsys, *args)
    assert (code, out) == (2, "")
    assert SECRET not in err and "hunter2" not in err and "root:x" not in err
    assert only_line(err) == (
        f"mmoe fit: error: model.backbone.moe: the value names {secret_file}, which is not a config file: it holds "
        "plain text, not settings (its content is not shown)"
    )


def test_a_config_file_that_is_no_config_is_refused_without_quoting_it(secret_file, tmp_path, capsys):
    code, out, err = fit(tmp_path, capsys, "--config", str(secret_file))
    assert (code, out) == (2, "")
    assert SECRET not in err and "hunter2" not in err and "root:x" not in err
    assert only_line(err) == (
        f"mmoe fit: error: config {secret_file}: not a config file: it holds no mapping of settings (its content is "
        "not shown)"
    )


def test_an_alias_bomb_in_a_moe_info_value_is_refused(capsys):
    code, out, err = run_mmoe(["moe-info", "--moe.dim", "64", "--moe.num_experts", alias_bomb_value(5)], capsys)
    assert (code, out) == (2, "")
    assert only_line(err).startswith(
        f"mmoe moe-info: error: command-line value of --moe.num_experts: its anchors and aliases (&name, *name) expand "
        f"to more than {MAX_CONFIG_NODES}"
    )
