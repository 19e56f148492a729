"""The per-item document of the pre-trained vs random-init comparison: the cluster structure widens the interval,
a malformed document is refused in one line, ``scripts/demo_comparison_docs.py`` ships a run's files, and the
shipped ``docs/demo_comparison/`` files recompute exactly the shipped rows and block."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from mmoe.pipeline import BENCHMARKS, PipelineError, benchmark_named
from mmoe.pipeline.compare import rows_from_items
from mmoe.pipeline.comparison_items import ITEMS_FILE, benchmark_entry, document
from mmoe.pipeline.items import IMAGES, ItemCounts

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "demo_comparison_docs.py"
IMAGES_COUNT, QUESTIONS_PER_IMAGE = 40, 5


def docs_script():
    spec = importlib.util.spec_from_file_location("demo_comparison_docs", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def vqa_document(each_question_its_own_cluster: bool = False, seed: int = 3) -> dict:
    """VQA items, 5 questions per image, each image all right or all wrong (pre-trained right on 70% of the images,
    random init on 50%): the questions of an image are perfectly correlated."""
    rng = np.random.default_rng(seed)
    questions = IMAGES_COUNT * QUESTIONS_PER_IMAGE
    images = np.arange(questions) // QUESTIONS_PER_IMAGE
    ids = [1000 + question for question in range(questions)]
    clusters = ids if each_question_its_own_cluster else images.tolist()
    starts = []
    for skill in (0.7, 0.5):
        right = (rng.random(IMAGES_COUNT) < skill)[images].astype(float)
        starts.append(ItemCounts(ids, np.column_stack([right, np.ones(questions)]), clusters, IMAGES))
    return document([benchmark_entry(benchmark_named("vqav2"), *starts, "here")])


def test_correlated_items_of_a_cluster_give_a_wider_interval_than_resampling_items():
    (by_image,), (by_question,) = rows_from_items(vqa_document()), rows_from_items(vqa_document(True))
    assert by_image["difference"] == by_question["difference"]
    assert (by_image["items"], by_image["clusters"]) == (200, 40) and by_question["clusters"] == 200
    widths = [row["interval"][1] - row["interval"][0] for row in (by_image, by_question)]
    assert widths[0] > 1.5 * widths[1]  # about sqrt(5) wider: 40 independent images, not 200 questions


def broken(change) -> dict:
    value = vqa_document()
    change(value["benchmarks"][0])
    return value


MALFORMED = {
    "clusters shorter than items": (lambda e: e["clusters"].pop(), r"field 'clusters' holds 199 ids; expected one per"),
    "fewer rows than items": (lambda e: e["random_init"].pop(), r"field 'random_init' holds 199 rows"),
    "a row of another width": (lambda e: e["pretrained"][3].append(1), r"field 'pretrained', row 3: .* 2 numbers"),
    "a count as a string": (lambda e: e["pretrained"][5].__setitem__(0, "1"), r"'pretrained', row 5: \[\"1\", 1\]"),
    "a count as a boolean": (lambda e: e["random_init"][0].__setitem__(1, True), r"'random_init', row 0: .* numbers"),
    "a negative count": (lambda e: e["random_init"][2].__setitem__(0, -1), r"row 2: .* finite counts of at least 0"),
    "an unknown metric": (lambda e: e["metrics"][0].__setitem__("metric", "BLEU"), r"metric 0: .* is not compared"),
    "an unknown benchmark": (lambda e: e.__setitem__("benchmark", "gqa"), r"benchmark \"gqa\" is unknown"),
    "an unknown cluster kind": (lambda e: e.__setitem__("cluster", "rooms"), r"cluster \"rooms\"; expected one of"),
    "an item twice": (lambda e: e["items"].__setitem__(1, e["items"][0]), r"field 'items' names an item twice"),
    "an id neither int nor str": (lambda e: e["items"].__setitem__(0, [1]), r"'items', entry 0: \[1\]; expected an"),
    "a missing field": (lambda e: e.pop("random_init"), r"missing field 'random_init'"),
    "a zero denominator": (lambda e: [row.__setitem__(1, 0) for row in e["pretrained"]], r"accuracy \(%\) is undef"),
}  # fmt: skip


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_document_is_refused_in_one_line_naming_the_benchmark_and_field(case):
    change, message = MALFORMED[case]
    with pytest.raises(PipelineError, match=message) as error:
        rows_from_items(broken(change), "items.json")
    assert "\n" not in str(error.value) and str(error.value).startswith("items.json")


@pytest.mark.parametrize(
    ("change", "message"),
    [(lambda d: d.__setitem__("format", "csv"), "format \"csv\""), (lambda d: d.__setitem__("version", 2), "version 2"),
     (lambda d: d["benchmarks"].append(copy.deepcopy(d["benchmarks"][0])), "a benchmark appears twice"),
     (lambda d: d.__setitem__("benchmarks", []), f"0 benchmarks; expected 1 to {len(BENCHMARKS)}")],
)  # fmt: skip
def test_a_malformed_document_header_is_refused(change, message):
    value = vqa_document()
    change(value)
    with pytest.raises(PipelineError, match=message):
        rows_from_items(value)


#: Score rows of both starts as ``results.json``'s ``variants`` holds them: the colour words' chance differs by start.
SCORES = {
    "mhmoe": [{"task": "VQAv2 val", "metric": "accuracy (%)", "value": 53.225, "chance": 39.43, "baseline": "prior"},
              {"task": "COCO captions Karpathy test", "metric": "colour words right (%)", "value": 81.23,
               "chance": 30.65, "baseline": "a random image"}],
    "mhmoe, random init": [
        {"task": "VQAv2 val", "metric": "accuracy (%)", "value": 50.738, "chance": 39.43, "baseline": "prior"},
        {"task": "COCO captions Karpathy test", "metric": "colour words right (%)", "value": 44.37, "chance": 30.96,
         "baseline": "a random image"}],
}  # fmt: skip


def write_run(folder: Path, documents: dict, rows: dict) -> None:
    folder.mkdir()
    (folder / ITEMS_FILE).write_text(json.dumps(documents))
    (folder / "results.json").write_text(json.dumps({"comparison": rows, "variants": SCORES}, indent=2))


def test_the_docs_script_ships_a_runs_items_rows_and_block(tmp_path, monkeypatch, capsys):
    script = docs_script()
    items = vqa_document()
    rows = rows_from_items(items)
    write_run(tmp_path / "run", {"mhmoe": items}, {"mhmoe": rows})
    page, readme, details = tmp_path / "page.md", tmp_path / "README.md", tmp_path / "details.md"
    page.write_text(f"# title\n\n{script.BEGIN}\nold\n{script.END}\n\nafter\n")
    readme.write_text(f"# front\n{script.SCORES_BEGIN}\n| old |\n{script.SCORES_END}\nrest\n")
    details.write_text(f"# details\n{script.DETAILS_BEGIN}\n{script.DETAILS_END}\nrest\n")
    shipped = {"items_file": tmp_path / "docs" / "items.json", "rows_file": tmp_path / "docs" / "comparison.json"}
    scores_file = tmp_path / "docs" / "scores.json"
    block = script.ship(
        tmp_path / "run", None, page=page, scores_file=scores_file, readme=readme, details=details, **shipped
    )
    scores = json.loads(scores_file.read_text())
    assert scores == {"variant": "mhmoe", "pretrained": SCORES["mhmoe"], "random_init": SCORES["mhmoe, random init"]}
    assert (
        script.page_block(readme, script.SCORES_BEGIN, script.SCORES_END)
        == script.scores_table(scores)
        == (
            "| task | metric | pre-trained (mhmoe) | random init | chance | chance baseline |\n"
            "| --- | --- | --- | --- | --- | --- |\n"
            "| VQAv2 val | accuracy (%) | 53.23 | 50.74 | 39.43 | prior |\n"
            "| COCO captions Karpathy test | colour words right (%) | 81.23 | 44.37 | 30.65 / 30.96 | a random image |"
        )
    )
    assert readme.read_text().startswith("# front\n") and readme.read_text().endswith(f"{script.SCORES_END}\nrest\n")
    assert json.loads(shipped["items_file"].read_text()) == items
    assert len(shipped["items_file"].read_text().splitlines()) == 1  # compact
    assert json.loads(shipped["rows_file"].read_text()) == rows
    assert page.read_text() == f"# title\n\n{script.BEGIN}\n{block}\n{script.END}\n\nafter\n"
    assert script.page_block(page, script.BEGIN, script.END) == block == script.markdown_block(**shipped)
    assert "claim 7 in `docs/claims.md`" in block and "conditional on one pre-training and one random init" in block
    table = block.splitlines()[2:]
    assert table[0].split(" | ")[-2:] == ["items", "clusters |"]
    assert table[2].endswith(f"| {rows[0]['verdict']} | 200 | 40 images |")
    details_lines = script.page_block(details, script.DETAILS_BEGIN, script.DETAILS_END).splitlines()
    assert "\n".join(details_lines[:4]) == script.scores_table(scores)
    low, high = (f"{end:.2f}" for end in rows[0]["interval"])  # accuracy (%): both ends at least 2 here
    assert details_lines[5] == (
        f"- VQAv2 val, accuracy (%): {rows[0]['pretrained']:.2f} from the pre-trained backbone against "
        f"{rows[0]['random_init']:.2f} from random init; difference {rows[0]['difference']:.2f} [{low}, {high}], "
        f"*{rows[0]['verdict']}*."
    )
    assert details_lines[6:] == [
        "- COCO captions Karpathy test, colour words right (%) from the pre-trained backbone: 2.65 times its chance "
        "level (30.65, a random image).",
        "- COCO captions Karpathy test, colour words right (%) from random init: 1.43 times its chance level (30.96, "
        "a random image).",
    ]  # 81.23 / 30.65 and 44.37 / 30.96
    paths = {"page": page, "readme": readme, "details": details, "scores_file": scores_file, **shipped}
    assert script.stale_pages(**paths) == []
    details.write_text(details.read_text().replace("2.65 times", "2.66 times"))
    assert script.stale_pages(**paths) == [details]

    rows[0] = rows[0] | {"difference": rows[0]["difference"] + 1}
    write_run(tmp_path / "stale", {"mhmoe": items}, {"mhmoe": rows})
    with pytest.raises(PipelineError, match="results.json, mhmoe does not hold the rows"):
        script.ship(tmp_path / "stale", None, page=page, **shipped)
    monkeypatch.setattr(sys, "argv", ["demo_comparison_docs.py", str(tmp_path / "stale")])
    with pytest.raises(SystemExit) as exit_code:
        script.main()
    assert exit_code.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("demo_comparison_docs.py: error: ") and error.count("\n") == 1


def test_the_docs_script_refuses_links_and_an_ambiguous_variant(tmp_path):
    script = docs_script()
    items = vqa_document()
    write_run(tmp_path / "run", {"mhmoe": items, "xmoe": items}, {"mhmoe": rows_from_items(items)})
    with pytest.raises(PipelineError, match="holds variants mhmoe, xmoe; choose one with --variant"):
        script.run_files(tmp_path / "run", None)
    assert script.run_files(tmp_path / "run", "mhmoe")[:2] == ("mhmoe", items)
    with pytest.raises(PipelineError, match=r"results.json, comparison: missing field 'xmoe'"):
        script.run_files(tmp_path / "run", "xmoe")
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / ITEMS_FILE).symlink_to(tmp_path / "run" / ITEMS_FILE)
    (linked / "results.json").symlink_to(tmp_path / "run" / "results.json")
    with pytest.raises(PipelineError, match="is a link; expected a file of the run folder itself"):
        script.run_files(linked, "mhmoe")


def test_a_deeply_nested_or_oversized_file_is_refused_in_one_line(tmp_path, monkeypatch):
    from mmoe.pipeline import comparison_items

    nested = tmp_path / "nested.json"
    nested.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(
        PipelineError, match="nested.json: malformed JSON at line 1, column 101: .* nested more than 100"
    ):
        comparison_items.read_comparison_items(nested)
    monkeypatch.setattr(comparison_items, "MAX_FILE_BYTES", 10)
    (tmp_path / "large.json").write_text(json.dumps(vqa_document()))
    with pytest.raises(PipelineError, match=r"large.json: [\d,]+ bytes; expected at most 10"):
        comparison_items.read_comparison_items(tmp_path / "large.json")


def test_the_shipped_items_recompute_the_shipped_rows_and_block():
    """``docs/demo_comparison/items.json`` alone gives exactly ``comparison.json`` (``rows_from_items``), and the
    block of ``docs/demo_comparison.md`` is the one those files give."""
    script = docs_script()
    rows = rows_from_items(json.loads(script.SHIPPED_ITEMS.read_text()))
    assert rows == json.loads(script.SHIPPED_ROWS.read_text())
    assert {row["cluster"] for row in rows} <= {"images", "statement sets"} and len(rows) == 5
    assert script.page_block(script.PAGE, script.BEGIN, script.END) == script.markdown_block()


def test_the_details_page_s_block_is_the_shipped_run_s_and_check_finds_none_stale(monkeypatch):
    """``docs/tutorials/demo_details.md``'s results block is generated from the shipped files, as are the other
    pages' (``--check`` exits 0), and every line of its block names a shipped score or comparison row."""
    script = docs_script()
    scores = json.loads(script.SHIPPED_SCORES.read_text())
    block = script.page_block(script.DETAILS, script.DETAILS_BEGIN, script.DETAILS_END)
    assert block == script.details_block(scores, json.loads(script.SHIPPED_ROWS.read_text()))
    assert block.startswith(script.scores_table(scores) + "\n\n- ")
    monkeypatch.setattr(sys, "argv", ["demo_comparison_docs.py", "--check"])
    with pytest.raises(SystemExit) as exit_code:
        script.main()
    assert exit_code.value.code == 0


def test_readme_s_results_table_is_the_shipped_run_s_and_agrees_with_its_comparison():
    """README.md's results table is generated from ``docs/demo_comparison/scores.json``, the same run's scores as the
    comparison: each compared metric's two values are the comparison row's (the table rounds)."""
    script = docs_script()
    scores = json.loads(script.SHIPPED_SCORES.read_text())
    assert script.page_block(script.README, script.SCORES_BEGIN, script.SCORES_END) == script.scores_table(scores)
    values = {start: {(row["task"], row["metric"]): row["value"] for row in scores[start]}
              for start in ("pretrained", "random_init")}  # fmt: skip
    for row in json.loads(script.SHIPPED_ROWS.read_text()):
        for start in values:
            assert values[start][row["task"], row["metric"]] == pytest.approx(row[start], abs=0.005)  # % rounded
