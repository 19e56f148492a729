"""Config files are read safely by every ``mmoe`` command that reads one: a key given twice, an alias bomb and a class
outside mmoe's, Lightning's and torch's packages each end in one line naming the file (exit 2) before anything runs or
is imported; long values quoted in errors are cut short."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from mmoe.config.launch import read_config
from mmoe.config.safety import ALLOWED_PACKAGES, MAX_ERROR_CHARACTERS
from mmoe.config.yaml_reading import MAX_CONFIG_NODES, STRUCTURE, ConfigFileError, load_yaml_config
from tests.cli_fixtures import run_mmoe

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SHIPPED = Path(__file__).resolve().parents[2] / "configs" / "finetune" / "vqav2_tiny.yaml"

DUPLICATE_LEARNING_RATE = """\
model:
  init_args:
    optimizer:
      learning_rate: 2.0e-4
      learning_rate: 5.0
"""

#: The shipped trainer section given again at the end: the first would be dropped whole (its callbacks included).
DUPLICATE_TRAINER = """\
trainer:
  max_steps: 3
seed_everything: 1
trainer:
  max_steps: 7
"""

#: A dotted key is the key of its block, as jsonargparse merges the two: ``max_steps`` given twice.
DOTTED_BESIDE_BLOCK = "trainer:\n  max_steps: 300\ntrainer.max_steps: 7\n"

#: The same, deeper and the other way round: the dotted key first.
DOTTED_BEFORE_DEEP_BLOCK = """\
model:
  init_args:
    optimizer.learning_rate: 5.0
    optimizer:
      learning_rate: 2.0e-4
"""


def alias_bomb(levels: int) -> str:
    """A "billion laughs" config: ``levels`` lists of ten aliases of the one before, 10**levels leaves in ~60 bytes
    a level."""
    lines = ["seed_everything:", "  - &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"  - &a{level} [{', '.join([f'*a{level - 1}'] * 10)}]" for level in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def fit(tmp_path: Path, capsys, *args: str) -> tuple[int, str, str]:
    """``mmoe fit --config <the shipped tiny VQA config> ARGS --print_config`` in ``tmp_path``: (code, out, err)."""
    return run_mmoe(["fit", "--config", str(SHIPPED), *args, "--print_config"], capsys)


def only_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err[:3000]
    return lines[0]


@pytest.mark.parametrize(
    ("text", "key", "lines"),
    [
        (DUPLICATE_LEARNING_RATE, "learning_rate", (4, 5)),
        (DUPLICATE_TRAINER, "trainer", (1, 4)),
        (DOTTED_BESIDE_BLOCK, "trainer.max_steps", (2, 3)),
        (DOTTED_BEFORE_DEEP_BLOCK, "optimizer.learning_rate", (3, 5)),
    ],
)
def test_a_key_given_twice_is_one_line_naming_the_file_the_key_and_both_lines(text, key, lines, tmp_path, capsys):
    config = tmp_path / "edited.yaml"
    config.write_text(text)
    code, out, err = fit(tmp_path, capsys, "--config", str(config))
    assert (code, out) == (2, "")
    assert only_line(err) == (
        f"mmoe fit: error: config {config}: key '{key}' is given twice in one mapping (line {lines[0]} and line "
        f"{lines[1]}); the second would silently replace the first"
    )


def test_a_config_read_from_python_refuses_a_key_given_twice(tmp_path):
    config = tmp_path / "edited.yaml"
    config.write_text(DUPLICATE_LEARNING_RATE)
    with pytest.raises(ValueError, match=f"config {config}: key 'learning_rate' is given twice .*line 4 and line 5"):
        read_config([SHIPPED, config])


def test_an_alias_bomb_ends_at_once_in_one_line(tmp_path, capsys):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(alias_bomb(9))  # 10**9 leaves
    assert bomb.stat().st_size < 600
    start = time.monotonic()
    code, out, err = fit(tmp_path, capsys, "--config", str(bomb))
    assert time.monotonic() - start < 10
    assert (code, out) == (2, "")
    assert only_line(err).startswith(
        f"mmoe fit: error: config {bomb}: its anchors and aliases (&name, *name) expand to more than "
        f"{MAX_CONFIG_NODES} values"
    )


def test_aliases_that_expand_to_a_config_sized_value_are_read(tmp_path, capsys):
    """Anchors that repeat a value (as ``yaml.safe_dump`` writes an object used twice) mean what they say."""
    shared = {"logging_interval": "step"}
    monitor = "lightning.pytorch.callbacks.LearningRateMonitor"
    callbacks = [{"class_path": monitor, "init_args": shared}, {"class_path": monitor, "init_args": shared}]
    config = tmp_path / "aliases.yaml"
    config.write_text(yaml.safe_dump({"trainer": {"callbacks": callbacks}}))
    assert "*id001" in config.read_text()
    code, out, err = fit(tmp_path, capsys, "--config", str(config))
    assert code in (0, None), err
    printed = yaml.safe_load(out)["trainer"]["callbacks"]
    monitors = [callback for callback in printed if callback["class_path"] == monitor]
    assert [callback["init_args"]["logging_interval"] for callback in monitors] == ["step", "step"]


def yaml_texts() -> list[str]:
    """Short texts around every printable ASCII character and YAML's line breaks: alone, first, inside and last, with
    and without a space after, doubled, and a few values jsonargparse reads."""
    marks = [chr(code) for code in range(32, 127)] + ["\t", "\n", "\r", "\x85", "\u2028", "\u2029"]
    texts = ["shards/pretrain-images", "1e-4", "bf16-mixed", "a - b", "- - a", "'a: b'", '"a\\nb"', "a #: b", "!tag x"]
    for mark in marks:
        texts += [mark, f"{mark}a", f"{mark} a", f"a{mark}b", f"a {mark} b", f"a{mark}", f"a {mark}", mark * 2]
    return texts


def test_a_text_read_without_being_composed_is_one_scalar_when_composed():
    """The shortcut of :func:`check_yaml_config` (a text without structure passes without being composed) may only
    pass texts YAML reads as one scalar: any mapping, sequence or alias among the texts is structure."""
    shortcut = 0
    for text in yaml_texts():
        try:
            node = yaml.compose(text, Loader=yaml.SafeLoader)
        except yaml.YAMLError:
            continue  # not YAML: building the value fails the same way
        if STRUCTURE.search(text) is None:
            shortcut += 1
            assert node is None or isinstance(node, yaml.ScalarNode), repr(text)
    assert shortcut > 300  # most texts take it


def test_an_anchor_inside_itself_and_a_merge_key_are_told_apart():
    with pytest.raises(ConfigFileError, match="line 1: an anchor is used inside itself"):
        load_yaml_config("a: &a [1, *a]\n", "loop.yaml")
    merged = load_yaml_config("base: &base {x: 1, y: 2}\nrun:\n  <<: *base\n  y: 3\n", "merge.yaml")
    assert merged["run"] == {"x": 1, "y": 3}


CLASS_OUTSIDE = "this.Whatever"  # importing `this` prints the Zen of Python: its import-time code ran


@pytest.mark.parametrize(
    "where",
    ["config file", "--trainer.callbacks+=", "--model", "--trainer.callbacks=[...]", "--data.class_path"],
)
@pytest.mark.parametrize(
    ("outside", "module"),
    [(CLASS_OUTSIDE, "this"), ("torch.utils.model_dump.__main__.Dump", "torch.utils.model_dump.__main__")],
)
def test_a_class_outside_the_allowed_packages_is_refused_before_it_is_imported(
    where, outside, module, tmp_path, capsys, monkeypatch
):
    """``this`` prints the Zen of Python when imported; torch's model_dump ``__main__`` runs its program on argv."""
    monkeypatch.delitem(sys.modules, module, raising=False)
    if where == "config file":
        config = tmp_path / "callback.yaml"
        config.write_text(f"trainer:\n  callbacks:\n    - class_path: {outside}\n")
        args = ["--config", str(config)]
    elif where == "--trainer.callbacks=[...]":
        args = [f'--trainer.callbacks=[{{"class_path": "{outside}"}}]']
    else:
        args = [f"{where}{'' if where.endswith('=') else '='}{outside}"]
    code, out, err = fit(tmp_path, capsys, *args)
    assert module not in sys.modules and "Beautiful is better than ugly" not in out + err
    assert code == 2
    assert only_line(err) == (
        f"mmoe fit: error: class path {outside} is not in an allowed package ({', '.join(ALLOWED_PACKAGES)}); "
        "it was not imported"
    )


