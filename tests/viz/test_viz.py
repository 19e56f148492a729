"""Routing figures and the ``mmoe viz`` / ``mmoe analyze`` commands: PNGs whose pixels follow the routing, JSON keys,
and one-line errors for bad input."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from mmoe.cli import main
from mmoe.metrics.routing import image_diversity_maps, inter_run_consistency, sort_keys
from mmoe.metrics.routing_stats import STATS_FORMAT
from mmoe.routing.render import diversity_grid, heatmap_panels
from mmoe.viz.figures import save_figure
from mmoe.viz.maps import draw_patch_grid, draw_text_maps, patch_grid_figure
from mmoe.viz.plots import (
    activation_heatmap_figure,
    draw_activation_curve,
    draw_activation_heatmap,
    draw_load_histograms,
)
from tests.cli_fixtures import tiny_sentencepiece
from tests.routing_fixtures import image_dir, make_checkpoint, record, shard


def pixels(path) -> np.ndarray:
    assert path.stat().st_size > 0
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def differ(a, b) -> bool:
    a, b = pixels(a), pixels(b)
    return a.shape != b.shape or bool(np.any(a != b))


# -- drawing functions -----------------------------------------------------------------------------------------------


def test_patch_grid_pixels_follow_the_routing(tmp_path):
    image = np.full((32, 32, 3), 128, dtype=np.uint8)
    uniform = torch.zeros(1, 17, 4, 1, dtype=torch.long)  # CLS + 16 patches, 4 heads, all to expert 0
    diverse = uniform.clone()
    diverse[0, 1:9, :, 0] = torch.arange(4)  # the top half of the patches: 4 distinct experts
    drawn = {}
    for name, index in (("uniform", uniform), ("diverse", diverse), ("uniform_again", uniform.clone())):
        maps = image_diversity_maps([record(index, 4, layer=1)], image_len=17)
        columns = {"layer 1 (vision)": maps["layer1/vision"].numpy()}
        for overlay in (False, True):
            path = tmp_path / f"{name}_{overlay}.png"
            drawn[name, overlay] = draw_patch_grid([image], columns, 4, "diversity", path, overlay=overlay)
    for overlay in (False, True):
        assert differ(drawn["uniform", overlay], drawn["diverse", overlay])
        assert not differ(drawn["uniform", overlay], drawn["uniform_again", overlay])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{p.name}" for p in drawn.values())  # no temporaries


def test_text_maps_pixels_follow_the_routing(tmp_path):
    tokens = [["<start>", "a", "cat", "<end>"]]
    same = {"layer 1": np.array([[1, 1, 1, 1]])}
    mixed = {"layer 1": np.array([[1, 2, 2, 1]])}
    a = draw_text_maps(tokens, same, 2, "text", tmp_path / "a.png", ["t0"])
    b = draw_text_maps(tokens, mixed, 2, "text", tmp_path / "b.png", ["t0"])
    assert differ(a, b)


@pytest.mark.parametrize("draw", [draw_activation_heatmap, draw_load_histograms, draw_activation_curve])
def test_load_figures_pixels_follow_the_loads(tmp_path, draw):
    balanced = {"layer1/vision": torch.tensor([10, 10, 10, 10]), "layer1/language": torch.tensor([5, 5, 5, 5])}
    skewed = {"layer1/vision": torch.tensor([37, 1, 1, 1]), "layer1/language": torch.tensor([5, 5, 5, 5])}
    a = draw(balanced, tmp_path / "a.png")
    b = draw(skewed, tmp_path / "b.png")
    again = draw(dict(balanced), tmp_path / "again.png")
    assert differ(a, b)
    assert not differ(a, again)


def shown(figure) -> list[np.ndarray]:
    """The arrays a figure's axes show with ``imshow`` (its colour bar has none)."""
    return [image.get_array() for ax in figure.axes for image in ax.get_images()]


