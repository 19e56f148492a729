"""Where a converted split came from: the manifest fields ``sha256`` (every input file's digest) and ``split_rule``
(how the split's records were chosen), written by every ``mmoe data convert`` beside its ``source``."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mmoe.data.converters.common import ConversionError


def file_sha256(path: str | os.PathLike) -> str:
    """The hex SHA-256 digest of a file's bytes, read 1 MiB at a time."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as file:
            while chunk := file.read(1 << 20):
                digest.update(chunk)
    except OSError as error:
        raise ConversionError(f"{path}: cannot read ({error.strerror or error})") from None
    return digest.hexdigest()


def provenance(files: Iterable[str | os.PathLike | None], split_rule: str) -> dict[str, Any]:
    """The manifest fields ``sha256`` (input file -> digest; None entries left out) and ``split_rule``. Image files
    are not listed: their digests are the split's ``image_digests.json``."""
    digests = {str(Path(path)): file_sha256(path) for path in files if path is not None}
    return {"sha256": digests, "split_rule": split_rule}
