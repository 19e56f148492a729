"""A remote object opened at a byte, and the identity that says it is still the object first read.

HTTP(S) is read as one stream per request; a reopening asks for the rest with ``Range: bytes=<offset>-`` and, where
the first response gave a strong ETag, ``If-Match`` (RFC 9110 §13.1.1, §14.2): a server that answers 412 or a
different ETag, Last-Modified or size has replaced the object, and the rest is not read (:class:`ShardChanged`). A
server that ignores ranges (200) sends the body again: the bytes before the offset are read again, and must be those
read before. Each read
waits at most :attr:`~mmoe.data.remote.RemoteReading.read_timeout_s` for data (a stalled server is a transient error,
retried). Other schemes open through fsspec with range requests of ``block_size`` bytes and compare the object's
ETag, version and size on reopening.
"""

from __future__ import annotations

from typing import Any

from mmoe.data.redact import redact

#: fsspec ``details`` fields that identify one version of an object (S3, GCS, HF).
IDENTITY_FIELDS = ("ETag", "etag", "VersionId", "generation", "size")


class ShardChanged(OSError):
    """The object was replaced while it was read: the rest is not read (reading on would mix two versions)."""


def is_http(url: str) -> bool:
    return url.lower().startswith(("http://", "https://"))


def open_url(url: str, reading: Any, offset: int = 0, etag: str | None = None) -> Any:
    """The fsspec file of ``url`` opened for reading at byte ``offset`` (an ImportError naming the package a scheme
    needs); ``etag``: the strong ETag an HTTP reopening must match."""
    from fsspec.core import url_to_fs

    if is_http(url):
        return open_http(url, reading, offset, etag)
    fs, path = url_to_fs(url)
    return skip_to(fs.open(path, "rb", block_size=reading.block_size), offset, reading.block_size)


def open_http(url: str, reading: Any, offset: int, etag: str | None) -> Any:
    """fsspec's HTTP stream of ``url`` from ``offset``: a Range request (``If-Match: etag`` where given)."""
    import aiohttp
    from fsspec.asyn import sync
    from fsspec.config import conf
    from fsspec.core import url_to_fs
    from fsspec.implementations.http import HTTPStreamFile

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=reading.read_timeout_s, sock_read=reading.read_timeout_s)
    client_kwargs = {**conf.get("http", {}).get("client_kwargs", {}), "timeout": timeout}
    fs, path = url_to_fs(url, client_kwargs=client_kwargs)
    headers = {"Accept-Encoding": "identity"}  # byte offsets count the bytes as stored
    if offset:
        headers["Range"] = f"bytes={offset}-"
        if etag and not etag.startswith("W/"):
            headers["If-Match"] = etag
    try:
        file = HTTPStreamFile(fs, path, session=sync(fs.loop, fs.set_session), loop=fs.loop, headers=headers)
    except aiohttp.ClientResponseError as error:
        if error.status in (412, 416):  # If-Match failed; the range starts past a shorter object
            raise ShardChanged(f"{redact(url)}: replaced while read (HTTP {error.status} at byte {offset})") from None
        raise
    if file.r.status == 206:
        start = file.r.headers.get("Content-Range", "").removeprefix("bytes ").partition("-")[0]
        if start != str(offset):
            raise OSError(f"{redact(url)}: asked for byte {offset}, the server sent range {start!r}")
        file.loc = offset  # what tell() says: the stream starts at the offset
        return file
    return file  # at byte 0: the reader reads the bytes before ``offset`` again and checks they are the same


def skip_to(file: Any, offset: int, block_size: int) -> Any:
    """``file`` positioned at ``offset``: sought where it can be, else read up to it (a stream sent from its start)."""
    if not offset:
        return file
    try:
        file.seek(offset)
        return file
    except (ValueError, OSError, AttributeError):  # fsspec's HTTP stream says seekable, then refuses to seek
        pass
    left = offset
    while left and (skipped := len(file.read(min(left, block_size)))):
        left -= skipped
    if left:
        raise OSError(f"ended {left} bytes before byte {offset} when read again")
    return file


def object_identity(file: Any) -> tuple | None:
    """What identifies the version of the object ``file`` reads (None where the file says nothing): an HTTP
    response's ETag, Last-Modified and total size, or fsspec's ``details`` fields :data:`IDENTITY_FIELDS`."""
    response = getattr(file, "r", None)
    headers = getattr(response, "headers", None)
    if headers is not None:
        ranged = headers.get("Content-Range", "")
        total = ranged.rpartition("/")[2] if ranged else headers.get("Content-Length")
        identity = (headers.get("ETag"), headers.get("Last-Modified"), None if total == "*" else total)
    else:
        details = getattr(file, "details", None)
        identity = tuple(details.get(field) for field in IDENTITY_FIELDS) if isinstance(details, dict) else ()
    return identity if any(value is not None for value in identity) else None