def saved_colours(figure, ax, path, points) -> np.ndarray:
    """The colours of the PNG ``figure`` was saved to at ``points`` (x, y) in ``ax``'s data coordinates."""
    saved = pixels(path)
    at = ax.transData.transform(np.asarray(points, dtype=float)) / [figure.bbox.width, figure.bbox.height]
    columns = np.floor(at[:, 0] * saved.shape[1]).astype(int)
    rows = np.floor((1 - at[:, 1]) * saved.shape[0]).astype(int)
    return saved[rows, columns]


def test_the_heatmap_figure_shows_the_renderer_s_pixels(tmp_path):
    loads = {
        "layer1/vision": torch.tensor([37, 1, 1, 1]),
        "layer1/language": torch.tensor([5, 5, 5, 5]),
        "layer3/vision": torch.tensor([10, 20, 0, 10]),
    }
    figure = activation_heatmap_figure(loads, tokens={key: 40.0 for key in loads})
    panels = heatmap_panels(loads, sort_keys(loads))
    assert len(shown(figure)) == len(panels) == 2
    for array, panel in zip(shown(figure), panels, strict=True):
        assert np.array_equal(array, panel.pixels)
    path = save_figure(figure, tmp_path / "heatmap.png")
    for ax, panel in zip((ax for ax in figure.axes if ax.get_images()), panels, strict=True):
        rows, experts = panel.cells
        cells = [(e, r) for r in range(rows) for e in range(experts)]
        points = [(e + 0.3, r + 0.3) for e, r in cells]  # beside the centre, where a × may be drawn
        colours = panel.pixels[:: panel.cell, :: panel.cell].reshape(-1, 3)  # a pixel of each cell, row by row
        assert np.array_equal(saved_colours(figure, ax, path, points), colours)


@pytest.mark.parametrize("overlay", [True, False])
def test_the_patch_grid_figure_shows_the_renderer_s_pixels(tmp_path, overlay):
    images = [np.full((32, 32, 3), level, dtype=np.uint8) for level in (40, 200)]
    columns = {"layer 0": np.array([[[1, 2], [3, 4]], [[4, 4], [0, 1]]]), "layer 1": np.ones((2, 4, 4), dtype=int)}
    figure = patch_grid_figure(images, columns, 4, "diversity", overlay=overlay, row_labels=["a.png", "b.png"])
    (array,) = shown(figure)
    assert np.array_equal(array, diversity_grid(images, columns, 4, overlay))
    path = save_figure(figure, tmp_path / "grid.png")
    points = [(x, y) for y in (8, 24, 42, 58) for x in (8, 24, 42, 58, 76, 92)]  # inside the 16-pixel cells
    assert np.array_equal(
        saved_colours(figure, figure.axes[0], path, points), array[[y for _, y in points], [x for x, _ in points]]
    )


# -- commands ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("routing_inputs")
    paths = {
        "a": make_checkpoint(root / "a" / "model.pt", seed=0),
        "b": make_checkpoint(root / "b" / "model.pt", seed=1),
        "dense": make_checkpoint(root / "dense.pt", moe=None),
        "images": image_dir(root / "images"),
        "shard": shard(root / "shards" / "data-000000.tar", count=12),
    }
    return paths


def run(argv, capsys) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_viz_subtoken_map_pixels_differ_between_checkpoints(inputs, tmp_path, capsys):
    written = {}
    for name in ("a", "b", "a"):
        out = tmp_path / f"{name}{len(written)}"
        code, stdout, _ = run(
            ["viz", "subtoken-map", "--ckpt", str(inputs[name]), "--images", str(inputs["images"]), "--out", str(out)],
            capsys,
        )
        assert code == 0
        written[name if name not in written else "a_again"] = out
        assert {p.name for p in out.iterdir()} == {"subtoken_map_model.png", "subtoken_overlay_model.png"}
        assert len(json.loads(stdout)["written"]) == 2
    for figure in ("subtoken_map_model.png", "subtoken_overlay_model.png"):
        # Same label and title in each run: the pixels differ only through the routing.
        assert differ(written["a"] / figure, written["b"] / figure)
        assert not differ(written["a"] / figure, written["a_again"] / figure)


