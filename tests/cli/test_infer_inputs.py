"""``mmoe infer`` on awkward files: a photo stored sideways reads upright, an empty or non-image file is named for
what it is, files named alike get told apart in a folder's results, and a shard split that lost samples fails like
``mmoe predict``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from mmoe.data.shards import expected_samples, resolve_shards
from mmoe.data.transforms import decode_image, eval_transform
from mmoe.infer.images import read_user_image
from mmoe.model import MultiwayConfig
from mmoe.tasks.captioning import CaptioningFineTuning
from mmoe.tasks.catalog import class_path
from mmoe.tasks.vqa import VQAFineTuning
from tests.cli.test_predict_partial import truncated_copy
from tests.cli_fixtures import run_mmoe, small_shards

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

BACKBONE = MultiwayConfig.preset("test", depth=1)
#: EXIF's orientation tag; 6: the stored pixels are to be turned 90 degrees clockwise to display.
ORIENTATION = 0x0112


def save_checkpoint(task, path):
    """``task`` as ``mmoe fit`` would checkpoint it (its arguments and weights), untrained: inference reads these."""
    torch.save({"hyper_parameters": {**task.hparams, "_class_path": class_path(type(task))},
                "state_dict": task.state_dict()}, path)  # fmt: skip
    return str(path)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Shards of the synthetic corpus, and untrained VQA and captioning checkpoints of a one-layer test backbone."""
    root = tmp_path_factory.mktemp("infer_inputs")
    shards = small_shards(root, val_images=6)
    torch.manual_seed(0)
    vqa = VQAFineTuning(backbone=BACKBONE, answer_vocab=str(shards / "vqav2-train2014" / "answers.json"))
    caption = CaptioningFineTuning(backbone=BACKBONE, max_length=4, num_beams=1)
    return {"shards": shards, "vqa": save_checkpoint(vqa, root / "vqa.ckpt"),
            "caption": save_checkpoint(caption, root / "caption.ckpt")}  # fmt: skip


def photo(height: int = 48, width: int = 64) -> Image.Image:
    """An image that differs from each of its rotations: a gradient, a red block top left, a blue bar below."""
    pixels = np.zeros((height, width, 3), dtype=np.uint8)
    pixels[..., 1] = np.linspace(0, 255, width, dtype=np.uint8)[None, :]
    pixels[4:20, 4:24] = (230, 30, 30)
    pixels[height - 10 : height - 4, :] = (20, 40, 220)
    return Image.fromarray(pixels)


def test_a_photo_stored_sideways_with_exif_orientation_6_reads_as_its_upright_original(tmp_path):
    upright = photo()
    upright.save(tmp_path / "upright.jpg", quality=95)
    sideways = upright.transpose(Image.Transpose.ROTATE_90)  # stored turned left; orientation 6 turns it back
    exif = Image.Exif()
    exif[ORIENTATION] = 6
    sideways.save(tmp_path / "exif_rot6.jpg", quality=95, exif=exif)
    transform = eval_transform(32)
    original = transform(read_user_image(tmp_path / "upright.jpg", 32))
    turned = transform(read_user_image(tmp_path / "exif_rot6.jpg", 32))
    assert (original - turned).abs().mean() < 0.03
    as_stored = transform(decode_image((tmp_path / "exif_rot6.jpg").read_bytes(), 32))  # the tag ignored
    assert (original - as_stored).abs().mean() > 0.1


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"", "is empty (0 bytes)"), (b"a shopping list, not a photo\n", "is not an image (Pillow cannot identify it)")],
)
def test_an_empty_or_text_file_named_jpg_is_named_for_what_it_is(content, message, made, tmp_path, capsys):
    image = tmp_path / "holiday.jpg"
    image.write_bytes(content)
    code, out, err = run_mmoe(["infer", "vqa", "--ckpt", made["vqa"], "--image", str(image), "--question", "q"], capsys)
    assert (code, out) == (2, "")
    assert err == f"mmoe infer: error: image {image} {message}\n"


