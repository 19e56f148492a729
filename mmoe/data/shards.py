"""webdataset shards: writing them (atomically, byte-reproducibly), their manifest, and finding them again.

A sample is a dict with ``__key__`` and one entry per file extension: ``jpg`` / ``png`` (image bytes), ``txt`` (str),
``json`` (a JSON-serialisable dict), or any extension with bytes (NLVR2 samples hold ``left.png`` and ``right.png``).
Each sample becomes the tar members ``<key>.<extension>``, which webdataset groups back into one sample.

Shards are written as ``.<name>-000000.tar.tmp`` and renamed to ``<name>-000000.tar`` once closed, so a shard with
its final name is always complete; ``manifest.json`` is written last, the same way. The converters write a whole split
into a staging folder and swap it in at the end (:mod:`mmoe.data.converters.staging`), so a split folder is always one
whole conversion; :func:`resolve_shards` refuses a folder whose shards and manifest disagree.
"""

from __future__ import annotations

import glob
import io
import json
import os
import re
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from webdataset.shardlists import expand_urls

from mmoe.data.remote import is_remote, read_remote_text, remote_glob
from mmoe.io import parse_json

MANIFEST = "manifest.json"
#: The manifest's ``format`` of an indexed img2dataset folder (:mod:`mmoe.data.img2dataset`).
INDEX_FORMAT = "img2dataset"
_SHARD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def encode_value(extension: str, value: Any) -> bytes:
    """Bytes stored for one sample entry: bytes as they are, str as UTF-8, dicts / lists for ``json`` as JSON."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if extension.endswith("json"):
        return json.dumps(value, ensure_ascii=False, sort_keys=True).encode("utf-8")
    raise TypeError(f"cannot store a {type(value).__name__} under extension {extension!r}; give bytes, str or json")


def check_shard_name(name: str) -> str:
    """A shard name prefix starts with a letter or digit and holds only letters, digits, ``.``, ``_`` and ``-``: it
    names files in one folder (no ``/``) that :func:`resolve_shards` finds again (no glob or brace characters)."""
    if not isinstance(name, str) or not _SHARD_NAME.fullmatch(name) or len(name) > 200:
        raise ValueError(
            f"shard name {name!r} must start with a letter or digit and hold only letters, digits, '.', '_' and '-'"
        )
    return name


def check_key(key: str) -> str:
    """webdataset splits member names at the first dot of the file name: a key holds no dot and no slash."""
    if not key or "." in key or "/" in key:
        raise ValueError(f"sample key {key!r} must be non-empty without '.' or '/'")
    return key


class ShardWriter:
    """Writes samples into ``<out>/<name>-%06d.tar`` shards of at most ``max_count`` samples / ``max_bytes`` bytes.

    Members carry fixed metadata (mtime 0, mode 0o444, no owner), so the same samples give the same bytes.

    Args:
        out: output folder (created).
        name: shard name prefix, e.g. ``vqav2-val2014``.
        max_count: most samples per shard.
        max_bytes: a shard is closed once it holds at least this many bytes of member data.
    """

    def __init__(self, out: str | os.PathLike, name: str, max_count: int = 1000, max_bytes: int = 1 << 30) -> None:
        if max_count < 1 or max_bytes < 1:
            raise ValueError(f"ShardWriter needs max_count >= 1 and max_bytes >= 1, got {max_count}, {max_bytes}")
        self.name = check_shard_name(name)
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.shards: list[str] = []
        self.shard_samples: list[int] = []
        self.samples = 0
        self._tar: tarfile.TarFile | None = None
        self._tmp: Path | None = None
        self._count = 0
        self._bytes = 0

    def write(self, sample: Mapping[str, Any]) -> None:
        """Adds one sample (``__key__`` plus extension -> value entries)."""
        key = check_key(str(sample["__key__"]))
        members = [(ext, encode_value(ext, value)) for ext, value in sample.items() if not ext.startswith("__")]
        if not members:
            raise ValueError(f"sample {key!r} has no data entries")
        if self._tar is None:
            self._open()
        for extension, data in members:
            info = tarfile.TarInfo(f"{key}.{extension}")
            info.size, info.mtime, info.mode = len(data), 0, 0o444
            self._tar.addfile(info, io.BytesIO(data))
            self._bytes += len(data)
        self._count += 1
        self.samples += 1
        if self._count >= self.max_count or self._bytes >= self.max_bytes:
            self._close_shard()

    def _open(self) -> None:
        final = f"{self.name}-{len(self.shards):06d}.tar"
        self._tmp = self.out / f".{final}.tmp"
        self._tar = tarfile.open(self._tmp, "w", format=tarfile.USTAR_FORMAT)
        self._count = self._bytes = 0

    def _close_shard(self) -> None:
        if self._tar is None:
            return
        self._tar.close()
        final = f"{self.name}-{len(self.shards):06d}.tar"
        os.replace(self._tmp, self.out / final)
        self.shards.append(final)
        self.shard_samples.append(self._count)
        self._tar = self._tmp = None

    def close(self) -> list[str]:
        """Finishes the last shard; returns the shard file names in order."""
        self._close_shard()
        return self.shards

    def abort(self) -> None:
        """Drops the shard being written (its temporary file); closed shards stay."""
        if self._tar is not None:
            self._tar.close()
            self._tmp.unlink(missing_ok=True)
            self._tar = self._tmp = None

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


@dataclass
class Manifest:
    """``manifest.json`` of a converted split.

    Attributes:
        name: dataset and split, e.g. ``vqav2-val2014``; the shards are ``<name>-000000.tar``, ...
        samples: samples written.
        skipped: samples left out (missing or unreadable images).
        shards: number of shards.
        shard_files: shard file names, in order.
        shard_samples: samples in each shard, in the order of ``shard_files`` (:func:`expected_samples`: a reader
            counts what a truncated shard lost against it). Manifests written before this field lack it.
        skipped_examples: the first few skipped image paths with the reason.
        files: the split's other files in its folder (``answers.json``, ``caption_tokens.json``), written and swapped
            in together with the shards.
        extra: converter-specific facts (source files, answer vocabulary size, ...).
    """

    name: str
    samples: int
    skipped: int
    shards: int
    shard_files: list[str]
    shard_samples: list[int] = field(default_factory=list)
    skipped_examples: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "samples": self.samples,
            "skipped": self.skipped,
            "shards": self.shards,
            "shard_files": self.shard_files,
            "shard_samples": self.shard_samples,
            "skipped_examples": self.skipped_examples,
            "files": self.files,
            **self.extra,
        }


def read_manifest(folder: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a split folder, checked: the required keys, and ``shard_files`` / ``shard_samples`` (where
    present) agreeing with ``shards`` and naming files in the folder itself."""
    return parse_manifest(Path(folder) / MANIFEST, (Path(folder) / MANIFEST).read_text())


