"""JSON nested deeper than :data:`mmoe.io.MAX_JSON_DEPTH` from a user's file: one line naming the file and the bound
(exit 2 at the command line), never a ``RecursionError`` traceback, wherever mmoe reads it
(:func:`mmoe.io.parse_json`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mmoe.cli import main
from mmoe.data.decoders import json_entry
from mmoe.data.samples import CorruptSampleError
from mmoe.data.shards import parse_manifest
from mmoe.harness.clip_benchmark import load_mmoe_clip
from mmoe.io import MAX_JSON_DEPTH, parse_json

DEEP = "[" * 100_000 + "]" * 100_000
TOO_DEEP = f"nested more than {MAX_JSON_DEPTH} deep"


def nested(depth: int, inner: str = "1") -> str:
    """An object ``depth`` levels deep (its innermost an array), with brackets inside strings at every level."""
    return '{"a": "]]{[", "b": ' * (depth - 1) + f'["[[\\"[", {inner}]' + "}" * (depth - 1)


def test_the_bound_is_exact_and_strings_do_not_count():
    assert parse_json(nested(MAX_JSON_DEPTH))
    assert parse_json(nested(MAX_JSON_DEPTH).encode("utf-16"))
    for deep in (nested(MAX_JSON_DEPTH + 1), nested(MAX_JSON_DEPTH + 1).encode(), DEEP):
        with pytest.raises(json.JSONDecodeError, match=TOO_DEEP) as raised:
            parse_json(deep)
        assert raised.value.lineno == 1
    assert parse_json(json.dumps([{"q": "[" * 300, "r": [1, 2]}] * 400)) == [{"q": "[" * 300, "r": [1, 2]}] * 400


def test_check_overlap_names_a_deep_image_digests_file(tmp_path, capsys):
    for split in ("train", "eval"):
        (tmp_path / split).mkdir()
        (tmp_path / split / "image_digests.json").write_text(DEEP)
    assert main(["data", "check-overlap", str(tmp_path / "train"), str(tmp_path / "eval")]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "image_digests.json" in error and TOO_DEEP in error


def test_study_claims_names_a_deep_plan(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text("[" * 50_000 + "]" * 50_000)
    command = [sys.executable, "-m", "mmoe.cli", "study", "claims", "--fast", "--out", str(tmp_path / "out")]
    done = subprocess.run([*command, "--plan", str(plan)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and str(plan) in done.stderr and TOO_DEEP in done.stderr
    assert not (tmp_path / "out").exists()


def test_load_mmoe_clip_refuses_a_deep_config_json_as_a_value_error(tmp_path):
    (tmp_path / "config.json").write_text(DEEP)
    with pytest.raises(ValueError) as raised:
        load_mmoe_clip(pretrained=tmp_path)
    assert str(tmp_path / "config.json") in str(raised.value) and TOO_DEEP in str(raised.value)


def test_manifests_json_lines_and_sample_entries_refuse_deep_json(tmp_path, capsys):
    with pytest.raises(ValueError, match=TOO_DEEP):
        parse_manifest(tmp_path / "manifest.json", DEEP)
    with pytest.raises(CorruptSampleError, match=TOO_DEEP):
        json_entry({"__key__": "k", "__url__": "s.tar", "json": DEEP.encode()})
    table = tmp_path / "table.jsonl"
    table.write_text('{"image": "0.jpg", "caption": "a"}\n' + '{"image": ' + DEEP + "}\n")
    (tmp_path / "images").mkdir()
    out = tmp_path / "out"
    assert (
        main(
            ["data", "convert", "pairs", "--table", str(table), "--images", str(tmp_path / "images"), "--out", str(out)]
        )
        == 2
    )
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and f"{table}:2" in error and TOO_DEEP in error


def test_mmoe_eval_names_a_deep_results_file(tmp_path, capsys):
    questions, annotations, results = (tmp_path / f"{name}.json" for name in ("q", "a", "r"))
    questions.write_text('{"questions": []}')
    annotations.write_text('{"annotations": []}')
    results.write_text(DEEP)
    argv = ["eval", "vqa", "--questions", str(questions), "--annotations", str(annotations), "--results", str(results)]
    assert main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and str(results) in error and TOO_DEEP in error
