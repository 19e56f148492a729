"""Remote shards, counted: an indexed img2dataset folder on a local S3 endpoint (moto's server on the loopback, behind
a proxy that drops connections), read through s3fs with bounded retries."""

from __future__ import annotations

import logging

import pytest

from mmoe.data.img2dataset import index_folder
from mmoe.data.remote import RemoteReading, is_remote
from mmoe.data.shards import expected_samples, resolve_shards
from mmoe.data.streams import ShardStream
from tests.data.img2dataset_layout import PLANTED_CAUSES, PLANTED_KEPT, write_planted

moto_server = pytest.importorskip("moto.server", reason="moto[s3] (the dev extra) runs the local S3 endpoint")
pytest.importorskip("s3fs", reason="s3fs (the remote extra) reads s3:// shards")

from tests.data.s3_server import Cut, DroppingProxy, upload  # noqa: E402

BUCKET = "corpus"
READ_TIME = {cause: n for cause, n in PLANTED_CAUSES.items() if cause != "status"}


@pytest.fixture(scope="module")
def moto():
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    yield server.get_host_and_port()
    server.stop()


@pytest.fixture
def s3(moto, tmp_path, monkeypatch):
    """A bucket holding the planted img2dataset folder (indexed) under ``cc/``, reached through a dropping proxy;
    s3fs itself does not retry, so the retries seen are mmoe's."""
    import boto3
    import fsspec
    import s3fs

    for name, value in {
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    host, port = moto
    client = boto3.client("s3", endpoint_url=f"http://{host}:{port}", region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    folder = write_planted(tmp_path / "cc")
    index_folder(folder, min_side=32)
    upload(client, BUCKET, "cc", folder)
    proxy = DroppingProxy((host, port))
    options = {"endpoint_url": proxy.url, "skip_instance_cache": True, "use_listings_cache": False}
    monkeypatch.setitem(fsspec.config.conf, "s3", options)
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)  # one attempt per request
    yield client, proxy, folder
    proxy.close()
    for item in client.list_objects_v2(Bucket=BUCKET).get("Contents", []):
        client.delete_object(Bucket=BUCKET, Key=item["Key"])
    client.delete_bucket(Bucket=BUCKET)


def read(spec, reading: RemoteReading) -> tuple[list[str], ShardStream]:
    stream = ShardStream(resolve_shards(spec), lambda sample: sample["__key__"], remote=reading)
    return list(stream), stream


FAST = RemoteReading(retries=2, backoff_s=0.0, block_size=2048)


def test_a_remote_folder_reads_as_the_local_one_with_its_manifest_counts(s3):
    _, _, folder = s3
    shards = resolve_shards(f"s3://{BUCKET}/cc")
    assert shards == [f"s3://{BUCKET}/cc/00000.tar", f"s3://{BUCKET}/cc/00001.tar"] and all(map(is_remote, shards))
    assert expected_samples(shards) == dict(zip(shards, [6, 6], strict=True))
    keys, stream = read(f"s3://{BUCKET}/cc", FAST)
    assert keys == read(str(folder), FAST)[0] and len(keys) == PLANTED_KEPT
    assert stream.skipped[""].left_out == READ_TIME and stream.skipped[""].lost == 0


def test_a_shard_that_disappears_counts_its_samples_as_lost(s3):
    client, _, _ = s3
    shards = resolve_shards(f"s3://{BUCKET}/cc")
    client.delete_object(Bucket=BUCKET, Key="cc/00001.tar")
    stream = ShardStream(shards, lambda sample: sample["__key__"], remote=FAST)
    keys = list(stream)
    assert all(key.startswith("00000") for key in keys) and len(keys) == 5
    assert stream.skipped[""].lost == 6 and f"s3://{BUCKET}/cc/00001.tar" in stream.skipped[""].shards


def test_a_connection_dropped_mid_shard_is_read_again_from_the_byte_it_stopped_at(s3, caplog):
    _, proxy, _ = s3
    proxy.cuts.append(Cut(f"/{BUCKET}/cc/00001.tar", after=1500, times=1))
    with caplog.at_level(logging.WARNING, logger="mmoe.data"):
        keys, stream = read(f"s3://{BUCKET}/cc", FAST)
    assert len(keys) == PLANTED_KEPT and stream.skipped[""].lost == 0 and stream.skipped[""].left_out == READ_TIME
    assert proxy.cuts[0].times == 0 and proxy.gets[f"/{BUCKET}/cc/00001.tar"] >= 2
    assert any("retry 1 of 2" in record.getMessage() for record in caplog.records)


def test_a_connection_that_keeps_dropping_gives_up_after_the_retries_and_counts_what_it_lost(s3):
    _, proxy, _ = s3
    shard = f"/{BUCKET}/cc/00000.tar"
    proxy.cuts.append(Cut(shard, after=1500, times=1000))
    keys, stream = read(f"s3://{BUCKET}/cc", FAST)
    from_shard = [key for key in keys if key.startswith("00000")]
    count = stream.skipped[""]
    assert count.lost >= 1 and count.lost + len(from_shard) + count.left_out.get("too_small", 0) == 6
    assert [key for key in keys if key.startswith("00001")] == read(f"s3://{BUCKET}/cc/00001.tar", FAST)[0]
    assert proxy.gets[shard] <= 1 + 2 * (6 * 3)  # bounded: a few requests per attempt, 2 retries per read


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("workers", [0, 1])
def test_mmoe_fit_pretrains_from_the_s3_folder_and_reports_what_it_left_out(
    s3, synthetic_corpus, tmp_path, capsys, workers
):
    from tests.cli_fixtures import run_mmoe
    from tests.data.test_img2dataset_fit import pairs_only_config

    config = pairs_only_config(f"s3://{BUCKET}/cc", synthetic_corpus / "codebook.pt", tmp_path / "run", 3, 3, workers)
    code, _, err = run_mmoe(["fit", "--config", str(config)], capsys)
    assert code == 0, err[-2000:]
    expected = ", ".join(f"{n} {cause}" for cause, n in sorted(READ_TIME.items()))
    report = [line for line in err.splitlines() if line.startswith("mmoe fit: samples skipped")]
    assert (
        len(report) == 1
        and f"train/pair: 3 skipped (0 corrupt, 0 lost, 3 left out: {expected}; from s3://" in report[0]
    )


def test_a_url_is_never_put_under_data_root_and_a_bad_retry_count_is_refused(s3, tmp_path):
    from mmoe.data.batches import PAIR
    from mmoe.data.datamodules import PretrainDataModule

    module = PretrainDataModule(
        pair_shards=f"s3://{BUCKET}/cc",
        data_root=str(tmp_path),
        image_size=32,
        num_workers=0,
        remote_retries=1,
        remote_read_timeout_s=2.5,
        remote_max_member_mib=3,
    )
    assert module.train_shards[PAIR] == f"s3://{BUCKET}/cc"
    assert module.remote == RemoteReading(retries=1, read_timeout_s=2.5, max_member_bytes=3 << 20)
    with pytest.raises(ValueError, match="retries >= 0"):
        PretrainDataModule(pair_shards=f"s3://{BUCKET}/cc", image_size=32, num_workers=0, remote_retries=-1)


def test_an_object_replaced_while_read_is_not_stitched_and_the_rest_is_counted_lost(s3, caplog):
    from tests.data.http_server import text_shard

    client, _, _ = s3
    client.put_object(Bucket=BUCKET, Key="flip/0.tar", Body=text_shard("A"))
    url = f"s3://{BUCKET}/flip/0.tar"
    stream = ShardStream([url], lambda sample: sample["txt"], expected={url: 6}, remote=FAST)
    texts = iter(stream)
    with caplog.at_level(logging.WARNING, logger="mmoe.data"):
        read = [next(texts)]
        client.put_object(Bucket=BUCKET, Key="flip/0.tar", Body=text_shard("B"))  # a new version, same size
        read += list(texts)
    assert 1 <= len(read) < 6 and set(read) == {b"A" * 4000} and len(read) + stream.skipped[""].lost == 6
    assert "replaced while read (at byte" in caplog.text


def test_credentials_in_an_s3_url_are_not_shown_and_an_invalid_bucket_is_not_retried(s3, caplog):
    url = f"s3://AKIAUSER:s3cr3tPassw0rd@{BUCKET}/cc/00000.tar"
    with caplog.at_level(logging.DEBUG, logger="mmoe.data"), pytest.raises(Exception) as refused:
        ShardStream([url], lambda sample: sample["__key__"], remote=FAST)  # reads the folder's manifest
    assert type(refused.value).__name__ == "ParamValidationError" and "retry" not in caplog.text
    assert "s3cr3t" not in str(refused.value) + caplog.text and "***@corpus" in str(refused.value)
