"""Shards on object stores and web servers (``s3://``, ``gs://``, ``hf://``, ``https://``), read through fsspec with
bounded retries.

fsspec opens each shard (``s3://`` needs s3fs and ``gs://`` gcsfs: ``pip install -e ".[remote]"``; ``hf://`` and
``https://`` work as installed); credentials and endpoints come from the usual places (``AWS_*`` variables,
``FSSPEC_S3_ENDPOINT_URL``, ``fsspec.config.conf``). :class:`RetryingReader` reads a shard from its start; a
transient error (a dropped connection, a read that waited :attr:`RemoteReading.read_timeout_s`, a server error)
reopens the object at the byte reached (:mod:`mmoe.data.remote_open`: a range request), at most
:attr:`RemoteReading.retries` times in a row with growing pauses. A shard that is gone (``FileNotFoundError``),
refused (``PermissionError``) or replaced while read (:class:`~mmoe.data.remote_open.ShardChanged`) is not retried;
nor is a tar member claiming more than :attr:`RemoteReading.max_member_bytes` read (:mod:`mmoe.data.remote_tar`).
What could not be read is counted by the stream like a truncated local shard: against the manifest beside the
shards, where there is one (:mod:`mmoe.data.accounting`). URLs are shown and kept without their credentials
(:mod:`mmoe.data.redact`).
"""

from __future__ import annotations

import io
import logging
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import webdataset as wds
from webdataset.tariterators import group_by_keys

from mmoe.data.redact import redact, redacted
from mmoe.data.remote_open import ShardChanged, object_identity, open_url
from mmoe.data.remote_tar import tar_members

logger = logging.getLogger("mmoe.data")

#: The URL schemes read through fsspec (``file://`` and plain paths stay with webdataset's local reader).
REMOTE_SCHEMES = ("s3", "gs", "gcs", "hf", "http", "https")
#: Errors that say the object will not come however often it is asked for.
PERMANENT_ERRORS = (
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    ValueError,
    TypeError,
    ShardChanged,
)
#: Error class names (from optional packages) that say the same: s3fs's object replaced while read; botocore's
#: refusal of a malformed bucket or key.
PERMANENT_ERROR_NAMES = ("FileExpired", "ParamValidationError")
#: The most bytes :func:`read_remote_text` reads (a manifest lists shards; a larger one is not what it claims to be).
MAX_REMOTE_TEXT_BYTES = 64 << 20


def is_remote(url: str) -> bool:
    """Whether ``url`` names a shard fsspec reads (one of :data:`REMOTE_SCHEMES`)."""
    scheme, separator, _ = str(url).partition("://")
    return bool(separator) and scheme.lower() in REMOTE_SCHEMES


@dataclass(frozen=True)
class RemoteReading:
    """How remote shards are read.

    Attributes:
        retries: reopenings after a transient error, in a row (a successful read starts the count again); 0 = none.
        backoff_s: the pause before the first reopening; each next one doubles it, up to 30 s.
        block_size: bytes asked for per range request.
        read_timeout_s: the longest wait for the next bytes (or a connection) over HTTP(S) before the read counts
            as failed and is retried; a slow but steady transfer never times out.
        max_member_bytes: the largest tar member a remote shard may hold; a member claiming more is refused
            without being read, and the rest of its shard counted as lost.
    """

    retries: int = 3
    backoff_s: float = 0.5
    block_size: int = 8 << 20
    read_timeout_s: float = 60.0
    max_member_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        if min(self.retries, self.backoff_s) < 0 or min(self.block_size, self.max_member_bytes) < 1:
            raise ValueError(
                f"RemoteReading needs retries >= 0, backoff_s >= 0, block_size >= 1 and max_member_bytes >= 1, "
                f"got {self}"
            )
        if not self.read_timeout_s > 0:
            raise ValueError(f"RemoteReading needs read_timeout_s > 0, got {self.read_timeout_s}")

    def pause(self, attempt: int) -> float:
        return min(self.backoff_s * 2**attempt, 30.0)


