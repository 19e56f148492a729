"""Image-text retrieval recall under the standard protocol (BEiT-3 ``average_score``; Karpathy COCO 5K / Flickr30K
1K test): every image has its captions; a caption's positive is its image, an image's positives are its captions.

* Text -> image: the rank of a caption's image among all images.
* Image -> text: the rank of the image's best-ranked caption among all captions.
* R@K: the fraction of queries whose rank is at most K, for K = 1, 5, 10; ``mean_recall`` is the mean of the six
  (BEiT-3's ``average_score``).

Ties count against the query: a negative scoring exactly as high as the (best) positive ranks above it, so a rank is
1 + the number of negatives scoring at least as high (constant embeddings score no R@1, never 100 %; duplicate
images tie with each other). The similarity matrix is never held whole: queries are scored ``chunk`` at a
time, so memory grows as ``chunk`` x the number of candidates. At 5K images x 25K captions of width 768 on the CPU
the ranking adds 124 MiB over the embeddings with ``chunk=256``, 337 MiB with 1024, 1,569 MiB for the whole matrix
(``benchmarks/retrieval.py --skip-embed``).

Shapes: N images, M captions, D embedding width, C queries in a chunk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mmoe.atomic import write_json_atomic
from mmoe.io import OutputPathError, check_output_path, writing_output
from mmoe.metrics.files import EvalInputError
from mmoe.safe_load import load_checkpoint_file

#: The ranks R@K is reported at.
RECALL_AT = (1, 5, 10)
#: Queries scored at once by default.
DEFAULT_CHUNK = 1024
#: An embeddings file (``mmoe predict`` with the retrieval task, a ``torch.save`` dict): ``image_ids`` (N,) long,
#: ``image_embeddings`` (N, D), ``caption_image_ids`` (M,) long, ``caption_embeddings`` (M, D), ``captions`` (M
#: strings).
EMBEDDING_FIELDS = ("image_ids", "image_embeddings", "caption_image_ids", "caption_embeddings", "captions")


def text_to_image_ranks(
    image_ND: torch.Tensor, caption_MD: torch.Tensor, caption_image_M: torch.Tensor, chunk: int = DEFAULT_CHUNK
) -> torch.Tensor:
    """(M,) long: each caption's 1-based rank of its image ``caption_image_M`` (an index into the images) among all
    images by dot product, ties counted against it."""
    ranks = []
    for start in range(0, caption_MD.shape[0], chunk):
        scores_CN = caption_MD[start : start + chunk] @ image_ND.T
        positive_C1 = scores_CN.gather(1, caption_image_M[start : start + chunk, None])
        ranks.append((scores_CN >= positive_C1).sum(1))  # the positive counts itself: 1 + negatives at least as high
    return torch.cat(ranks) if ranks else torch.zeros(0, dtype=torch.long)


def image_to_text_ranks(
    image_ND: torch.Tensor, caption_MD: torch.Tensor, caption_image_M: torch.Tensor, chunk: int = DEFAULT_CHUNK
) -> torch.Tensor:
    """(N,) long: each image's 1-based rank of its best-scoring caption among all captions by dot product, ties with
    other images' captions counted against it. Every image needs a caption."""
    counts = torch.bincount(caption_image_M, minlength=image_ND.shape[0])
    if bool((counts == 0).any()):
        missing = (counts == 0).nonzero().flatten()[:5].tolist()
        raise ValueError(f"images without a caption cannot be scored (image rows {missing})")
    ranks = []
    for start in range(0, image_ND.shape[0], chunk):
        scores_CM = image_ND[start : start + chunk] @ caption_MD.T
        count = scores_CM.shape[0]
        # The chunk's positives read from the same matrix as the negatives, so that equal scores compare equal.
        mine_P = ((caption_image_M >= start) & (caption_image_M < start + count)).nonzero().flatten()
        rows_P = caption_image_M[mine_P] - start
        positive_P = scores_CM[rows_P, mine_P]
        best_C = scores_CM.new_full((count,), float("-inf")).scatter_reduce(0, rows_P, positive_P, "amax")
        at_best_C = torch.zeros(count, dtype=torch.long, device=scores_CM.device)
        at_best_C.scatter_add_(0, rows_P, (positive_P >= best_C[rows_P]).long())
        ranks.append(1 + (scores_CM >= best_C[:, None]).sum(1) - at_best_C)  # less the positives at the best score
    return torch.cat(ranks) if ranks else torch.zeros(0, dtype=torch.long)