def test_viz_subtoken_map_compares_checkpoints_and_draws_text(inputs, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["viz", "subtoken-map", "--ckpt", str(inputs["a"]), "--ckpt", str(inputs["b"])]
    code, stdout, err = run(argv + ["--images", str(inputs["shard"]), "--out", str(out), "--num-images", "2"], capsys)
    assert code == 0, err
    names = {p.name for p in out.iterdir()}
    assert {"subtoken_map_a-model.png", "subtoken_map_b-model.png"} <= names
    assert {"subtoken_compare_layer0_vision.png", "subtoken_compare_layer1_vision.png"} <= names
    assert {"subtoken_text_a-model.png", "subtoken_text_b-model.png", "subtoken_text_compare.png"} <= names
    assert sorted(json.loads(stdout)["written"]) == sorted(str(out / name) for name in names)
    with Image.open(out / "subtoken_map_a-model.png") as image:
        assert image.height > 200  # two image rows


def test_viz_heatmap_from_checkpoint_and_from_saved_stats(inputs, tmp_path, capsys):
    out = tmp_path / "ckpt"
    argv = ["viz", "heatmap", "--ckpt", str(inputs["a"]), "--data", str(inputs["shard"]), "--out", str(out)]
    code, _, err = run(argv + ["--batches", "2", "--batch-size", "4"], capsys)
    assert code == 0, err
    assert {p.name for p in out.iterdir()} == {"heatmap_model.png", "loads_model.png", "activation_curve_model.png"}
    drawn = {}
    for name, loads in (("balanced", [25, 25, 25, 25]), ("dead", [97, 1, 1, 1])):
        stats = tmp_path / name / "run.json"
        stats.parent.mkdir()
        payload = {"format": STATS_FORMAT, "num_experts": {"layer1/vision": 4}, "total_loads": {"layer1/vision": loads}}
        stats.write_text(json.dumps(payload | {"windows": []}))
        code, _, err = run(["viz", "heatmap", "--stats", str(stats), "--out", str(tmp_path / name / "png")], capsys)
        assert code == 0, err
        drawn[name] = tmp_path / name / "png"
    for figure in ("heatmap_run.png", "loads_run.png", "activation_curve_run.png"):
        assert differ(drawn["balanced"] / figure, drawn["dead"] / figure)


def test_analyze_routing_json(inputs, capsys):
    base = ["analyze", "routing", "--ckpt", str(inputs["a"]), "--data", str(inputs["shard"])]
    base += ["--batches", "2", "--batch-size", "4"]
    code, stdout, err = run(
        base + ["--compare", str(inputs["a"]), "--runs", str(inputs["a"]), str(inputs["a"])], capsys
    )
    assert code == 0, err
    report = json.loads(stdout)
    keys = ["layer0/vision", "layer0/language", "layer1/vision", "layer1/language"]
    for field in ("activation_ratio", "representation_collapse", "requested_capacity"):
        assert list(report[field]) == keys
    assert all(0 <= v <= 1 for v in report["activation_ratio"].values())
    assert all(v is None or v > 0 for v in report["representation_collapse"].values())
    assert all(v == 1.0 for v in report["requested_capacity"].values())
    assert report["fluctuation"]["overall"] == 0.0  # the same checkpoint routes the same inputs identically
    assert report["inter_run_consistency"]["mean"] == pytest.approx(1.0)

    code, stdout, err = run(
        base + ["--compare", str(inputs["b"]), "--runs", str(inputs["a"]), str(inputs["b"])], capsys
    )
    assert code == 0, err
    report = json.loads(stdout)
    assert 0 < report["fluctuation"]["overall"] <= 1
    assert all(0 < report["fluctuation"][key] <= 1 for key in keys)
    assert report["inter_run_consistency"]["mean"] < 1.0
    assert "fluctuation" not in json.loads(run(base, capsys)[1])


def _stats_file(path, windows):
    """A routing-statistics file of ``windows`` = [(step, {key: loads})]: as RoutingStatsCallback writes it."""
    totals = {key: np.sum([loads[key] for _, loads in windows], axis=0).tolist() for key in windows[0][1]}
    payload = {
        "format": STATS_FORMAT,
        "num_experts": {key: len(loads) for key, loads in windows[0][1].items()},
        "total_loads": totals,
        "windows": [{"step": step, "loads": loads} for step, loads in windows],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload))
    return str(path)


