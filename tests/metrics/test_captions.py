"""COCO caption metrics: equal to pycocoevalcap's scorers called directly, hand-checked where the arithmetic is short.

The Java-based tests (PTB tokenizer, METEOR) take some seconds each and are marked slow; input checks and the SPICE
guard run without Java.
"""

from __future__ import annotations

import gc
import json
import os
import stat
import warnings

import pytest

from mmoe.metrics import spice as spice_module
from mmoe.metrics.captions import ScorerUnavailableError, evaluate_caption_files, score_captions
from mmoe.metrics.cli import eval_command
from mmoe.metrics.files import EvalInputError

REFERENCES = {
    1: ["A dog runs on the grass.", "a dog is running"],
    2: ["Two cats sleep on a sofa.", "Cats sleeping"],
    3: ["A red car parked on the street."],  # no prediction: left out with a warning
}
PREDICTIONS = {1: "A dog running on grass", 2: "two cats sleeping on a couch."}

# BleuScorer's smoothing constants: each precision is (correct + 1e-15) / (guessed + 1e-9).
TINY, SMALL = 1e-15, 1e-9
# After PTB tokenization (lower-case, "." dropped):
#   1: "a dog running on grass" vs "a dog runs on the grass" / "a dog is running"
#   2: "two cats sleeping on a couch" vs "two cats sleep on a sofa" / "cats sleeping"
# Unigrams: 5 of 5 + 5 of 6 ("couch" unmatched) = 10 of 11. Bigrams: "a dog" (1 of 4) + "two cats", "cats sleeping",
# "on a" (3 of 5) = 4 of 9. No trigram matches. Closest reference lengths 4 (tie 4/6 goes to the shorter) and 6:
# 10 < 11 hypothesis tokens, so no brevity penalty.
P1, P2 = (10 + TINY) / (11 + SMALL), (4 + TINY) / (9 + SMALL)
BLEU_1, BLEU_2 = P1, (P1 * P2) ** 0.5
# ROUGE-L (beta = 1.2) takes the best precision and the best recall over references separately:
#   1: LCS 4 with ref 1 ("a dog on grass": P 4/5, R 4/6), LCS 3 with ref 2 (P 3/5, R 3/4) -> P 0.8, R 0.75
#   2: LCS 4 with ref 1 (P 4/6, R 4/6), LCS 2 with ref 2 (P 2/6, R 2/2)                  -> P 2/3, R 1
ROUGE_1 = (1 + 1.2**2) * 0.8 * 0.75 / (0.75 + 1.2**2 * 0.8)
ROUGE_2 = (1 + 1.2**2) * (2 / 3) * 1 / (1 + 1.2**2 * (2 / 3))
ROUGE_L = (ROUGE_1 + ROUGE_2) / 2


def _direct_pycocoevalcap(references, predictions):
    """What COCOEvalCap.evaluate computes, calling pycocoevalcap's tokenizer and scorers by hand (SPICE aside)."""
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.meteor.meteor import Meteor
    from pycocoevalcap.rouge.rouge import Rouge
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    ids = [i for i in references if i in predictions]
    gts = PTBTokenizer().tokenize({i: [{"caption": c} for c in references[i]] for i in ids})
    res = PTBTokenizer().tokenize({i: [{"caption": predictions[i]}] for i in ids})
    bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
    scores = {f"Bleu_{n}": b for n, b in enumerate(bleu, start=1)}
    scores["METEOR"] = Meteor().compute_score(gts, res)[0]
    scores["ROUGE_L"] = float(Rouge().compute_score(gts, res)[0])
    scores["CIDEr"] = float(Cider().compute_score(gts, res)[0])
    return scores


@pytest.fixture(scope="module")
def direct():
    return _direct_pycocoevalcap(REFERENCES, PREDICTIONS)