def test_files_named_alike_get_distinct_ids_in_file_order_and_every_entry_names_its_file(made, tmp_path, capsys):
    folder = tmp_path / "photos"
    folder.mkdir()
    for name in ("000001.jpg", "000001.png", "1.jpg"):
        photo().save(folder / name)
    out = tmp_path / "captions.json"
    code, _, err = run_mmoe(["infer", "caption", "--ckpt", made["caption"], "--image", str(folder), "--out", str(out)],
                            capsys)  # fmt: skip
    assert code == 0, err
    entries = json.loads(out.read_text())
    assert [(entry["file"], entry["image_id"]) for entry in entries] == [
        ("000001.jpg", 1), ("000001.png", 2), ("1.jpg", 3)
    ]  # fmt: skip
    assert (
        "mmoe infer: image ids 1 to 3 given in file order, since the file names are not distinct numbers (000001.jpg "
        'and 000001.png are both 1); each entry\'s "file" names its image'
    ) in err.splitlines()
    code, _, err = run_mmoe(["infer", "vqa", "--ckpt", made["vqa"], "--image", str(folder), "--question", "q", "--out",
                             str(tmp_path / "answers.json")], capsys)  # fmt: skip
    assert code == 0, err
    assert [entry["file"] for entry in json.loads((tmp_path / "answers.json").read_text())] == [
        "000001.jpg", "000001.png", "1.jpg"
    ]  # fmt: skip


def test_distinct_numbered_files_keep_their_ids_and_mmoe_eval_scores_the_results(made, tmp_path, capsys):
    folder = tmp_path / "coco"
    folder.mkdir()
    for image_id in (391895, 522418):
        photo().save(folder / f"{image_id:012d}.jpg")
    out = tmp_path / "captions.json"
    code, _, err = run_mmoe(["infer", "caption", "--ckpt", made["caption"], "--image", str(folder), "--out", str(out)],
                            capsys)  # fmt: skip
    assert code == 0, err
    assert "given in file order" not in err
    entries = json.loads(out.read_text())
    assert [(entry["file"], entry["image_id"]) for entry in entries] == [
        ("000000391895.jpg", 391895), ("000000522418.jpg", 522418)
    ]  # fmt: skip
    annotations = tmp_path / "captions_val.json"
    annotations.write_text(json.dumps({
        "images": [{"id": 391895}, {"id": 522418}],
        "annotations": [{"image_id": 391895, "caption": "a red square"}, {"image_id": 522418, "caption": "a bar"}],
    }))  # fmt: skip
    argv = ["eval", "caption", "--annotations", str(annotations), "--results", str(out), "--no-meteor", "--no-spice"]
    code, report, err = run_mmoe(argv, capsys)
    assert code == 0, err
    assert json.loads(report)["images_scored"] == 2


def test_a_shard_split_that_lost_samples_exits_2_naming_the_shortfall_and_writes_the_results(made, tmp_path, capsys):
    split = truncated_copy(made["shards"] / "vqav2-val2014", tmp_path / "split")
    out = tmp_path / "results.json"
    argv = ["infer", "vqa", "--ckpt", made["vqa"], "--shards", str(split), "--out", str(out)]
    code, summary, err = run_mmoe(argv, capsys)
    assert code == 2
    written = len(json.loads(out.read_text()))
    promised = sum(expected_samples(resolve_shards(split)).values())
    assert 0 < written < promised
    assert summary.startswith(f"{written} samples -> {out}")
    assert err.strip().splitlines()[-1] == (
        f"mmoe infer: error: results were written for {written} of the {promised} samples the manifests of --shards "
        f"{split} hold ({promised - written} missing: 0 corrupt, {promised - written} lost; see 'skipped' and 'lost' "
        "above) (pass --allow-partial-results to accept them)"
    )
    code, _, err = run_mmoe([*argv, "--allow-partial-results"], capsys)
    assert code == 0
    assert err.strip().splitlines()[-1].endswith("(accepted: --allow-partial-results)")
    code, _, err = run_mmoe(["infer", "vqa", "--ckpt", made["vqa"], "--shards", str(made["shards"] / "vqav2-val2014"),
                             "--out", str(tmp_path / "whole.json")], capsys)  # fmt: skip
    assert code == 0 and "results were written for" not in err
