"""Shards made by the real img2dataset package from a loopback HTTP server, indexed and pre-trained on (slow).

img2dataset is an optional extra (``pip install -e ".[img2dataset]"``; scripts/setup.sh leaves it out: it pins
webdataset < 0.3 and pulls wandb, albumentations and OpenCV). Where it is absent this test skips; the dependency-free
fixture of tests/data/test_img2dataset.py covers the same layout.
"""

from __future__ import annotations

import importlib.util
import io
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from mmoe.data.img2dataset import index_folder
from mmoe.data.shards import resolve_shards
from mmoe.data.streams import ShardStream
from tests.cli_fixtures import run_mmoe
from tests.data.test_img2dataset_fit import pairs_only_config

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.skipif(
        importlib.util.find_spec("img2dataset") is None,
        reason="img2dataset is not installed (optional extra 'img2dataset', not installed by scripts/setup.sh)",
    ),
]

#: 12 URLs: 3 answer 404, 2 serve 16-px images (below --min-side 32), 7 serve 48-px images.
MISSING = {3, 7, 11}
SMALL = {1, 8}


def image(side: int, shade: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (side, side), (shade * 20 % 256, 80, 160)).save(buffer, format="JPEG")
    return buffer.getvalue()


class ImageServer(BaseHTTPRequestHandler):
    images: dict[str, bytes] = {}

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        data = self.images.get(self.path)
        if data is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/jpeg")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def image_server():
    ImageServer.images = {
        f"/img/{i}.jpg": image(16 if i in SMALL else 48, i) for i in range(12) if i not in MISSING
    }  # fmt: skip
    server = ThreadingHTTPServer(("127.0.0.1", 0), ImageServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join(timeout=30)


def test_img2dataset_shards_index_read_and_pretrain(image_server, synthetic_corpus, tmp_path, capsys):
    from img2dataset import download

    urls = tmp_path / "urls.parquet"
    rows = [{"url": f"{image_server}/img/{i}.jpg", "caption": f"picture {i}"} for i in range(12)]
    pq.write_table(pa.Table.from_pylist(rows), urls)
    out = tmp_path / "cc"
    download(
        url_list=str(urls), input_format="parquet", url_col="url", caption_col="caption", output_format="webdataset",
        output_folder=str(out), processes_count=1, thread_count=4, number_sample_per_shard=6, resize_mode="no",
        timeout=10, retries=0, disallowed_header_directives=[], enable_wandb=False,
    )  # fmt: skip
    assert sorted(path.name for path in out.glob("*.tar")) == ["00000.tar", "00001.tar"]
    manifest = index_folder(out, min_side=32)
    assert manifest["counted_from"] == {"00000.tar": "parquet", "00001.tar": "parquet"}
    assert manifest["skipped_by_cause"]["status"] == len(MISSING) and manifest["statuses"]
    assert manifest["skipped_by_cause"]["too_small"] == len(SMALL)
    assert manifest["samples"] == 12 - len(MISSING) - len(SMALL)

    stream = ShardStream(resolve_shards(str(out)), lambda sample: sample["txt"].decode())
    captions = list(stream)
    assert sorted(captions) == sorted(f"picture {i}" for i in range(12) if i not in MISSING | SMALL)
    assert stream.skipped[""].left_out == {"too_small": len(SMALL)}

    config = pairs_only_config(out, synthetic_corpus / "codebook.pt", tmp_path / "run", steps=2, batch_size=2)
    code, _, err = run_mmoe(["fit", "--config", str(config)], capsys)
    assert code == 0, err[-2000:]
    assert "draw from pair_shards" in err and "mmoe fit: samples skipped" in err