def recall_at(ranks: torch.Tensor, ks: tuple[int, ...] = RECALL_AT) -> dict[int, float]:
    """K -> the fraction of ``ranks`` at most K."""
    return {k: float((ranks <= k).double().mean()) if ranks.numel() else 0.0 for k in ks}


def retrieval_scores(image_ranks: torch.Tensor, caption_ranks: torch.Tensor) -> dict[str, float]:
    """``i2t_r1`` .. ``i2t_r10`` (image -> text), ``t2i_r1`` .. ``t2i_r10`` (text -> image) and ``mean_recall``, the
    mean of the six (BEiT-3 ``average_score``), as fractions."""
    scores = {f"i2t_r{k}": value for k, value in recall_at(image_ranks).items()}
    scores |= {f"t2i_r{k}": value for k, value in recall_at(caption_ranks).items()}
    scores["mean_recall"] = sum(scores.values()) / len(scores)
    return scores


def random_recall(captions_per_image: list[int], ks: tuple[int, ...] = RECALL_AT) -> dict[str, float]:
    """The expected :func:`retrieval_scores` of a random ranking (every order of the candidates equally likely) on a
    split whose image i has ``captions_per_image[i]`` captions: the chance levels of the recalls.

    Text -> image: a caption's one image among N ranks in the top K with probability min(K, N) / N. Image -> text: an
    image with k of the M captions misses the top K only if those K are all others', probability
    prod_{j<K} (M - k - j) / (M - j); at K = 1 the hit probability is k / M.
    """
    images, captions = len(captions_per_image), sum(captions_per_image)
    if images == 0 or min(captions_per_image) < 1:
        raise ValueError("a random ranking's recall needs images that each have a caption")

    def image_hit(k: int, top: int) -> float:
        miss = 1.0
        for j in range(min(top, captions)):
            miss *= max(captions - k - j, 0) / (captions - j)
        return 1 - miss

    scores = {f"i2t_r{top}": sum(image_hit(k, top) for k in captions_per_image) / images for top in ks}
    scores |= {f"t2i_r{top}": min(top, images) / images for top in ks}
    scores["mean_recall"] = sum(scores.values()) / len(scores)
    return scores


