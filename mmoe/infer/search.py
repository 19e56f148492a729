"""``mmoe infer retrieve``: search with a retrieval checkpoint (the dual encoder of
:class:`mmoe.tasks.retrieval.RetrievalFineTuning`).

* ``--images DIR --text "..."``: the ``--top-k`` images of the folder closest to the text (cosine similarity of the
  two embeddings). The folder is embedded once: each image's embedding is cached under ``--cache`` in a file of the
  checkpoint (its path, size and modification time), keyed by a BLAKE2b digest of the image file's bytes, so a later
  search with the same checkpoint embeds only new or changed images (an image edited in place that keeps its size and
  modification time included; a renamed or copied image is found under its content). Every image file is read to
  digest it, 1 MiB at a time; a file over 1 GiB is skipped as unreadable. A cache entry that is not a finite float32
  embedding of the checkpoint's width (a cache of another checkpoint's, or edited) is embedded again, said once on
  stderr. Unreadable images are skipped and counted.
* ``--image X --texts FILE``: the ``--top-k`` lines of the text file closest to the image.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

import torch

from mmoe.atomic import atomic_write, write_json_atomic
from mmoe.infer.images import ImageFileError, folder_images
from mmoe.infer.load import FineTuned, InferError
from mmoe.infer.results import ImageMatches, TextMatches
from mmoe.io import check_output_path, writing_output
from mmoe.safe_load import load_checkpoint_file

#: What a cache file says it is.
CACHE_FORMAT = "mmoe-retrieval-embeddings"
#: Images and texts embedded per forward pass.
EMBED_BATCH = 16
#: Bytes of an image file read at once to digest it.
DIGEST_CHUNK = 1 << 20
#: The largest image file read (larger than any image Pillow decodes, 2 x its 89 M-pixel bomb limit in 24-bit RGB).
MAX_IMAGE_BYTES = 1 << 30


def is_search(args: argparse.Namespace) -> bool:
    """Whether the options ask for a search (``--images`` or ``--texts``)."""
    return bool(getattr(args, "images", None) or getattr(args, "texts", None))


def search_problem(args: argparse.Namespace) -> str:
    """What is wrong with a search's options ('' when nothing)."""
    if args.routing:
        return "--routing works on a single input, not on a search (--images / --texts)"
    if args.images:
        if args.texts:
            return "--images ranks images against one --text; --texts goes with --image (one image)"
        if not args.text:
            return f"--images {args.images} needs --text (the query)"
        if not Path(args.images).is_dir():
            return f"--images {args.images} is not a folder"
        return ""
    if not args.image:
        return f"--texts {args.texts} needs --image (the query)"
    if args.text:
        return "--texts ranks the lines of a file against --image; give --text or --texts, not both"
    if Path(args.image).is_dir():
        return f"--image {args.image} is a folder: --texts ranks texts against one image"
    return ""


def default_cache() -> Path:
    """``$XDG_CACHE_HOME/mmoe/retrieval`` (``~/.cache`` without it)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mmoe" / "retrieval"


def file_stamp(path: Path) -> str:
    """A file's resolved path, size and modification time: what says a checkpoint file is unchanged."""
    stat = path.stat()
    return f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"


def cache_file(cache: Path, checkpoint: Path) -> Path:
    """The cache file of a checkpoint (a file, or an exported folder: each of its files)."""
    files = sorted(p for p in checkpoint.rglob("*") if p.is_file()) if checkpoint.is_dir() else [checkpoint]
    key = hashlib.sha256("\n".join(file_stamp(p) for p in files).encode()).hexdigest()[:32]
    return cache / f"{key}.pt"


def content_key(path: Path) -> str:
    """The cache key of an image file: the BLAKE2b digest of its bytes, read :data:`DIGEST_CHUNK` at a time, so that
    any change of its content shows, whatever its size and modification time.

    Raises:
        InferError: the file cannot be read, or holds more than :data:`MAX_IMAGE_BYTES`.
    """
    digest, size = hashlib.blake2b(digest_size=16), 0
    try:
        with path.open("rb") as file:
            while chunk := file.read(DIGEST_CHUNK):
                digest.update(chunk)
                size += len(chunk)
                if size > MAX_IMAGE_BYTES:
                    raise InferError(f"image {path} holds more than {MAX_IMAGE_BYTES >> 20} MiB: not read further")
    except FileNotFoundError:
        raise InferError(f"image {path} does not exist") from None
    except OSError as error:
        raise InferError(f"image {path} could not be read: {error.strerror or error}") from None
    return f"blake2b:{digest.hexdigest()}"


def is_embedding(key: object, value: object, width: int) -> bool:
    """Whether a cache entry can be used: a content key (:func:`content_key`) and a finite float32 vector of the
    checkpoint's embedding ``width``."""
    return (
        isinstance(key, str)
        and key.startswith("blake2b:")
        and isinstance(value, torch.Tensor)
        and value.dtype == torch.float32
        and value.shape == (width,)
        and bool(torch.isfinite(value).all())
    )


def usable_entries(entries: dict, width: int, path: Path) -> tuple[dict[str, torch.Tensor], int]:
    """The entries of a cache file that :func:`is_embedding` accepts, and how many it did not (said on stderr)."""
    usable = {key: value for key, value in entries.items() if is_embedding(key, value, width)}
    dropped = len(entries) - len(usable)
    if dropped:
        print(
            f"mmoe infer: cache {path}: {dropped} unusable entries ignored, rebuilt (an entry must be a finite float32 "
            f"embedding of this checkpoint's width, {width}, under an image's content digest)",
            file=sys.stderr,
        )
    return usable, dropped


