"""mmoe.data.remote's reader: bounded retries in a row, continuing at the byte it stopped at (seeking, or reading a
stream again), and no retry for an object that is gone."""

from __future__ import annotations

import pytest

from mmoe.data.remote import RemoteReading, RetryingReader, is_remote, read_remote_text
from mmoe.data.remote_open import skip_to

DATA = bytes(range(256)) * 4


class FlakyFile:
    """A file over ``data`` (:data:`DATA` unless given) whose reads fail while ``failures`` has entries (one popped
    per failure)."""

    def __init__(self, failures: list[int], seekable: bool, opened: list[int], data: bytes = DATA) -> None:
        self.failures, self._seekable, self.position, self.data = failures, seekable, 0, data
        opened.append(1)

    def read(self, size: int) -> bytes:
        if self.failures and self.position >= self.failures[0]:
            self.failures.pop(0)
            raise ConnectionResetError("connection dropped")
        data = self.data[self.position : self.position + size]
        self.position += len(data)
        return data

    def seekable(self) -> bool:
        return self._seekable

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int) -> None:
        if not self._seekable:  # as fsspec's HTTP stream: it says seekable, then refuses
            raise ValueError("Cannot seek streaming file")
        self.position = offset

    def close(self) -> None:
        pass


def reader(failures, seekable=True, retries=2):
    pauses, opened = [], []

    def opener(url, reading, offset, etag):  # a stream is sent again from its start
        file = FlakyFile(failures, seekable, opened)
        return skip_to(file, offset, 64) if seekable else file

    return RetryingReader("s3://b/x.tar", RemoteReading(retries=retries, backoff_s=0.5), opener, pauses.append), pauses


@pytest.mark.parametrize("seekable", [True, False])
def test_a_dropped_read_continues_at_the_byte_it_stopped_at(seekable):
    failures = [100, 100, 600]  # two drops in a row at byte 100, one later at 600
    stream, pauses = reader(failures, seekable)
    data = b"".join(iter(lambda: stream.read(64), b""))
    assert data == DATA and stream.reopened == 3 and pauses == [0.5, 1.0, 0.5]  # the count restarts after a read


def test_more_drops_in_a_row_than_retries_raise():
    stream, pauses = reader([0, 0, 0], retries=2)
    with pytest.raises(ConnectionResetError):
        stream.read(10)
    assert pauses == [0.5, 1.0]


def test_an_object_that_is_gone_is_not_retried():
    pauses = []

    def gone(url, reading, offset, etag):
        raise FileNotFoundError(url)

    with pytest.raises(FileNotFoundError):
        RetryingReader("s3://b/gone.tar", RemoteReading(), gone, pauses.append)
    assert pauses == []


def test_remote_schemes():
    assert all(map(is_remote, ["s3://b/k.tar", "gs://b/k", "hf://datasets/u/r/a.tar", "https://h/a.tar"]))
    assert not any(map(is_remote, ["data/a.tar", "/abs/a.tar", "pipe:cat a.tar", "file:///a.tar"]))
    with pytest.raises(ValueError, match="retries >= 0"):
        RemoteReading(retries=-1)


def test_a_refused_reopen_is_one_more_attempt():
    """A reopening that fails with a transient error (a server restarting) is retried like a dropped read."""
    pauses, opened = [], []

    def opener(url, reading, offset, etag):
        if len(opened) == 1:  # the first reopening is refused once
            opened.append(0)
            raise ConnectionRefusedError("server restarting")
        return skip_to(FlakyFile([100] if not opened else [], True, opened), offset, 64)

    stream = RetryingReader("s3://b/x.tar", RemoteReading(retries=3, backoff_s=0.5), opener, pauses.append)
    data = b"".join(iter(lambda: stream.read(64), b""))
    assert data == DATA and len(opened) == 3 and stream.reopened == 1 and pauses == [0.5, 1.0]


def test_refused_reopens_past_the_retries_raise():
    pauses, opened = [], []

    def opener(url, reading, offset, etag):
        if opened:
            raise ConnectionRefusedError("server down")
        return FlakyFile([100], True, opened)

    stream = RetryingReader("s3://b/x.tar", RemoteReading(retries=2, backoff_s=0.5), opener, pauses.append)
    with pytest.raises(ConnectionRefusedError):
        b"".join(iter(lambda: stream.read(64), b""))
    assert pauses == [0.5, 1.0]


def test_a_remote_text_over_its_bound_is_refused():
    text = b"{" + b" " * 200 + b"}"
    opener = lambda url, reading, offset, etag: FlakyFile([], True, [], data=text)  # noqa: E731
    assert read_remote_text("s3://b/manifest.json", opener=opener, max_bytes=202) == text.decode()
    with pytest.raises(ValueError, match=r"^s3://b/manifest\.json: larger than 201 bytes"):
        read_remote_text("s3://b/manifest.json", opener=opener, max_bytes=201)
