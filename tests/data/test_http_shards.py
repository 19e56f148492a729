"""Remote shards over HTTP (fsspec's HTTP filesystem): an indexed img2dataset folder served from the loopback."""

from __future__ import annotations

import functools
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mmoe.data.img2dataset import index_folder
from mmoe.data.remote import RemoteReading
from mmoe.data.shards import expected_samples, resolve_shards
from mmoe.data.streams import ShardStream
from tests.data.img2dataset_layout import PLANTED_KEPT, write_planted

pytest.importorskip("aiohttp", reason="fsspec's HTTP filesystem needs aiohttp")


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def served(tmp_path):
    """The planted folder, indexed, under ``http://127.0.0.1:<port>/cc``."""
    index_folder(write_planted(tmp_path / "cc"), min_side=32)
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(tmp_path)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/cc", tmp_path / "cc"
    server.shutdown()
    thread.join(timeout=30)


def test_an_http_folder_brace_pattern_and_missing_shard_are_read_and_counted(served):
    url, folder = served
    reading = RemoteReading(retries=1, backoff_s=0.0, block_size=4096)
    shards = resolve_shards(url)
    assert shards == [f"{url}/00000.tar", f"{url}/00001.tar"]
    assert resolve_shards(f"{url}/{{00000..00001}}.tar") == shards
    assert expected_samples(shards) == dict(zip(shards, [6, 6], strict=True))
    stream = ShardStream(shards, lambda sample: sample["__key__"], remote=reading)
    assert len(list(stream)) == PLANTED_KEPT and stream.skipped[""].lost == 0
    (folder / "00001.tar").unlink()  # gone after the run resolved its shards: a 404
    stream = ShardStream(shards, lambda sample: sample["__key__"], remote=reading)
    keys = list(stream)
    assert len(keys) == 5 and stream.skipped[""].lost == 6