def test_analyze_consistency_through_fine_tuning_is_ic_window_by_window(tmp_path, capsys):
    """X-MoE §4.5 / Fig. 3b: each window's IC is the Pearson mean over the runs' loads of that window."""
    rng = np.random.default_rng(0)
    keys = ("layer1/vision", "layer1/language")
    runs = [[(step, {key: rng.integers(1, 50, 4).tolist() for key in keys}) for step in (10, 20, 30)] for _ in range(3)]
    paths = [_stats_file(tmp_path / f"seed{i}" / "routing_stats.json", windows) for i, windows in enumerate(runs)]
    plot = tmp_path / "ic.png"
    code, stdout, err = run(["analyze", "consistency", "--stats", *paths, "--plot", str(plot)], capsys)
    assert code == 0, err
    report = json.loads(stdout)
    assert report["steps"] == [10, 20, 30] and report["plot"] == str(plot) and plot.stat().st_size > 0
    for position, window in enumerate(report["windows"]):
        for key in keys:
            expected = inter_run_consistency([run[position][1][key] for run in runs])
            assert window[key] == pytest.approx(expected)
        assert window["mean"] == pytest.approx(np.mean([window[key] for key in keys]))
    # a run whose loads follow another's exactly is fully consistent with it
    copy = _stats_file(tmp_path / "copy.json", [(s, {k: [2 * n for n in v] for k, v in w.items()}) for s, w in runs[0]])
    code, stdout, err = run(["analyze", "consistency", "--stats", paths[0], copy], capsys)
    assert code == 0, err
    assert all(window["mean"] == pytest.approx(1.0) for window in json.loads(stdout)["windows"])


def test_analyze_consistency_refuses_runs_logged_at_other_steps(tmp_path, capsys):
    loads = {"layer1/vision": [1, 2, 3, 4]}
    a = _stats_file(tmp_path / "a.json", [(10, loads), (20, loads)])
    b = _stats_file(tmp_path / "b.json", [(10, loads), (25, loads)])
    code, stdout, err = run(["analyze", "consistency", "--stats", a, b], capsys)
    assert code == 2 and stdout == "" and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert "window 2" in err and "step 20" in err and "step 25" in err and "every_n_steps" in err
    with pytest.raises(SystemExit) as exit_info:
        main(["analyze", "consistency", "--stats", a])
    assert exit_info.value.code == 2


# -- bad input -----------------------------------------------------------------------------------------------------