class RetryingReader(io.RawIOBase):
    """A remote file read from its start, reopened at the byte it stopped at after a transient error; an object
    replaced meanwhile (another ETag, version or size) is not read on (:class:`ShardChanged`).

    Args:
        url: the object.
        reading: retries, pauses, range size and read timeout.
        opener: (url, reading, offset, etag) -> a binary file at byte ``offset`` (:func:`open_url`).
        sleep: the pause function (tests pass a recorder).
    """

    def __init__(
        self,
        url: str,
        reading: RemoteReading,
        opener: Callable[[str, RemoteReading, int, str | None], Any] = open_url,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__()
        self.url, self.reading, self.opener, self.sleep = url, reading, opener, sleep
        self.offset = 0
        self.checksum = 0  # CRC-32 of the bytes read: an object sent again from its start must repeat them
        self.reopened = 0
        self._stale = False  # the open file failed: the next attempt reopens it before reading
        self._file = self._attempt(lambda: self.opener(url, reading, 0, None), reopen=False)
        self.identity = object_identity(self._file)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self._attempt(lambda: self._file.read(len(buffer)))
        buffer[: len(data)] = data
        self.offset += len(data)
        self.checksum = zlib.crc32(data, self.checksum)
        return len(data)

    def _attempt(self, action: Callable[[], Any], reopen: bool = True) -> Any:
        """``action``'s result, retried after transient errors; reopening a failed file is part of the next attempt,
        so a refused reopening (a server restarting) uses one retry rather than escaping."""
        for attempt in range(self.reading.retries + 1):
            try:
                if self._stale:
                    self._reopen()
                    self._stale = False
                return action()
            except PERMANENT_ERRORS as error:
                redacted(error, self.url)
                raise
            except Exception as error:  # noqa: BLE001 (network stacks raise many types; all are retried a bounded time)
                if type(error).__name__ == "FileExpired":  # s3fs: the ETag changed between range requests
                    raise ShardChanged(f"{redact(self.url)}: replaced while read (at byte {self.offset})") from None
                if attempt == self.reading.retries or type(error).__name__ in PERMANENT_ERROR_NAMES:
                    redacted(error, self.url)
                    raise
                pause = self.reading.pause(attempt)
                logger.warning(
                    "%s: %s at byte %d; reading again in %.1f s (retry %d of %d)",
                    redact(self.url),
                    type(error).__name__,
                    self.offset,
                    pause,
                    attempt + 1,
                    self.reading.retries,
                )
                self.sleep(pause)
                self._stale = self._stale or reopen
        raise AssertionError("unreachable")

    def _reopen(self) -> None:
        try:
            self._file.close()
        except Exception:  # noqa: BLE001 (a broken connection may fail to close; it is dropped either way)
            pass
        etag = self.identity[0] if self.identity and isinstance(self.identity[0], str) else None
        self._file = self.opener(self.url, self.reading, self.offset, etag)
        identity = object_identity(self._file)
        changed = self.identity and identity and not same_object(self.identity, identity)
        if changed or (self._file.tell() == 0 < self.offset and not self._same_start()):
            raise ShardChanged(f"{redact(self.url)}: replaced while read (at byte {self.offset})")
        self.reopened += 1

    def _same_start(self) -> bool:
        """Reads the first :attr:`offset` bytes again (a server that sends the object from its start) and says
        whether they are the bytes read before."""
        checksum, left = 0, self.offset
        while left and (data := self._file.read(min(left, self.reading.block_size))):
            checksum, left = zlib.crc32(data, checksum), left - len(data)
        if left:
            raise OSError(f"{redact(self.url)}: ended {left} bytes before byte {self.offset} when read again")
        return checksum == self.checksum

    def close(self) -> None:
        if not self.closed and getattr(self, "_file", None) is not None:
            self._file.close()
        super().close()


def same_object(first: tuple, again: tuple) -> bool:
    """Whether two identities (:func:`object_identity`) agree on every field both give."""
    return all(a == b for a, b in zip(first, again, strict=True) if a is not None and b is not None)


def remote_tar_samples(url: str, handler: Callable[[Exception], bool], reading: RemoteReading) -> Iterator[dict]:
    """The samples of one remote tar shard, grouped by key as webdataset groups them; errors go to ``handler``
    (which counts; their messages show no credentials of ``url``)."""

    def opened() -> Iterator[dict]:
        try:
            stream = io.BufferedReader(RetryingReader(url, reading), buffer_size=min(reading.block_size, 1 << 20))
        except Exception as error:  # noqa: BLE001 (handed to the stream's handler, which counts it)
            handler(error)
            return
        with stream:
            yield from tar_members(stream, url, reading.max_member_bytes, handler)

    return group_by_keys(opened(), handler=handler)


def tar_samples(url: str, handler: Callable[[Exception], bool], reading: RemoteReading) -> Iterator[dict]:
    """The samples of one tar shard: remote ones through :func:`remote_tar_samples`, others through webdataset."""
    if is_remote(url):
        return remote_tar_samples(url, handler, reading)
    return wds.tarfile_to_samples(handler=handler)([{"url": url}])


def read_remote_text(
    url: str,
    reading: RemoteReading | None = None,
    opener: Callable[[str, RemoteReading, int, str | None], Any] = open_url,
    max_bytes: int = MAX_REMOTE_TEXT_BYTES,
) -> str | None:
    """A small remote text file (a manifest), or None when it does not exist; a ValueError naming ``url`` when it is
    over ``max_bytes`` (only that much plus one byte is read)."""
    reading = reading or RemoteReading()
    try:
        with io.BufferedReader(RetryingReader(url, reading, opener)) as stream:
            data = stream.read(max_bytes + 1)
    except FileNotFoundError:
        return None
    if len(data) > max_bytes:
        raise ValueError(
            f"{redact(url)}: larger than {max_bytes} bytes, the most a remote text file (a manifest) may hold"
        )
    return data.decode("utf-8")


def remote_glob(pattern: str) -> list[str]:
    """The URLs matching a remote glob pattern, sorted, with their scheme."""
    import fsspec

    fs, _, paths = fsspec.get_fs_token_paths(pattern)
    protocol = fs.protocol[0] if isinstance(fs.protocol, tuple | list) else fs.protocol
    return sorted(path if "://" in path else f"{protocol}://{path}" for path in paths)
