"""Retrieval recall: the chunked ranks equal a brute-force per-query reference (ties and duplicate images included,
ties counted against the query), and ``mmoe eval retrieval`` scores an embeddings file and writes each query's rank
whole, bad files ending in one line and exit 2."""

from __future__ import annotations

import itertools
import json
import re

import pytest
import torch

from mmoe.metrics.cli import eval_command
from mmoe.metrics.retrieval import (
    deduplicated_images,
    evaluate_retrieval_file,
    image_to_text_ranks,
    random_recall,
    retrieval_scores,
    score_embeddings,
    text_to_image_ranks,
)


def brute_force_ranks(images: list, captions: list, caption_image: list) -> tuple[list[int], list[int]]:
    """Ranks by listing every candidate's score per query, ties counted against the query."""
    score = lambda a, b: sum(x * y for x, y in zip(a, b, strict=True))  # noqa: E731
    caption_ranks = []
    for j, caption in enumerate(captions):
        positive = score(images[caption_image[j]], caption)
        above = [i for i, image in enumerate(images) if i != caption_image[j] and score(image, caption) >= positive]
        caption_ranks.append(1 + len(above))
    image_ranks = []
    for i, image in enumerate(images):
        mine = [j for j in range(len(captions)) if caption_image[j] == i]
        best = max(score(image, captions[j]) for j in mine)
        above = [j for j in range(len(captions)) if j not in mine and score(image, captions[j]) >= best]
        image_ranks.append(1 + len(above))
    return image_ranks, caption_ranks


def brute_force_recall(ranks: list[int], k: int) -> float:
    return sum(rank <= k for rank in ranks) / len(ranks)


def hand_made() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Integer embeddings (exact dot products): image 3 duplicates image 0, caption 4 ties two images, image 2's
    captions tie another image's caption, a caption scores below a negative."""
    images = torch.tensor([[2, 0, 0], [0, 2, 0], [0, 0, 2], [2, 0, 0], [1, 1, 0]], dtype=torch.float64)
    captions = torch.tensor(
        [[1, 0, 0], [1, 0, 0], [0, 1, 0], [0, 1, 1], [1, 1, 0], [0, 0, 1], [0, 0, 1], [1, 0, 0], [1, 1, 1]],
        dtype=torch.float64,
    )
    caption_image = torch.tensor([0, 0, 1, 1, 4, 2, 2, 3, 4])
    return images, captions, caption_image


@pytest.mark.parametrize("chunk", [1, 2, 1024])
def test_hand_made_ranks_with_ties_and_duplicates_equal_the_brute_force_reference(chunk):
    images, captions, caption_image = hand_made()
    want_images, want_captions = brute_force_ranks(images.tolist(), captions.tolist(), caption_image.tolist())
    assert image_to_text_ranks(images, captions, caption_image, chunk).tolist() == want_images
    assert text_to_image_ranks(images, captions, caption_image, chunk).tolist() == want_captions
    # the duplicate images 0 and 3 tie: each of their captions ranks its image second, never first
    assert want_captions[0] == want_captions[1] == want_captions[7] == 2
    # caption 4 = (1, 1, 0) scores 2 with images 0, 1, 3 and 4 (its own): rank 4
    assert want_captions[4] == 4


def test_random_embeddings_with_duplicates_equal_the_brute_force_reference():
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(-3, 4, (40, 6), generator=generator).double()
    images[7] = images[3]  # a duplicate image
    caption_image = torch.arange(40).repeat_interleave(5)
    captions = images[caption_image] + torch.randint(-4, 5, (200, 6), generator=generator).double()
    captions[11] = captions[10]  # a duplicate caption
    want_images, want_captions = brute_force_ranks(images.tolist(), captions.tolist(), caption_image.tolist())
    got_images = image_to_text_ranks(images, captions, caption_image, chunk=7)
    got_captions = text_to_image_ranks(images, captions, caption_image, chunk=13)
    assert got_images.tolist() == want_images and got_captions.tolist() == want_captions
    scores = retrieval_scores(got_images, got_captions)
    for k in (1, 5, 10):
        assert scores[f"i2t_r{k}"] == pytest.approx(brute_force_recall(want_images, k))
        assert scores[f"t2i_r{k}"] == pytest.approx(brute_force_recall(want_captions, k))
    assert 0 < scores["t2i_r1"] < scores["t2i_r10"] < 1
    six = [scores[f"{way}_r{k}"] for way in ("i2t", "t2i") for k in (1, 5, 10)]
    assert scores["mean_recall"] == pytest.approx(sum(six) / 6)