def _bad_cases(inputs, tmp_path):
    (tmp_path / "broken.png").write_bytes(b"not a png")
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "bad.tar").write_bytes(b"not a tar archive at all" * 40)
    images = str(inputs["images"])
    viz = ["viz", "subtoken-map", "--out", str(tmp_path / "out")]
    analyze = ["analyze", "routing", "--batches", "1"]
    return {
        "missing checkpoint": (viz + ["--ckpt", str(tmp_path / "missing.pt"), "--images", images], "missing.pt"),
        "no MoE layers": (viz + ["--ckpt", str(inputs["dense"]), "--images", images], "no MoE layers"),
        "unreadable image": (
            viz + ["--ckpt", str(inputs["a"]), "--images", str(tmp_path / "broken.png")],
            "broken.png",
        ),
        "wrong image size": (viz + ["--ckpt", str(inputs["a"]), "--images", images, "--image-size", "64"], "64"),
        "missing images": (viz + ["--ckpt", str(inputs["a"]), "--images", str(tmp_path / "nowhere")], "nowhere"),
        "empty directory": (viz + ["--ckpt", str(inputs["a"]), "--images", str(tmp_path / "empty")], "empty"),
        "not an image": (viz + ["--ckpt", str(inputs["a"]), "--images", str(tmp_path / "notes.txt")], "notes.txt"),
        "bad shard": (analyze + ["--ckpt", str(inputs["a"]), "--data", str(tmp_path / "bad.tar")], "bad.tar"),
        "dense analyze": (analyze + ["--ckpt", str(inputs["dense"]), "--data", images], "dense.pt"),
        "bad stats": (["viz", "heatmap", "--stats", str(tmp_path / "notes.txt"), "--out", "x"], "notes.txt"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "missing checkpoint",
        "no MoE layers",
        "unreadable image",
        "wrong image size",
        "missing images",
        "empty directory",
        "not an image",
        "bad shard",
        "dense analyze",
        "bad stats",
    ],
)
def test_bad_input_is_one_clear_line_and_exit_code_2(inputs, tmp_path, capsys, case):
    argv, named = _bad_cases(inputs, tmp_path)[case]
    code, stdout, err = run(argv, capsys)
    assert code == 2
    assert named in err
    assert "Traceback" not in err and stdout == ""
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_bad_arguments_exit_2(inputs, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["analyze", "routing", "--ckpt", str(inputs["a"]), "--data", "x", "--runs", str(inputs["a"])])
    assert exit_info.value.code == 2
    assert "--runs needs at least 2" in capsys.readouterr().err


def test_subtoken_map_keeps_going_without_text_tokenizer_vocabulary(inputs, tmp_path, capsys):
    small_vocab = make_checkpoint(tmp_path / "small.pt", vocab_size=100)
    out = tmp_path / "out"
    argv = ["viz", "subtoken-map", "--ckpt", str(small_vocab), "--images", str(inputs["shard"]), "--out", str(out)]
    code, _, err = run(argv, capsys)
    assert code == 0
    assert "a 100-row text embedding, the text tokenizer open_clip 49410 ids" in err
    assert not any(p.name.startswith("subtoken_text") for p in out.iterdir())
    shutil.rmtree(out)


def test_subtoken_map_reads_texts_with_the_checkpoints_sentencepiece_tokenizer(inputs, tmp_path, capsys):
    spm = tiny_sentencepiece(tmp_path / "tiny.spm")
    beit3_vocab = make_checkpoint(tmp_path / "beit3.pt", vocab_size=40 + 2 + 8)  # beit3.spm's ids + 8 unused rows
    out = tmp_path / "out"
    argv = ["viz", "subtoken-map", "--ckpt", str(beit3_vocab), "--images", str(inputs["shard"]), "--out", str(out)]
    code, _, err = run([*argv, "--text-tokenizer", spm], capsys)
    assert code == 0, err
    assert any(p.name.startswith("subtoken_text") for p in out.iterdir()) and "texts skipped" not in err
    code, _, err = run([*argv, "--text-tokenizer", str(tmp_path / "missing.spm")], capsys)
    assert code == 2 and "--text-tokenizer: text tokenizer" in err and "missing.spm does not exist" in err
    shutil.rmtree(out)


def test_a_16_bit_png_is_shown_scaled_not_white(tmp_path):
    """A 16-bit greyscale PNG (Pillow mode ``I;16``/``I``) keeps its tones in the figures' input images."""
    from mmoe.viz.inputs import Sample, load_image

    ramp = np.tile(np.linspace(0, 65535, 32).astype(np.uint16), (32, 1))
    Image.fromarray(ramp).save(tmp_path / "ramp.png")
    pixels = load_image(Sample("ramp", image=tmp_path / "ramp.png", text=None), 32)
    assert pixels[0, 0, 0] < 5 and pixels[0, -1, 0] > 250
    assert np.abs(pixels[0, :, 0].astype(int) - ramp[0] / 257).max() <= 2
