"""``mmoe infer retrieve``: a folder's top-k images for a text and a text file's top-k lines for an image, scored as
the task embeds them; the folder embedded once (a cache per checkpoint, keyed by each image's content; unusable
entries embedded again), unreadable images skipped and counted; a shard split's embeddings scored by ``mmoe eval
retrieval``; bad input one line, exit 2."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from PIL import Image

from mmoe.infer.load import load_fine_tuned
from mmoe.model import MoEPlan, MultiwayConfig
from mmoe.tasks.catalog import class_path
from mmoe.tasks.retrieval import RetrievalFineTuning
from tests.cli_fixtures import run_mmoe

TEXTS = ["a red square", "two blue circles", "a green triangle at the top", "nothing at all"]


def save_checkpoint(path: Path, seed: int) -> Path:
    """A retrieval task saved as `mmoe fit` saves it (hyper-parameters and weights), with random weights."""
    torch.manual_seed(seed)
    task = RetrievalFineTuning(backbone=MultiwayConfig.preset("test", moe=MoEPlan(num_experts=4, every=2)))
    hyper_parameters = dict(task.hparams) | {"_class_path": class_path(RetrievalFineTuning)}
    torch.save({"hyper_parameters": hyper_parameters, "state_dict": task.state_dict()}, path)
    return path


@pytest.fixture()
def files(tmp_path):
    folder = tmp_path / "photos"
    (folder / "sub").mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    for index in range(6):
        pixels = (torch.rand(40 + 3 * index, 36, 3, generator=generator) * 255).to(torch.uint8).numpy()
        Image.fromarray(pixels).save(folder / f"{index}.{'png' if index % 2 else 'jpg'}")
    (folder / "broken.jpg").write_bytes(b"not an image")
    (folder / "binary.dat").write_bytes(bytes([0xFF, 0xFE, 0xFA]))
    (tmp_path / "texts.txt").write_text("\n".join(TEXTS[:2]) + "\n\n" + "\n".join(TEXTS[2:]) + "\n")
    return {"checkpoint": save_checkpoint(tmp_path / "r.ckpt", 0), "folder": folder, "texts": tmp_path / "texts.txt"}


def infer(argv: list[str], capsys) -> tuple[int, dict | None, str]:
    code, out, err = run_mmoe(["infer", "retrieve", *argv, "--json"], capsys)
    return code, (json.loads(out) if code == 0 else None), err


def reference_scores(checkpoint: Path, images: list[Path], text: str) -> dict[str, float]:
    """Each image's cosine similarity with the text, one image at a time through the task."""
    model = load_fine_tuned(checkpoint, RetrievalFineTuning)
    with torch.no_grad():
        text_D = model.task.embed_texts(*model.text(text))[0][0]
        return {path.name: float(model.task.embed_images(model.image(path)[None])[0][0] @ text_D) for path in images}


def test_a_folder_is_ranked_against_a_text_and_embedded_once(files, tmp_path, capsys):
    argv = ["--ckpt", str(files["checkpoint"]), "--images", str(files["folder"]), "--text", TEXTS[0]]
    argv += ["--top-k", "4", "--cache", str(tmp_path / "cache")]
    code, result, err = infer(argv, capsys)
    assert code == 0, err
    assert (result["images"], result["embedded"], result["cached"], result["unreadable_skipped"]) == (6, 6, 0, 1)
    assert "broken.jpg" in err
    images = sorted(p for p in files["folder"].iterdir() if p.suffix in (".jpg", ".png") and p.name != "broken.jpg")
    want = sorted(reference_scores(files["checkpoint"], images, TEXTS[0]).items(), key=lambda item: -item[1])[:4]
    assert [match["file"] for match in result["matches"]] == [name for name, _ in want]
    for match, (_, score) in zip(result["matches"], want, strict=True):
        assert match["score"] == pytest.approx(score, abs=1e-5)
    # Again: nothing embedded, the same answer; a changed image is embedded again, alone.
    code, again, err = infer(argv, capsys)
    assert code == 0 and (again["embedded"], again["cached"]) == (0, 6) and again["matches"] == result["matches"]
    changed = files["folder"] / "3.png"
    Image.new("RGB", (30, 30), (200, 0, 0)).save(changed)
    os.utime(changed, ns=(1, 1))
    code, after, err = infer(argv, capsys)
    assert code == 0 and (after["embedded"], after["cached"]) == (1, 5)
    # Another checkpoint has its own cache file.
    other = save_checkpoint(tmp_path / "other.ckpt", 1)
    code, fresh, err = infer(["--ckpt", str(other), *argv[2:]], capsys)
    assert code == 0 and fresh["embedded"] == 6
    assert len(list((tmp_path / "cache").glob("*.pt"))) == 2


def test_a_text_file_is_ranked_against_an_image(files, tmp_path, capsys):
    image = files["folder"] / "2.jpg"
    argv = ["--ckpt", str(files["checkpoint"]), "--image", str(image), "--texts", str(files["texts"])]
    code, result, err = infer([*argv, "--top-k", "3", "--out", str(tmp_path / "out.json")], capsys)
    assert code == 0, err
    assert result["texts"] == 4 and len(result["matches"]) == 3
    scores = {text: reference_scores(files["checkpoint"], [image], text)["2.jpg"] for text in TEXTS}
    want = sorted(scores, key=lambda text: -scores[text])[:3]
    assert [match["text"] for match in result["matches"]] == want
    for match in result["matches"]:
        assert match["score"] == pytest.approx(scores[match["text"]], abs=1e-5)
    assert json.loads((tmp_path / "out.json").read_text()) == result
    code, out, err = run_mmoe(["infer", "retrieve", *argv], capsys)
    assert code == 0 and out.splitlines()[0].endswith(want[0])