@pytest.mark.slow
def test_score_captions_equals_pycocoevalcap(direct):
    with pytest.warns(UserWarning, match=r"1 of 3 ground-truth images have no predicted caption; scoring the 2"):
        scores = score_captions(REFERENCES, PREDICTIONS)
    assert list(scores)[:8] == [*direct, "SPICE"]
    for name, value in direct.items():
        assert scores[name] == value, name
    assert scores["Bleu_1"] == pytest.approx(BLEU_1, rel=1e-12)
    assert scores["Bleu_2"] == pytest.approx(BLEU_2, rel=1e-12)
    assert scores["Bleu_3"] < 1e-5 and scores["Bleu_4"] < 1e-7  # no 3-gram match: only the 1e-15 smoothing
    assert scores["ROUGE_L"] == pytest.approx(ROUGE_L, rel=1e-12)
    assert scores["CIDEr"] == pytest.approx(2.2227387146944366, rel=1e-12)  # pinned from pycocoevalcap 1.2
    assert scores["METEOR"] == pytest.approx(0.48079090983960665, rel=1e-9)  # pinned from meteor-1.5.jar
    if spice_module.spice_unavailable_reason() is not None:
        assert scores["SPICE"] is None and "\n" not in scores["SPICE_unavailable"]


@pytest.mark.slow
def test_scoring_with_meteor_leaves_no_pipe_of_its_jar_open():
    """The METEOR jar's output pipes are closed once it is stopped: no ResourceWarning when they are collected."""
    references = {image_id: REFERENCES[image_id] for image_id in PREDICTIONS}
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        scores = score_captions(references, PREDICTIONS, spice=False)
        gc.collect()
    assert scores["METEOR"] == pytest.approx(0.48079090983960665, rel=1e-9)
    assert [f"{warning.category.__name__}: {warning.message}" for warning in shown] == []


@pytest.mark.slow
def test_meteor_can_be_left_out(direct):
    with pytest.warns(UserWarning, match="no predicted caption"):
        scores = score_captions(REFERENCES, PREDICTIONS, meteor=False, spice=False)
    assert scores["METEOR"] is None and scores["METEOR_unavailable"] == "not requested"
    assert {name: scores[name] for name in direct if name != "METEOR"} == {
        name: value for name, value in direct.items() if name != "METEOR"
    }