def test_constant_embeddings_score_no_recall_at_1():
    images, captions = torch.ones(20, 4), torch.ones(100, 4)
    caption_image = torch.arange(20).repeat_interleave(5)
    scores = retrieval_scores(
        image_to_text_ranks(images, captions, caption_image), text_to_image_ranks(images, captions, caption_image)
    )
    assert scores["i2t_r1"] == scores["t2i_r1"] == scores["t2i_r10"] == 0.0


def test_images_are_deduplicated_by_id_and_every_image_needs_a_caption():
    ids, kept, rows = deduplicated_images([5, 9, 5], torch.eye(3), [9, 5, 5])
    assert ids == [5, 9] and kept.tolist() == [[1, 0, 0], [0, 1, 0]] and rows.tolist() == [1, 0, 0]
    with pytest.raises(ValueError, match="image ids \\[4\\]"):
        deduplicated_images([5], torch.eye(1), [4])
    with pytest.raises(ValueError, match="without a caption"):
        image_to_text_ranks(torch.eye(2), torch.eye(2)[:1], torch.tensor([0]))


def embeddings_file(path, images, captions, caption_image) -> None:
    torch.save(
        {
            "image_ids": torch.arange(len(images)) + 100,
            "image_embeddings": images.float(),
            "caption_image_ids": caption_image + 100,
            "caption_embeddings": captions.float(),
            "captions": [f"caption {j}" for j in range(len(captions))],
        },
        path,
    )