def test_a_shard_split_gives_an_embeddings_file_mmoe_eval_scores(synthetic_corpus, files, tmp_path, capsys):
    split = synthetic_corpus / "shards" / "flickr30k-karpathy-test"
    out = tmp_path / "embeddings.pt"
    code, result, err = infer(["--ckpt", str(files["checkpoint"]), "--shards", str(split), "--out", str(out)], capsys)
    assert code == 0, err
    assert result["samples"] == 6 and result["corrupt_skipped"] == 0
    code, scores, err = run_mmoe(["eval", "retrieval", "--embeddings", str(out)], capsys)
    assert code == 0, err
    assert 0 <= json.loads(scores)["mean_recall"] <= 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--images", "{folder}/0.jpg", "--text", "x"], "is not a folder"),
        (["--images", "{folder}"], "needs --text"),
        (["--images", "{folder}", "--text", "x", "--texts", "{texts}"], "--texts goes with --image"),
        (["--image", "{folder}/0.jpg", "--texts", "{folder}/none.txt"], "--texts {folder}/none.txt: no such file"),
        (["--image", "{folder}/0.jpg", "--texts", "{texts}", "--text", "x"], "not both"),
        (["--image", "{folder}", "--texts", "{texts}"], "is a folder"),
        (["--image", "{folder}/0.jpg", "--texts", "{folder}/binary.dat"], "cannot be read as UTF-8"),
        (["--image", "{folder}/broken.jpg", "--texts", "{texts}"], "broken.jpg"),
        (["--images", "{folder}", "--text", "x", "--cache", "{texts}"], "--cache"),
        (["--images", "{folder}", "--text", "x", "--top-k", "0"], "--top-k"),
        (["--images", "{folder}/sub", "--text", "x"], "holds no image"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(files, capsys, argv, message):
    names = {"folder": files["folder"], "texts": files["texts"]}
    argv = [part.format(**names) for part in argv]
    if "--cache" not in argv:
        argv += ["--cache", str(files["folder"].parent / "cache")]
    code, _, err = infer(["--ckpt", str(files["checkpoint"]), *argv], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert lines[-1].startswith("mmoe infer: error: ") and message.format(**names) in lines[-1], err
    assert "Traceback" not in err


def search_argv(files: dict) -> list[str]:
    return ["--ckpt", str(files["checkpoint"]), "--images", str(files["folder"]), "--text", TEXTS[2], "--top-k", "7"]


def test_an_image_edited_in_place_with_its_size_and_time_kept_is_embedded_again(files, tmp_path, capsys):
    """A BMP of the same dimensions has the same size; tools that keep timestamps keep its modification time."""
    edited = files["folder"] / "edited.bmp"
    Image.new("RGB", (36, 40), (250, 250, 250)).save(edited)
    argv = [*search_argv(files), "--cache", str(tmp_path / "cache")]
    code, before, err = infer(argv, capsys)
    assert code == 0 and before["embedded"] == 7, err
    stat = edited.stat()
    Image.fromarray(torch.arange(36 * 40 * 3).remainder(251).to(torch.uint8).reshape(40, 36, 3).numpy()).save(edited)
    os.utime(edited, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (edited.stat().st_size, edited.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
    code, after, err = infer(argv, capsys)
    assert code == 0 and (after["embedded"], after["cached"]) == (1, 6), err
    score = {match["file"]: match["score"] for match in after["matches"]}["edited.bmp"]
    assert score == pytest.approx(reference_scores(files["checkpoint"], [edited], TEXTS[2])["edited.bmp"], abs=1e-5)


@pytest.mark.parametrize(
    "unusable",
    [
        torch.zeros(7),
        "a string",
        torch.full((32,), float("nan")),
        torch.zeros(32, dtype=torch.long),
        torch.zeros(1, 32),
    ],
)
def test_unusable_cache_entries_are_embedded_again_and_said_once(files, tmp_path, capsys, unusable):
    """Entries of a checkpoint of another width, or not embeddings at all, are as if absent."""
    argv = [*search_argv(files), "--cache", str(tmp_path / "cache")]
    code, first, err = infer(argv, capsys)
    assert code == 0, err
    (store,) = (tmp_path / "cache").glob("*.pt")
    content = torch.load(store, weights_only=True)
    keys = sorted(content["embeddings"])[:2]
    content["embeddings"] |= {key: unusable for key in keys}
    torch.save(content, store)
    code, again, err = infer(argv, capsys)
    assert code == 0, err
    assert (again["embedded"], again["cached"]) == (2, 4) and again["matches"] == first["matches"]
    said = [line for line in err.splitlines() if "unusable entries" in line]
    assert len(said) == 1 and said[0].startswith(f"mmoe infer: cache {store}: 2 unusable entries"), err
    code, third, err = infer(argv, capsys)
    assert code == 0 and (third["embedded"], third["cached"]) == (0, 6) and "unusable entries" not in err


def test_an_image_file_over_the_size_bound_is_skipped_unread(files, tmp_path, capsys, monkeypatch):
    from mmoe.infer import search

    sizes = {path.name: path.stat().st_size for path in files["folder"].glob("[0-9].*")}
    bound = sorted(sizes.values())[2]
    monkeypatch.setattr(search, "MAX_IMAGE_BYTES", bound)
    code, result, err = infer([*search_argv(files), "--cache", str(tmp_path / "cache")], capsys)
    over = sorted(name for name, size in sizes.items() if size > bound)
    assert code == 0 and result["images"] == 6 - len(over) and result["unreadable_skipped"] == 1 + len(over), err
    for name in over:
        assert f"{name} holds more than" in err