def deduplicated_images(
    image_ids: list[int], image_ND: torch.Tensor, caption_image_ids: list[int]
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """The distinct images (the first row of each id kept, as BEiT-3 de-duplicates by image id) and each caption's
    row among them: (ids, (N, D) embeddings, (M,) caption rows). A caption of an unknown image id is an error."""
    row_of: dict[int, int] = {}
    for index, image_id in enumerate(image_ids):
        row_of.setdefault(int(image_id), index)
    unknown = sorted({int(i) for i in caption_image_ids} - row_of.keys())
    if unknown:
        raise ValueError(f"captions of image ids {unknown[:5]} that no image has")
    keep = list(row_of.values())
    position = {image_id: place for place, image_id in enumerate(row_of)}
    caption_rows = torch.tensor([position[int(i)] for i in caption_image_ids], dtype=torch.long)
    return list(row_of), image_ND[keep], caption_rows


def require_finite_embeddings(embeddings: dict[str, Any]) -> None:
    """Raises ValueError naming the first embedding tensor (``image_embeddings``, ``caption_embeddings``) with NaN or
    Inf rows, how many of its rows and the first one. A NaN compares false with every score, so a NaN row would rank
    as if nothing scored above its positive: all-NaN image embeddings would give every caption R@1."""
    for name in ("image_embeddings", "caption_embeddings"):
        tensor = embeddings[name]
        bad_rows = ~torch.isfinite(tensor.reshape(len(tensor), -1)).all(1)
        if bool(bad_rows.any()):
            first = int(bad_rows.nonzero()[0, 0])
            raise ValueError(
                f"{name} has {int(bad_rows.sum())} of {len(tensor)} rows with NaN or Inf (first: row {first}): "
                "non-finite embeddings cannot be ranked"
            )


def score_embeddings(embeddings: dict[str, Any], chunk: int) -> tuple[dict[str, float], dict[str, list]]:
    """The recall scores of an embeddings file's content (:data:`EMBEDDING_FIELDS`) and each query's rank: ``images``
    ``[{"image_id", "rank"}]`` (image -> text) and ``captions`` ``[{"image_id", "caption", "rank"}]`` (text ->
    image). Non-finite embeddings are a ValueError (:func:`require_finite_embeddings`)."""
    require_finite_embeddings(embeddings)
    ids, image_ND, caption_rows = deduplicated_images(
        embeddings["image_ids"].tolist(), embeddings["image_embeddings"], embeddings["caption_image_ids"].tolist()
    )
    caption_MD = embeddings["caption_embeddings"]
    image_ranks = image_to_text_ranks(image_ND, caption_MD, caption_rows, chunk)
    caption_ranks = text_to_image_ranks(image_ND, caption_MD, caption_rows, chunk)
    ranks = {
        "images": [{"image_id": i, "rank": int(r)} for i, r in zip(ids, image_ranks.tolist(), strict=True)],
        "captions": [
            {"image_id": ids[row], "caption": caption, "rank": int(rank)}
            for row, caption, rank in zip(
                caption_rows.tolist(), embeddings["captions"], caption_ranks.tolist(), strict=True
            )
        ],
    }
    return retrieval_scores(image_ranks, caption_ranks), ranks


def evaluate_retrieval_file(
    embeddings: str | Path, results: str | Path | None = None, chunk: int = DEFAULT_CHUNK
) -> dict[str, float]:
    """``mmoe eval retrieval``: the recall scores of an embeddings file (:data:`EMBEDDING_FIELDS`), and, with
    ``results``, each query's rank written there as JSON (whole or absent).

    Raises:
        EvalInputError: an unreadable file, a missing field, mismatched sizes, embeddings that are not floating-point
            tensors or hold NaN or Inf, a caption of an unknown image or an image without a caption.
    """
    if results is not None:
        try:
            check_output_path(results, "--results")
        except (OSError, ValueError) as error:
            raise EvalInputError(str(error)) from None
    content = read_embeddings_file(embeddings)
    try:
        scores, ranks = score_embeddings(content, chunk)
    except ValueError as error:
        raise EvalInputError(f"{embeddings}: {error}") from None
    if results is not None:
        try:
            with writing_output(results, "--results"):
                write_json_atomic(results, ranks)
        except OutputPathError as error:
            raise EvalInputError(str(error)) from None
    return scores


def read_embeddings_file(embeddings: str | Path) -> dict[str, Any]:
    """The content of an embeddings file (:data:`EMBEDDING_FIELDS`), its fields and sizes checked.

    Raises:
        EvalInputError: an unreadable file, a missing field, embeddings that are not floating-point tensors or
            mismatched sizes.
    """
    try:
        content = load_checkpoint_file(embeddings, "embeddings file")
    except (OSError, ValueError) as error:
        raise EvalInputError(str(error)) from None
    missing = [name for name in EMBEDDING_FIELDS if name not in content]
    if missing:
        raise EvalInputError(f"{embeddings}: lacks {', '.join(missing)} (expected the file `mmoe predict` writes)")
    for name in ("image_embeddings", "caption_embeddings"):
        value = content[name]
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            kind = f"a {value.dtype} tensor" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"
            raise EvalInputError(f"{embeddings}: {name} is {kind}, not a floating-point tensor")
    images, captions = content["image_embeddings"], content["caption_embeddings"]
    sizes = (len(content["image_ids"]), len(images), len(content["caption_image_ids"]), len(captions))
    agree = sizes[0] == sizes[1] and sizes[2] == sizes[3] == len(content["captions"])
    if not agree or images.dim() != 2 or captions.dim() != 2 or images.shape[1] != captions.shape[1]:
        raise EvalInputError(
            f"{embeddings}: sizes disagree: {sizes[0]} image ids, image embeddings {tuple(images.shape)}, "
            f"{sizes[2]} caption image ids, caption embeddings {tuple(captions.shape)}, "
            f"{len(content['captions'])} captions"
        )
    return content