def parse_manifest(path: str | os.PathLike, text: str) -> dict[str, Any]:
    """A manifest's ``text`` (read from ``path``, local or remote), checked as :func:`read_manifest` says."""
    folder = os.path.dirname(os.fspath(path))
    try:
        manifest = parse_json(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(manifest, dict) or not {"name", "samples", "skipped", "shards"} <= manifest.keys():
        raise ValueError(f"{path}: a manifest needs the keys name, samples, skipped, shards")
    count = manifest["shards"]
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ValueError(f"{path}: 'shards' must be a count, got {count!r}")
    files = manifest.get("shard_files")
    if files is not None:
        if not isinstance(files, list) or not all(isinstance(f, str) and f and "/" not in f for f in files):
            raise ValueError(f"{path}: 'shard_files' must be a list of file names in {folder}")
        if len(files) != count:
            raise ValueError(f"{path}: 'shards' = {count} but 'shard_files' lists {len(files)} files")
    samples = manifest.get("shard_samples")
    if samples is not None:
        counts_ok = isinstance(samples, list) and all(isinstance(n, int) and n >= 0 for n in samples)
        if files is None or not counts_ok or len(samples) != len(files):
            raise ValueError(f"{path}: 'shard_samples' must be one sample count per entry of 'shard_files'")
    return manifest


def _listed_shards(manifest: dict[str, Any]) -> list[str]:
    """The shard file names a manifest lists (manifests without ``shard_files`` name them by the numbering rule)."""
    name = manifest["name"]
    return manifest.get("shard_files") or [f"{name}-{i:06d}.tar" for i in range(manifest["shards"])]


def _span(files: Sequence[str]) -> str:
    return ", ".join(files) if len(files) <= 3 else f"{files[0]} .. {files[-1]}"


def manifest_shards(folder: str) -> list[str]:
    """The shard paths a split folder's manifest lists, after checking that the folder agrees with it: every listed
    shard exists, and no ``<name>-*.tar`` file is there that the manifest does not list (a shard of another
    conversion); in an indexed img2dataset folder, no ``.tar`` was added or changed since it was indexed. A
    disagreement is a ValueError naming the folder, the file and what the manifest expects."""
    manifest = read_manifest(folder)
    name, files = manifest["name"], _listed_shards(manifest)
    expected = f"{MANIFEST} lists {len(files)} shard{'s' if len(files) != 1 else ''} of {name!r}"
    for file_name in files:
        if not os.path.isfile(os.path.join(folder, file_name)):
            raise ValueError(f"{folder}: shard {file_name} is missing; {expected} ({_span(files)})")
    if manifest.get("format") == INDEX_FORMAT:
        _check_indexed(folder, files, manifest.get("shard_stats"))
    listed = set(files)
    for path in sorted(glob.glob(os.path.join(glob.escape(folder), f"{glob.escape(name)}-*.tar"))):
        if os.path.basename(path) not in listed:
            raise ValueError(
                f"{folder}: {os.path.basename(path)} is not in {MANIFEST}, which lists {len(files)} shards of "
                f"{name!r} ({_span(files) or 'none'}): a shard left over from another conversion; convert the split "
                "again or remove the file"
            )
    return [os.path.join(folder, file_name) for file_name in files]


def _check_indexed(folder: str, files: list[str], stats: Any) -> None:
    """An indexed img2dataset folder holds exactly the tars its index read, each with the size and modification
    time recorded then (``shard_stats``); anything else was added or replaced since, and is refused."""
    again = f"index the folder again (mmoe data index {folder})"
    tars = sorted(os.path.basename(path) for path in glob.glob(os.path.join(glob.escape(folder), "*.tar")))
    added = sorted(set(tars) - set(files))
    if added:
        raise ValueError(f"{folder}: shard {added[0]} was added after {MANIFEST} was written; {again}")
    recorded, now = stats if isinstance(stats, dict) else {}, shard_stats(folder, files)
    changed = [file_name for file_name in files if recorded.get(file_name) != now[file_name]]
    if changed:
        raise ValueError(f"{folder}: shard {changed[0]} changed after {MANIFEST} was written (size or time); {again}")


def shard_stats(folder: str | os.PathLike, files: Sequence[str]) -> dict[str, dict[str, int]]:
    """Each shard's size and modification time, as an index records them (:func:`manifest_shards` checks them)."""
    stats = {name: os.stat(os.path.join(folder, name)) for name in files}
    return {name: {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns} for name, stat in stats.items()}


def resolve_shards(spec: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """Shard paths from a folder (its manifest's shards, else its ``*.tar`` files), a glob, a brace pattern
    (``data-{000000..000009}.tar``), a single path, or a list of any of these. Raises FileNotFoundError if nothing
    matches, and ValueError for a folder whose shards and manifest disagree (:func:`manifest_shards`). A truncated
    shard is not refused here: the reader skips and counts what it loses (:func:`expected_samples`)."""
    if isinstance(spec, (list, tuple)):
        return [path for item in spec for path in resolve_shards(item)]
    text = os.fspath(spec)
    if is_remote(text) and "{" not in text:
        paths = remote_shards(text)
    elif os.path.isdir(text):
        if os.path.exists(os.path.join(text, MANIFEST)):
            paths = manifest_shards(text)
        else:
            paths = sorted(glob.glob(os.path.join(glob.escape(text), "*.tar")))
    elif "{" in text:
        paths = expand_urls(text)
    elif any(char in text for char in "*?["):
        paths = sorted(glob.glob(text))
    elif "://" in text or text.startswith("pipe:") or os.path.isfile(text):
        paths = [text]
    else:
        raise FileNotFoundError(f"shard path {text!r} does not exist")
    if not paths:
        raise FileNotFoundError(f"no shards found for {text!r}")
    return paths


def remote_manifest(folder: str) -> dict[str, Any] | None:
    """The checked manifest of a remote split folder, or None where it has none."""
    url = f"{folder.rstrip('/')}/{MANIFEST}"
    text = read_remote_text(url)
    return None if text is None else parse_manifest(url, text)


def remote_shards(spec: str) -> list[str]:
    """The shard URLs of a remote spec: a ``.tar`` URL itself, a glob's matches, or a folder's manifest shards (else
    its ``*.tar`` objects). Listed shards are not checked one by one (a request each): one that is gone is counted as
    lost when read."""
    if spec.endswith(".tar"):
        return [spec]
    if any(char in spec for char in "*?["):
        return remote_glob(spec)
    folder = spec.rstrip("/")
    manifest = remote_manifest(folder)
    if manifest is None:
        return remote_glob(f"{folder}/*.tar")
    return [f"{folder}/{file_name}" for file_name in _listed_shards(manifest)]


def expected_samples(shards: Sequence[str]) -> dict[str, int]:
    """For each shard path whose folder's manifest lists it with a sample count, that count.

    Paths are taken as :func:`resolve_shards` returns them and are the keys of the result; a remote shard's manifest
    is the ``manifest.json`` beside it. Shards without a manifest, ``pipe:`` shards and shards of a manifest written
    before ``shard_samples`` existed are absent from the result. A manifest that is not valid is a ValueError
    (:func:`read_manifest`).
    """
    return _per_shard(shards, _manifest_counts)[0]


def excluded_samples(shards: Sequence[str]) -> dict[str, dict[str, str]]:
    """For each shard path whose folder's manifest leaves samples out (an indexed img2dataset folder:
    :mod:`mmoe.data.img2dataset`), sample key -> cause; keys as :func:`expected_samples`."""
    return _per_shard(shards, _manifest_exclusions)[0]


def expected_and_excluded_samples(shards: Sequence[str]) -> tuple[dict[str, int], dict[str, dict[str, str]]]:
    """:func:`expected_samples` and :func:`excluded_samples` of ``shards``, each folder's manifest read once (a remote
    one is fetched once)."""
    expected, excluded = _per_shard(shards, _manifest_counts, _manifest_exclusions)
    return expected, excluded


def _per_shard(shards: Sequence[str], *of_folder) -> list[dict[str, Any]]:
    """For each function of ``of_folder``: shard path -> ``function(manifest, folder)[file name]``, each folder's
    manifest read once (shards without one absent)."""
    by_folder: dict[str, list[dict[str, Any]]] = {}
    found: list[dict[str, Any]] = [{} for _ in of_folder]
    for shard in shards:
        path = os.fspath(shard)
        remote = is_remote(path)
        if path.startswith("pipe:") or ("://" in path and not remote):
            continue
        folder, file_name = path.rsplit("/", 1) if remote else os.path.split(path)
        if folder not in by_folder:
            manifest = remote_manifest(folder) if remote else _local_manifest(folder or ".")
            by_folder[folder] = [{} if manifest is None else of(manifest, folder) for of in of_folder]
        for values, result in zip(by_folder[folder], found, strict=True):
            value = values.get(file_name)
            if value is not None:
                result[path] = value
    return found


def _local_manifest(folder: str) -> dict[str, Any] | None:
    return read_manifest(folder) if os.path.isfile(os.path.join(folder, MANIFEST)) else None


def _manifest_counts(manifest: dict[str, Any], folder: str) -> dict[str, int]:
    """Shard file name -> sample count from a manifest (empty without its counts)."""
    counts = manifest.get("shard_samples")
    return {} if counts is None else dict(zip(manifest["shard_files"], counts, strict=True))


def _manifest_exclusions(manifest: dict[str, Any], folder: str) -> dict[str, dict[str, str]]:
    """Shard file name -> {key: cause} from a manifest's ``excluded`` (empty without one)."""
    excluded = manifest.get("excluded") or {}
    path = f"{folder}/{MANIFEST}"
    ok = isinstance(excluded, dict) and all(
        isinstance(keys, dict) and all(isinstance(k, str) and isinstance(c, str) for k, c in keys.items())
        for keys in excluded.values()
    )
    if not ok:
        raise ValueError(f"{path}: 'excluded' must map shard file names to {{sample key: cause}}")
    return excluded
