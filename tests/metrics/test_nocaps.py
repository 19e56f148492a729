"""NoCaps scoring: each domain's metrics equal pycocoevalcap's scorers run by hand on that domain's images, and the
evaluation server's results file holds every image once.

The scoring tests run the PTB tokenizer (Java) and are marked slow; METEOR (a jar start per domain) is left out.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mmoe.metrics.cli import eval_command
from mmoe.metrics.files import EvalInputError
from mmoe.metrics.nocaps import evaluate_nocaps_files, load_nocaps_file, score_by_domain

#: image id -> (domain, reference captions, predicted caption); ids out of order, domains mixed as in the real file.
IMAGES = {
    7: ("in-domain", ["A dog runs on the grass.", "a brown dog running in a park"], "a dog running on the grass"),
    3: ("near-domain", ["Two cats sleep on a sofa.", "cats sleeping on a couch"], "two cats sleeping on a couch"),
    12: ("out-domain", ["A red fire truck on a street.", "a fire engine parked"], "a red truck on the street"),
    5: ("in-domain", ["A man rides a bicycle.", "a person riding a bike down a road"], "a man riding a bike"),
    9: ("near-domain", ["A bowl of fruit on a table.", "apples and bananas in a bowl"], "a bowl of apples"),
    1: ("out-domain", ["A jellyfish in dark water.", "a glowing jellyfish swimming"], "a jellyfish in the water"),
    4: ("near-domain", ["A child flies a kite.", "a kid with a kite on a beach"], "a child flying a kite"),
}


def write_files(tmp_path, captions: bool = True):
    images = [{"id": i, "file_name": f"{i:016x}.jpg", "domain": d} for i, (d, _, _) in IMAGES.items()]
    data = {"licenses": [], "info": {}, "images": images}
    if captions:
        data["annotations"] = [
            {"image_id": i, "id": 100 * i + k, "caption": c}
            for i, (_, refs, _) in IMAGES.items()
            for k, c in enumerate(refs)
        ]
    annotations = tmp_path / ("nocaps_val_4500_captions.json" if captions else "nocaps_test_image_info.json")
    annotations.write_text(json.dumps(data))
    results = tmp_path / "results.json"
    results.write_text(json.dumps([{"image_id": i, "caption": p} for i, (_, _, p) in IMAGES.items()]))
    return annotations, results


def pycocoevalcap_by_hand(ids: list[int]) -> dict[str, float]:
    """BLEU-1..4, ROUGE-L and CIDEr of the images ``ids`` alone: pycocoevalcap's tokenizer and scorers called directly
    on that subset, as COCOEvalCap.evaluate calls them."""
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    gts = PTBTokenizer().tokenize({i: [{"caption": c} for c in IMAGES[i][1]] for i in ids})
    res = PTBTokenizer().tokenize({i: [{"caption": IMAGES[i][2]}] for i in ids})
    bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
    scores = {f"Bleu_{n}": float(b) for n, b in enumerate(bleu, start=1)}
    scores["ROUGE_L"] = float(Rouge().compute_score(gts, res)[0])
    scores["CIDEr"] = float(Cider().compute_score(gts, res)[0])
    return scores


@pytest.mark.slow
def test_each_domain_equals_pycocoevalcap_on_its_images_by_hand(tmp_path):
    annotations, _ = write_files(tmp_path)
    split = load_nocaps_file(annotations)
    predictions = {i: p for i, (_, _, p) in IMAGES.items()}
    report = score_by_domain(split, predictions, meteor=False, spice=False)
    assert list(report) == ["in-domain", "near-domain", "out-domain", "entire"]
    for domain, images in report.items():
        ids = [i for i, (d, _, _) in IMAGES.items() if domain in (d, "entire")]  # the file's order
        assert (images["images_scored"], images["images_total"]) == (len(ids), len(ids))
        by_hand = pycocoevalcap_by_hand(ids)
        assert {name: images[name] for name in by_hand} == by_hand, domain
    assert len({report[domain]["CIDEr"] for domain in report}) == 4  # the IDF is each subset's: four different values


@pytest.mark.slow
def test_cli_prints_the_report_and_the_table_and_writes_the_submission(tmp_path, capsys):
    annotations, results = write_files(tmp_path)
    submission = tmp_path / "submit" / "nocaps_val_results.json"
    argv = ["nocaps", "--annotations", str(annotations), "--results", str(results), "--submission", str(submission)]
    assert eval_command([*argv, "--no-meteor", "--no-spice"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert report["submission"] == {"path": str(submission), "entries": len(IMAGES)}
    assert "| metric | in-domain | near-domain | out-domain | entire |" in err
    assert f"| CIDEr | {report['in-domain']['CIDEr']:.4f} | {report['near-domain']['CIDEr']:.4f} |" in err
    entries = json.loads(submission.read_text())
    assert [entry["image_id"] for entry in entries] == list(IMAGES)  # every image once, in the file's order
    assert entries == [{"image_id": i, "caption": p} for i, (_, _, p) in IMAGES.items()]


def test_image_info_is_counted_not_scored_and_its_submission_needs_every_image(tmp_path):
    annotations, results = write_files(tmp_path, captions=False)
    submission = tmp_path / "nocaps_test_results.json"
    report = evaluate_nocaps_files(results, annotations, submission)
    assert report["images"] == {"in-domain": 2, "near-domain": 3, "out-domain": 2, "entire": 7}
    assert "EvalAI challenge 355" in report["scored"]
    assert sorted(entry["image_id"] for entry in json.loads(submission.read_text())) == sorted(IMAGES)
    entries = json.loads(results.read_text())
    results.write_text(json.dumps(entries[:3] + entries[4:]))  # image 5 has no caption
    submission.unlink()
    message = r"no caption for 1 of the 7 images of .*nocaps_test_image_info.json \(first: image id 5\)"
    with pytest.raises(EvalInputError, match=message):
        evaluate_nocaps_files(results, annotations, submission)
    assert not submission.exists()
    results.write_text(json.dumps(entries + [entries[0]]))
    with pytest.raises(EvalInputError, match=r"entry 7: second caption for image id 7; expected one per image"):
        evaluate_nocaps_files(results, annotations, submission)


@pytest.mark.parametrize(
    ("spoil", "message"),
    [
        (lambda d: d["images"][2].pop("domain"), r"images\[2\] \(id 12\): missing field 'domain'"),
        (lambda d: d["images"][0].update(domain="in"), r"images\[0\] \(id 7\): field 'domain' = \"in\": expected one"),
        (lambda d: d["annotations"].append({"image_id": 99, "caption": "x"}), r"image id 99 is not in 'images'"),
        (
            lambda d: d.update(annotations=d["annotations"][2:]),
            r"no caption in 'annotations' for 1 of the 7 images \(first: image id 7\)",
        ),
    ],
)
def test_bad_annotations(tmp_path, spoil, message):
    annotations, _ = write_files(tmp_path)
    data = json.loads(annotations.read_text())
    spoil(data)
    annotations.write_text(json.dumps(data))
    with pytest.raises(EvalInputError, match=message):
        load_nocaps_file(annotations)


def test_bad_input_through_the_command_is_one_line_and_exit_2(tmp_path):
    annotations, results = write_files(tmp_path)
    results.write_text(json.dumps([{"image_id": 8, "caption": "a dog"}]))
    command = [sys.executable, "-m", "mmoe.cli", "eval", "nocaps", "--annotations", str(annotations)]
    done = subprocess.run([*command, "--results", str(results)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == f"mmoe eval nocaps: error: {results}, entry 0: image id 8 is not in {annotations}\n"