def test_mmoe_eval_retrieval_prints_the_scores_and_writes_each_querys_rank(tmp_path, capsys):
    images, captions, caption_image = hand_made()
    embeddings_file(tmp_path / "e.pt", images, captions, caption_image)
    results = tmp_path / "out" / "ranks.json"
    assert eval_command(["retrieval", "--embeddings", str(tmp_path / "e.pt"), "--results", str(results)]) == 0
    scores = json.loads(capsys.readouterr().out)
    want_images, want_captions = brute_force_ranks(images.tolist(), captions.tolist(), caption_image.tolist())
    assert scores["t2i_r1"] == pytest.approx(brute_force_recall(want_captions, 1))
    ranks = json.loads(results.read_text())
    assert [entry["rank"] for entry in ranks["images"]] == want_images
    assert [entry["image_id"] for entry in ranks["images"]] == [100, 101, 102, 103, 104]
    assert [entry["rank"] for entry in ranks["captions"]] == want_captions
    assert ranks["captions"][4] == {"image_id": 104, "caption": "caption 4", "rank": 4}
    assert evaluate_retrieval_file(tmp_path / "e.pt", chunk=2) == scores


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"image_ids": torch.arange(2)}, "lacks image_embeddings"),
        (
            {
                "image_ids": torch.arange(3),
                "image_embeddings": torch.eye(2),
                "caption_image_ids": torch.arange(2),
                "caption_embeddings": torch.eye(2),
                "captions": ["a", "b"],
            },
            "sizes disagree",
        ),
        (
            {
                "image_ids": torch.arange(2),
                "image_embeddings": torch.eye(2),
                "caption_image_ids": torch.tensor([0, 7]),
                "caption_embeddings": torch.eye(2),
                "captions": ["a", "b"],
            },
            "image ids \\[7\\]",
        ),
    ],
)
def test_a_bad_embeddings_file_is_one_line_and_exit_2(tmp_path, capsys, content, message):
    torch.save(content, tmp_path / "e.pt")
    results = tmp_path / "ranks.json"
    assert eval_command(["retrieval", "--embeddings", str(tmp_path / "e.pt"), "--results", str(results)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1
    assert captured.err.startswith("mmoe eval retrieval: error: ")
    assert re.search(message, captured.err)
    assert not results.exists()
    (tmp_path / "text.pt").write_text("not torch")
    assert eval_command(["retrieval", "--embeddings", str(tmp_path / "text.pt")]) == 2
    assert "could not be read" in capsys.readouterr().err


@pytest.mark.parametrize("captions_per_image", [[1, 2, 3], [2, 2, 1, 1], [5, 1]])
def test_random_recall_equals_the_mean_over_every_ranking(captions_per_image):
    """Every order of the captions (image -> text) and of the images (text -> image) scored by the brute-force
    reference: the mean recall over all of them is the random ranking's."""
    caption_image = [i for i, count in enumerate(captions_per_image) for _ in range(count)]
    images, captions = len(captions_per_image), len(caption_image)
    ks = (1, 2, 5)
    image_recalls, caption_recalls = {k: [] for k in ks}, {k: [] for k in ks}
    for order in itertools.permutations(range(captions)):  # caption j scores -order[j] against every image
        image_ranks, _ = brute_force_ranks([[1.0]] * images, [[-float(o)] for o in order], caption_image)
        for k in ks:
            image_recalls[k].append(brute_force_recall(image_ranks, k))
    for order in itertools.permutations(range(images)):  # image i scores -order[i] against every caption
        _, caption_ranks = brute_force_ranks([[-float(o)] for o in order], [[1.0]] * captions, caption_image)
        for k in ks:
            caption_recalls[k].append(brute_force_recall(caption_ranks, k))
    chance = random_recall(captions_per_image, ks)
    for k in ks:
        assert chance[f"i2t_r{k}"] == pytest.approx(sum(image_recalls[k]) / len(image_recalls[k]))
        assert chance[f"t2i_r{k}"] == pytest.approx(sum(caption_recalls[k]) / len(caption_recalls[k]))
    assert chance["i2t_r1"] == pytest.approx(sum(captions_per_image) / images / captions)  # k / M per image
    assert chance["mean_recall"] == pytest.approx(sum(chance[f"{d}_r{k}"] for d in ("i2t", "t2i") for k in ks) / 6)


def test_random_recall_needs_a_caption_per_image():
    with pytest.raises(ValueError, match="each have a caption"):
        random_recall([2, 0])


def with_non_finite(tensor: torch.Tensor, rows: list[int], value: float) -> torch.Tensor:
    tensor = tensor.clone()
    tensor[rows, 0] = value
    return tensor


@pytest.mark.parametrize(
    ("field", "rows", "value", "message"),
    [
        ("images", [0, 1, 2, 3, 4], float("nan"), "image_embeddings has 5 of 5 rows with NaN or Inf (first: row 0)"),
        ("captions", [6, 2], float("inf"), "caption_embeddings has 2 of 9 rows with NaN or Inf (first: row 2)"),
    ],
)
def test_non_finite_embeddings_are_refused_naming_the_file_the_tensor_and_the_rows(
    tmp_path, capsys, field, rows, value, message
):
    images, captions, caption_image = hand_made()
    if field == "images":
        images = with_non_finite(images, rows, value)
    else:
        captions = with_non_finite(captions, rows, value)
    embeddings_file(tmp_path / "e.pt", images, captions, caption_image)
    assert eval_command(["retrieval", "--embeddings", str(tmp_path / "e.pt")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured.err
    assert captured.err.startswith(f"mmoe eval retrieval: error: {tmp_path / 'e.pt'}: {message}")


def test_the_in_training_scores_refuse_non_finite_embeddings():
    """What validation scores (``RetrievalFineTuning.on_validation_epoch_end``): the same refusal, not a recall."""
    images, captions, caption_image = hand_made()
    content = {
        "image_ids": torch.arange(5),
        "image_embeddings": with_non_finite(images, [3], float("nan")),
        "caption_image_ids": caption_image,
        "caption_embeddings": captions,
        "captions": [""] * 9,
    }
    with pytest.raises(ValueError, match=re.escape("image_embeddings has 1 of 5 rows with NaN or Inf (first: row 3)")):
        score_embeddings(content, 4)


def test_embeddings_that_are_not_tensors_are_one_line(tmp_path, capsys):
    images, captions, caption_image = hand_made()
    embeddings_file(tmp_path / "e.pt", images, captions, caption_image)
    content = torch.load(tmp_path / "e.pt")
    torch.save({**content, "caption_embeddings": captions.tolist()}, tmp_path / "e.pt")
    assert eval_command(["retrieval", "--embeddings", str(tmp_path / "e.pt")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "caption_embeddings is a list, not a floating-point tensor" in err