def read_cache(path: Path) -> dict:
    """Image key -> embedding from a cache file, not yet checked (:func:`usable_entries`); empty when the file is
    absent or unreadable (said on stderr)."""
    if not path.exists():
        return {}
    try:
        content = load_checkpoint_file(path, "retrieval cache")
    except (OSError, ValueError) as error:
        print(f"mmoe infer: cache ignored, rebuilt: {error}", file=sys.stderr)
        return {}
    if content.get("format") != CACHE_FORMAT or not isinstance(content.get("embeddings"), dict):
        print(f"mmoe infer: cache {path} is not an mmoe retrieval cache: ignored, rebuilt", file=sys.stderr)
        return {}
    return content["embeddings"]


@torch.no_grad()
def embed_images(model: FineTuned, images: list[torch.Tensor]) -> torch.Tensor:
    """(N, D) embeddings of (3, S, S) images, on the CPU."""
    parts = [
        model.task.embed_images(torch.stack(images[start : start + EMBED_BATCH]).to(model.device))[0].float().cpu()
        for start in range(0, len(images), EMBED_BATCH)
    ]
    return torch.cat(parts)


@torch.no_grad()
def embed_texts(model: FineTuned, texts: list[str]) -> torch.Tensor:
    """(N, D) embeddings of texts, on the CPU."""
    parts = []
    for start in range(0, len(texts), EMBED_BATCH):
        ids, padding = model.tokenizer.pad(
            [model.tokenizer.encode(text) for text in texts[start : start + EMBED_BATCH]]
        )
        embedded, _ = model.task.embed_texts(ids.to(model.device), padding.to(model.device))
        parts.append(embedded.float().cpu())
    return torch.cat(parts)


def embedded_folder(
    model: FineTuned, folder: Path, cache: Path, checkpoint: Path, width: int
) -> tuple[list[Path], torch.Tensor, dict]:
    """The readable images of ``folder``, their (N, ``width``) embeddings, and counts: ``embedded`` now, ``cached``,
    and ``unreadable_skipped``. New embeddings are added to the checkpoint's cache file (written whole)."""
    from tqdm import tqdm

    try:
        paths = folder_images(folder)
    except ImageFileError as error:
        raise InferError(str(error).replace("--image ", "--images ", 1)) from None
    store = cache_file(cache, checkpoint)
    check_output_path(store, "--cache")
    known, dropped = usable_entries(read_cache(store), width, store)
    keys, unreadable = image_keys(paths)
    fresh_paths, fresh_images = [], []
    for path in tqdm(
        [p for p in keys if keys[p] not in known], desc="mmoe infer: embedding", unit="image", file=sys.stderr
    ):
        try:
            fresh_images.append(model.image(path))
        except InferError as error:
            unreadable += 1
            print(f"mmoe infer: skipped: {error}", file=sys.stderr)
            continue
        fresh_paths.append(path)
    if fresh_images:
        for path, embedding in zip(fresh_paths, embed_images(model, fresh_images), strict=True):
            known[keys[path]] = embedding.clone()
    if fresh_images or dropped:
        with writing_output(store, "--cache"):
            atomic_write(store, lambda temporary: torch.save({"format": CACHE_FORMAT, "embeddings": known}, temporary))
    readable = [path for path in keys if keys[path] in known]
    if not readable:
        raise InferError(f"--images {folder}: no image could be read")
    counts = {
        "embedded": len(fresh_paths),
        "cached": len(readable) - len(fresh_paths),
        "unreadable_skipped": unreadable,
    }
    return readable, torch.stack([known[keys[path]] for path in readable]), counts


def image_keys(paths: list[Path]) -> tuple[dict[Path, str], int]:
    """The cache key (:func:`content_key`) of each readable file of ``paths``, in order, and how many could not be
    read (each named on stderr)."""
    keys, unreadable = {}, 0
    for path in paths:
        try:
            keys[path] = content_key(path)
        except InferError as error:
            unreadable += 1
            print(f"mmoe infer: skipped: {error}", file=sys.stderr)
    return keys, unreadable


def text_lines(path: str) -> list[str]:
    """The non-empty lines of the ``--texts`` file."""
    try:
        lines = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines()]
    except FileNotFoundError:
        raise InferError(f"--texts {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise InferError(f"--texts {path} cannot be read as UTF-8 text: {error}") from None
    texts = [line for line in lines if line]
    if not texts:
        raise InferError(f"--texts {path} holds no text (one per line)")
    return texts


def top(scores: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """(index, score) of the ``k`` best scores, best first."""
    best = scores.topk(min(k, len(scores)))
    return [(int(i), round(float(s), 6)) for s, i in zip(best.values, best.indices, strict=True)]


def run_search(model: FineTuned, args: argparse.Namespace) -> ImageMatches | TextMatches:
    """The search the options ask for (see the module docstring); the result also goes to ``--out`` when given."""
    if args.images:
        folder = Path(args.images)
        cache = Path(args.cache) if args.cache else default_cache()
        text_D = embed_texts(model, [args.text])[0]
        paths, images_ND, counts = embedded_folder(model, folder, cache, Path(args.ckpt), len(text_D))
        matches = [
            {"file": paths[i].relative_to(folder).as_posix(), "score": score}
            for i, score in top(images_ND @ text_D, args.top_k)
        ]
        result: ImageMatches | TextMatches = ImageMatches(args.text, matches, len(paths), **counts)
    else:
        texts = text_lines(args.texts)
        image = model.image(args.image)
        image_D = embed_images(model, [image])[0]
        matches = [
            {"text": texts[i], "score": score} for i, score in top(embed_texts(model, texts) @ image_D, args.top_k)
        ]
        result = TextMatches(str(args.image), matches, len(texts))
    if args.out is not None:
        with writing_output(args.out):
            write_json_atomic(args.out, result.record())
    return result