def test_a_long_value_in_an_error_is_cut_short(tmp_path, capsys):
    config = tmp_path / "long.yaml"
    config.write_text(yaml.safe_dump({"seed_everything": ["x" * 50] * 2000}))  # a 100 kB value of the wrong type
    code, _, err = fit(tmp_path, capsys, "--config", str(config))
    assert code == 2
    line = only_line(err)
    assert len(line) < MAX_ERROR_CHARACTERS + 100
    assert line.startswith("mmoe fit: error: ") and "seed_everything" in line and "more characters)" in line


@pytest.mark.slow
def test_the_mmoe_process_refuses_an_outside_class_and_an_alias_bomb_without_running_either(tmp_path):
    """As a user meets them: ``mmoe fit`` in its own process, where nothing is imported beforehand."""
    (tmp_path / "callback.yaml").write_text(f"trainer:\n  callbacks:\n    - class_path: {CLASS_OUTSIDE}\n")
    (tmp_path / "bomb.yaml").write_text(alias_bomb(9))
    command = [sys.executable, "-c", "import sys; from mmoe.cli import main; sys.exit(main(sys.argv[1:]))"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    for extra, message in (("callback.yaml", f"class path {CLASS_OUTSIDE} is not"), ("bomb.yaml", "expand to more")):
        argv = ["fit", "--config", str(SHIPPED), "--config", str(tmp_path / extra), "--print_config"]
        done = subprocess.run([*command, *argv], capture_output=True, text=True, env=environment, timeout=120)
        assert done.returncode == 2 and done.stdout == "", done.stderr[-2000:]
        assert "Beautiful is better than ugly" not in done.stderr
        assert len(done.stderr.splitlines()) == 1 and message in done.stderr


def test_moe_info_reads_its_config_file_safely_too(tmp_path, capsys):
    config = tmp_path / "moe.yaml"
    config.write_text("dim: 64\nffn_dim: 256\nnum_experts: 4\ndim: 128\n")
    code, out, err = run_mmoe(["moe-info", "--moe", str(config)], capsys)
    assert (code, out) == (2, "")
    assert only_line(err).startswith(f"mmoe moe-info: error: config {config}: key 'dim' is given twice")