@pytest.mark.slow
def test_caption_cli_prints_one_json_object(tmp_path, capsys, direct):
    annotations, results = tmp_path / "captions_val2014.json", tmp_path / "results.json"
    images = [{"id": i, "file_name": f"{i}.jpg"} for i in (3, 1, 2)]  # ground-truth order decides the scoring order
    captions = [
        {"image_id": i, "id": 10 * i + k, "caption": c} for i, cs in REFERENCES.items() for k, c in enumerate(cs)
    ]
    annotations.write_text(json.dumps({"images": images, "annotations": captions}))
    results.write_text(json.dumps([{"image_id": i, "caption": c} for i, c in PREDICTIONS.items()]))
    assert eval_command(["caption", "--annotations", str(annotations), "--results", str(results), "--no-spice"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert {name: report[name] for name in direct} == direct
    assert report["SPICE"] is None and report["SPICE_unavailable"] == "not requested"
    assert "warning: 1 of 3 ground-truth images have no predicted caption" in err
    assert (report["images_scored"], report["images_total"]) == (2, 3)
    argv = ["caption", "--annotations", str(annotations), "--results", str(results), "--no-spice", "--no-meteor"]
    assert eval_command(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["METEOR"] is None and report["METEOR_unavailable"] == "not requested"
    assert report["CIDEr"] == direct["CIDEr"]


# ---------------------------------------------------------------- input checks (no Java needed)


def test_api_input_errors():
    with pytest.raises(EvalInputError, match="no predicted caption"):
        score_captions(REFERENCES, {})
    with pytest.raises(EvalInputError, match=r"image id 7, which has no reference captions"):
        score_captions(REFERENCES, {7: "a cat"})
    with pytest.raises(EvalInputError, match=r"image id 1: predicted caption must be a string"):
        score_captions(REFERENCES, {1: ["a cat"]})
    with pytest.raises(EvalInputError, match=r"image id 1: expected a non-empty list of reference strings"):
        score_captions({1: []}, {1: "a cat"})


def test_java_missing_is_reported(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ScorerUnavailableError, match="java not found"):
        score_captions({1: REFERENCES[1]}, {1: PREDICTIONS[1]})


@pytest.fixture
def coco_files(tmp_path):
    annotations, results = tmp_path / "captions_val2014.json", tmp_path / "results.json"
    images = [{"id": i} for i in (1, 2, 3, 4)]  # image 4 has no caption
    captions = [
        {"image_id": i, "id": 10 * i + k, "caption": c} for i, cs in REFERENCES.items() for k, c in enumerate(cs)
    ]
    annotations.write_text(json.dumps({"images": images, "annotations": captions}))
    return annotations, results


@pytest.mark.parametrize(
    ("results", "message"),
    [
        ([{"image_id": 9, "caption": "a cat"}], r"results.json, entry 0: image id 9 is not in .*captions_val2014.json"),
        ([{"image_id": 4, "caption": "a cat"}], r"entry 0: image id 4 has no reference caption in"),
        ([{"image_id": 1, "caption": "a"}, {"image_id": 1, "caption": "b"}], r"entry 1: second caption for image id 1"),
        ([{"image_id": 1}], r"results.json, entry 0 \(image id 1\): missing field 'caption'"),
        ([{"caption": "a cat"}], r"results.json, entry 0: missing field 'image_id'"),
        ([], r"results.json: no result"),
        ({"image_id": 1, "caption": "a"}, r"results.json: expected a JSON array"),
    ],
)
def test_bad_results(coco_files, results, message):
    annotations, results_path = coco_files
    results_path.write_text(json.dumps(results))
    with pytest.raises(EvalInputError, match=message):
        evaluate_caption_files(results_path, annotations=annotations)


def test_malformed_annotations(coco_files):
    annotations, results = coco_files
    results.write_text(json.dumps([{"image_id": 1, "caption": "a dog"}]))
    annotations.write_text('{"annotations": [{"image_id": 1, "caption": "a dog"},]}')
    with pytest.raises(EvalInputError, match=r"captions_val2014.json: malformed JSON at line 1"):
        evaluate_caption_files(results, annotations=annotations)
    annotations.write_text(json.dumps({"annotations": [{"image_id": 1}]}))
    with pytest.raises(EvalInputError, match=r"captions_val2014.json, annotation 0: missing field 'caption'"):
        evaluate_caption_files(results, annotations=annotations)


def test_karpathy_references(tmp_path, monkeypatch):
    karpathy = tmp_path / "dataset_coco.json"
    image = {"filepath": "val2014", "filename": "x.jpg", "sentences": [{"raw": "A dog.", "tokens": ["a", "dog"]}]}
    karpathy.write_text(
        json.dumps(
            {
                "images": [
                    dict(image, cocoid=5, split="test"),
                    dict(image, cocoid=6, split="val", sentences=[{"raw": "A cat."}]),
                    dict(image, cocoid=7, split="test", sentences=[{"raw": "A cow."}, {"raw": "Cows."}]),
                ]
            }
        )
    )
    results = tmp_path / "results.json"
    results.write_text(json.dumps([{"image_id": 6, "caption": "a cat"}]))
    with pytest.raises(EvalInputError, match=r"image id 6 is not in the 'test' split of .*dataset_coco.json"):
        evaluate_caption_files(results, karpathy=karpathy, split="test")
    with pytest.raises(EvalInputError, match=r"no image in split 'train'; the file has splits \['test', 'val'\]"):
        evaluate_caption_files(results, karpathy=karpathy, split="train")
    with pytest.raises(EvalInputError, match="exactly one of --annotations"):
        evaluate_caption_files(results)

    seen = {}
    monkeypatch.setattr(
        "mmoe.metrics.captions.score_captions", lambda refs, preds, **kw: seen.update(refs=refs, preds=preds) or {}
    )
    results.write_text(json.dumps([{"image_id": 7, "caption": "a cow"}]))
    evaluate_caption_files(results, karpathy=karpathy, split="test")
    assert seen == {"refs": {5: ["A dog."], 7: ["A cow.", "Cows."]}, "preds": {7: "a cow"}}


def test_caption_cli_errors_exit_2_without_traceback(coco_files, capsys):
    annotations, results = coco_files
    results.write_text(json.dumps([{"image_id": 9, "caption": "a cat"}]))
    assert eval_command(["caption", "--annotations", str(annotations), "--results", str(results)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("mmoe eval caption: error: ") and "image id 9" in err and "Traceback" not in err


# ---------------------------------------------------------------- SPICE: only when it can run, never a download


def test_spice_without_jars_is_unavailable_and_downloads_nothing(monkeypatch, tmp_path):
    def forbidden(*args, **kwargs):
        raise AssertionError("nothing may be downloaded or run")

    monkeypatch.setattr("urllib.request.urlretrieve", forbidden)
    monkeypatch.setattr("subprocess.run", forbidden)
    (tmp_path / "spice-1.0.jar").write_bytes(b"")
    score, reason = spice_module.compute_spice({1: ["a dog"]}, {1: "a dog"}, timeout=5, spice_dir=tmp_path)
    assert score is None
    assert "stanford-corenlp-3.6.0.jar" in reason and "mmoe never downloads" in reason and "\n" not in reason


def _fake_spice(tmp_path, monkeypatch, java_script: str):
    """A SPICE folder with placeholder jars and a fake ``java`` first on PATH running ``java_script``."""
    spice_dir, bin_dir = tmp_path / "spice", tmp_path / "bin"
    (spice_dir / "lib").mkdir(parents=True)
    bin_dir.mkdir()
    for name in spice_module.REQUIRED_JARS:
        (spice_dir / name).write_bytes(b"")
    java = bin_dir / "java"
    java.write_text("#!/bin/sh\n" + java_script)
    java.chmod(java.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return spice_dir


def _writes_output(json_text: str) -> str:
    """A fake jar body that writes ``json_text`` to the file after ``-out``."""
    return f'while [ "$1" != "-out" ]; do shift; done\necho \'{json_text}\' > "$2"\n'


def test_spice_averages_all_f_like_pycocoevalcap(tmp_path, monkeypatch):
    # The fake jar writes F-scores 0.25 and 0.5; SPICE is their numpy mean, as in pycocoevalcap/spice/spice.py.
    output = [{"image_id": 1, "scores": {"All": {"f": 0.25}}}, {"image_id": 2, "scores": {"All": {"f": 0.5}}}]
    spice_dir = _fake_spice(tmp_path, monkeypatch, _writes_output(json.dumps(output)))
    score, reason = spice_module.compute_spice({1: ["a"], 2: ["b"]}, {1: "a", 2: "b"}, timeout=30, spice_dir=spice_dir)
    assert (score, reason) == (0.375, None)


def test_spice_failure_and_timeout_are_reasons_not_crashes(tmp_path, monkeypatch):
    spice_dir = _fake_spice(
        tmp_path, monkeypatch, 'echo "java.lang.NoClassDefFoundError: javax/xml/bind" >&2\nexit 1\n'
    )
    score, reason = spice_module.compute_spice({1: ["a"]}, {1: "a"}, timeout=30, spice_dir=spice_dir)
    assert score is None
    assert reason == "spice-1.0.jar failed with exit code 1: java.lang.NoClassDefFoundError: javax/xml/bind"

    spice_dir = _fake_spice(tmp_path / "slow", monkeypatch, "exec sleep 30\n")
    score, reason = spice_module.compute_spice({1: ["a"]}, {1: "a"}, timeout=0.5, spice_dir=spice_dir)
    assert score is None and reason == "spice-1.0.jar ran past the 0.5 s limit and was stopped"

    output = [{"image_id": 1, "scores": {"All": {"f": "NaN"}}}]
    spice_dir = _fake_spice(tmp_path / "nan", monkeypatch, _writes_output(json.dumps(output)))
    score, reason = spice_module.compute_spice({1: ["a"]}, {1: "a"}, timeout=30, spice_dir=spice_dir)
    assert score is None and "NaN" in reason


def test_carriage_return_does_not_shift_later_captions():
    # pycocoevalcap hands the Java PTB tokenizer one caption per line; a "\r" would end a line early and move every
    # later caption to the wrong image. mmoe turns it into a space first.
    from mmoe.metrics.captions import _tokenize

    assert _tokenize({1: ["A dog\rruns."], 2: ["Two cats."]}, "reference") == {1: ["a dog runs"], 2: ["two cats"]}
