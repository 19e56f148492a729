"""``mmoe eval``: exactly one JSON object on stdout, warnings and errors on stderr, exit code 2 for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mmoe.cli import COMMANDS
from mmoe.metrics.cli import eval_command


def _one_json_object(text: str) -> dict:
    value, end = json.JSONDecoder().raw_decode(text)
    assert text[end:].strip() == "", "stdout holds more than one JSON value"
    assert isinstance(value, dict)
    return value


@pytest.fixture
def vqa_args(tmp_path):
    annotations = [
        {
            "question_id": qid,
            "image_id": 1,
            "question_type": "how many",
            "answer_type": "number",
            "answers": [{"answer": a, "answer_confidence": "yes", "answer_id": i + 1} for i, a in enumerate(answers)],
        }
        for qid, answers in ((1, ["two"] * 10), (2, ["2"] * 9 + ["3"]))
    ]
    files = {
        "questions": {"questions": [{"question_id": 1, "image_id": 1}, {"question_id": 2, "image_id": 1}]},
        "annotations": {"annotations": annotations},
        "results": [{"question_id": 1, "answer": "two"}, {"question_id": 2, "answer": "two"}],
    }
    args = ["vqa"]
    for name, content in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(content))
        args += [f"--{name}", str(tmp_path / f"{name}.json")]
    return args


def test_eval_is_registered():
    assert COMMANDS["eval"].target() is eval_command


def test_vqa_cli(vqa_args, capsys):
    assert eval_command(vqa_args) == 0
    out, err = capsys.readouterr()
    report = _one_json_object(out)
    # question 1: unanimous "two", prediction "two" -> 100; question 2: "two" -> "2" matches nine "2" -> 100
    assert report == {
        "overall": 100.0,
        "perAnswerType": {"number": 100.0},
        "perQuestionType": {"how many": 100.0},
        "perQuestion": {"1": 100.0, "2": 100.0},
    }
    assert err == ""


def test_vqa_cli_missing_question_is_exit_2(vqa_args, capsys, tmp_path):
    (tmp_path / "results.json").write_text(json.dumps([{"question_id": 1, "answer": "two"}]))
    assert eval_command(vqa_args) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"mmoe eval vqa: error: {tmp_path / 'results.json'}: no answer for question id 2 of ")
    assert "Traceback" not in err


def test_nlvr2_cli_warns_on_extra_predictions(tmp_path, capsys):
    data, predictions = tmp_path / "dev.json", tmp_path / "predictions.csv"
    data.write_text('{"identifier": "dev-1-0-0", "label": "True"}\n{"identifier": "dev-1-1-0", "label": "False"}\n')
    predictions.write_text("dev-1-0-0,true\ndev-1-1-0,true\ndev-2-0-0,false\n")
    assert eval_command(["nlvr2", "--data", str(data), "--predictions", str(predictions)]) == 0
    out, err = capsys.readouterr()
    assert _one_json_object(out) == {"accuracy": 0.5, "consistency": 0.0}
    assert "mmoe eval nlvr2: warning: 1 predictions have identifiers absent from the data" in err


def test_usage_errors_exit_2(capsys):
    assert eval_command([]) == 2
    assert eval_command(["vqa", "--questions", "q.json"]) == 2
    assert eval_command(["bleu"]) == 2
    assert eval_command(["caption", "--annotations", "a.json", "--karpathy", "k.json", "--results", "r.json"]) == 2
    out, _ = capsys.readouterr()
    assert out == ""


def test_mmoe_eval_process_reports_bad_input_without_traceback(tmp_path):
    data, predictions = tmp_path / "dev.json", tmp_path / "predictions.csv"
    data.write_text('{"identifier": "dev-1-0-0", "label": "True"}\n')
    predictions.write_text("dev-1-0-0;true\n")
    command = [
        sys.executable,
        "-m",
        "mmoe.cli",
        "eval",
        "nlvr2",
        "--data",
        str(data),
        "--predictions",
        str(predictions),
    ]
    failed = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert failed.returncode == 2 and failed.stdout == ""
    assert f"{predictions}, line 1: 'dev-1-0-0;true' is not 'identifier,prediction'" in failed.stderr
    assert "Traceback" not in failed.stderr


def test_mmoe_eval_does_not_import_lightning(tmp_path):
    """``mmoe eval`` imports only what scoring needs: each subcommand's module is imported when it runs."""
    import subprocess
    import sys

    dev = tmp_path / "dev.json"
    dev.write_text('{"identifier": "dev-1-0-0", "label": "True"}\n')
    predictions = tmp_path / "predictions.csv"
    predictions.write_text("dev-1-0-0,True\n")
    script = (
        "import sys; from mmoe.cli import main; "
        f"code = main(['eval', 'nlvr2', '--data', {str(dev)!r}, '--predictions', {str(predictions)!r}]); "
        "print(sorted(name for name in sys.modules if name.split('.')[0] in ('lightning', 'pytorch_lightning'))); "
        "sys.exit(code)"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert '"accuracy": 1.0' in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "[]"
