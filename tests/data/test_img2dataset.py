"""img2dataset / DataComp shard folders as they are: ``mmoe data index`` and reading the indexed folder."""

from __future__ import annotations

import json
import os
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mmoe.data.accounting import describe_skips
from mmoe.data.cli import data_command
from mmoe.data.img2dataset import index_folder
from mmoe.data.shards import resolve_shards
from mmoe.data.streams import ShardStream
from tests.data.img2dataset_layout import PLANTED_CAUSES, PLANTED_KEPT, write_planted


def read_keys(folder, **options) -> tuple[list[str], ShardStream]:
    stream = ShardStream(resolve_shards(str(folder)), lambda sample: sample["__key__"], **options)
    return list(stream), stream


def test_the_index_counts_each_shard_from_its_parquet_and_leaves_samples_out_by_cause(tmp_path, capsys):
    folder = write_planted(tmp_path / "cc")
    assert data_command(["index", str(folder), "--min-side", "32"]) == 0
    printed = json.loads(capsys.readouterr().out)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert printed["skipped_by_cause"] == manifest["skipped_by_cause"] == PLANTED_CAUSES
    assert manifest["shard_files"] == ["00000.tar", "00001.tar"] and manifest["shard_samples"] == [6, 6]
    assert manifest["samples"] == PLANTED_KEPT and manifest["statuses"] == {"failed_to_download": 2}
    assert manifest["counted_from"] == {"00000.tar": "parquet", "00001.tar": "parquet"}
    assert manifest["excluded"] == {
        "00000.tar": {"000000002": "too_small"},
        "00001.tar": {"000010001": "duplicate_uid", "000000000": "duplicate_key"},
    }
    assert "excluded" not in printed


def test_without_parquet_the_tar_headers_and_json_members_give_the_same_index(tmp_path):
    with_parquet = index_folder(write_planted(tmp_path / "a"), min_side=32)
    folder = write_planted(tmp_path / "b")
    for parquet in folder.glob("*.parquet"):
        parquet.unlink()
    from_tars = index_folder(folder, min_side=32)
    assert from_tars["counted_from"] == {"00000.tar": "tar", "00001.tar": "tar"}
    assert from_tars["shard_samples"] == with_parquet["shard_samples"]
    assert from_tars["excluded"] == with_parquet["excluded"]
    # Failed downloads are only in the parquet: without it nothing says they were attempted.
    assert from_tars["skipped_by_cause"] == {**PLANTED_CAUSES, "status": 0}


def test_a_stream_over_an_indexed_folder_reads_the_kept_samples_and_counts_the_rest_by_cause(tmp_path):
    folder = write_planted(tmp_path / "cc")
    index_folder(folder, min_side=32)
    keys, stream = read_keys(folder)
    assert len(keys) == PLANTED_KEPT == len(set(keys))
    assert "000000002" not in keys and "000010001" not in keys
    count = stream.skipped[""]
    assert count.left_out == {cause: n for cause, n in PLANTED_CAUSES.items() if cause != "status"}
    assert count.corrupt == count.lost == 0
    assert "3 left out: 1 duplicate_key, 1 duplicate_uid, 1 too_small" in describe_skips({"train/pair": count})


def test_a_stream_split_by_sample_counts_left_out_samples_once(tmp_path):
    folder = write_planted(tmp_path / "cc")
    index_folder(folder, min_side=32)
    parts = [read_keys(folder, rank=rank, world_size=3) for rank in range(3)]
    assert sorted(key for keys, _ in parts for key in keys) == sorted(read_keys(folder)[0])
    assert sum(sum(stream.skipped.get("", type(stream.skipped)()).left_out.values()) for _, stream in parts
               if stream.skipped) == 3  # fmt: skip


def test_a_key_twice_in_one_shard_is_read_once(tmp_path):
    from tests.data.img2dataset_layout import Attempt, write_shard

    folder = tmp_path / "cc"
    folder.mkdir()
    write_shard(folder, 0, [Attempt(key="k1"), Attempt(key="k2"), Attempt(key="k1")])
    manifest = index_folder(folder, min_side=0)
    assert manifest["skipped_by_cause"]["duplicate_key"] == 1 and manifest["excluded"] == {}
    keys, stream = read_keys(folder)
    assert keys == ["k1", "k2"] and stream.skipped[""].left_out == {"duplicate_key": 1}


def test_a_truncated_shard_counts_its_lost_samples_beside_the_left_out_ones(tmp_path):
    folder = write_planted(tmp_path / "cc")
    tar = folder / "00001.tar"
    with tarfile.open(tar) as archive:
        second = [m for m in archive.getmembers() if m.name.startswith("000010001")][0]
    tar.write_bytes(tar.read_bytes()[: second.offset + 700])  # cut in the second sample: only the first survives
    index_folder(folder, min_side=32)  # the parquet's count stands: what the cut lost is counted when read
    keys, stream = read_keys(folder)
    count = stream.skipped[""]
    assert [key for key in keys if key.startswith("00001")] == ["000010000"]
    assert count.lost == 5 and count.left_out == {"too_small": 1}


@pytest.mark.parametrize(
    "damage, message",
    [
        ("no-status", "00000.parquet: no 'status' column"),
        ("null-key", "00000.parquet: row 1: field 'key' is None, expected a string"),
        ("link", "00001.tar: a shard must be a regular file"),
        ("other-manifest", "manifest.json: exists and is not an img2dataset index"),
        ("empty", "no .tar shards"),
    ],
)
def test_bad_folders_are_one_line_naming_the_file_exit_2(tmp_path, capsys, damage, message):
    folder = write_planted(tmp_path / "cc")
    parquet = folder / "00000.parquet"
    if damage == "no-status":
        pq.write_table(pq.read_table(parquet).drop_columns(["status"]), parquet)
    elif damage == "null-key":
        rows = pq.read_table(parquet).to_pylist()
        rows[1]["key"] = None
        pq.write_table(pa.Table.from_pylist(rows), parquet)
    elif damage == "link":
        (folder / "00001.tar").unlink()
        os.symlink(folder / "00000.tar", folder / "00001.tar")
    elif damage == "other-manifest":
        (folder / "manifest.json").write_text(json.dumps({"name": "x", "samples": 1, "skipped": 0, "shards": 0}))
    else:
        for tar in folder.glob("*.tar"):
            tar.unlink()
    before = (folder / "manifest.json").read_text() if damage == "other-manifest" else None
    assert data_command(["index", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and err.startswith("mmoe data index: error: ")
    if before is not None:
        assert (folder / "manifest.json").read_text() == before
    else:
        assert not (folder / "manifest.json").exists()


def test_a_stream_over_an_indexed_folder_resumes_at_any_batch_with_the_same_batches(tmp_path):
    folder = write_planted(tmp_path / "cc")
    index_folder(folder, min_side=32)

    def stream() -> ShardStream:
        return ShardStream(
            resolve_shards(str(folder)), lambda sample: sample["__key__"], lambda items, rng: list(items), 2,
            shuffle_buffer=4, seed=3,
        )  # fmt: skip

    whole = list(stream().deliveries())
    batches = [delivery.batch for delivery in whole if delivery.batch is not None]
    assert sorted(key for batch in batches for key in batch) == sorted(read_keys(folder)[0])
    for cut in range(1, len(batches)):
        resumed = [d.batch for d in stream().deliveries(whole[cut - 1].position) if d.batch is not None]
        assert resumed == batches[cut:]


def test_a_sample_left_out_claims_no_key_or_uid_a_later_one_has(tmp_path):
    from tests.data.img2dataset_layout import Attempt, write_shard

    folder = tmp_path / "cc"
    folder.mkdir()
    write_shard(folder, 0, [Attempt(status="failed_to_download", uid="U", key="k1"), Attempt(side=8, uid="V")])
    write_shard(folder, 1, [Attempt(uid="U", key="k1"), Attempt(uid="V")])  # the first downloaded U, k1 and V
    manifest = index_folder(folder, min_side=32)
    assert manifest["samples"] == 2 and manifest["skipped_by_cause"] == {
        "status": 1, "duplicate_key": 0, "duplicate_uid": 0, "too_small": 1,
    }  # fmt: skip
    keys, _ = read_keys(folder)
    assert keys == ["k1", "000010001"]


def test_a_key_twice_in_one_shard_after_a_left_out_first_is_still_read_once(tmp_path):
    from tests.data.img2dataset_layout import Attempt, write_shard

    folder = tmp_path / "cc"
    folder.mkdir()
    write_shard(folder, 0, [Attempt(side=8, key="k1"), Attempt(key="k1"), Attempt(key="k2")])
    manifest = index_folder(folder, min_side=32)
    keys, _ = read_keys(folder)
    assert keys == ["k2"] and manifest["samples"] == 1


def _cut_in_third_sample(data: bytes, members: list[tarfile.TarInfo]) -> tuple[bytes, int]:
    third = [member for member in members if member.name.endswith(".jpg")][2]
    return data[: third.offset_data + 100], 2  # inside its image: the two samples before it are whole


def _cut_in_a_header(data: bytes, members: list[tarfile.TarInfo]) -> tuple[bytes, int]:
    third = [member for member in members if member.name.endswith(".jpg")][2]
    return data[: third.offset + 200], 2  # inside the third sample's first header


def _cut_in_last_json(data: bytes, members: list[tarfile.TarInfo]) -> tuple[bytes, int]:
    last_json = [member for member in members if member.name.endswith(".json")][-1]
    return data[: last_json.offset_data + 5], len(members) // 3  # the last sample is read without its json


def _cut_in_first_header(data: bytes, members: list[tarfile.TarInfo]) -> tuple[bytes, int]:
    return data[:200], 0  # a tar img2dataset has just begun


@pytest.mark.parametrize("cut", [_cut_in_third_sample, _cut_in_a_header, _cut_in_last_json, _cut_in_first_header])
def test_a_tar_cut_short_without_parquet_is_indexed_up_to_the_cut_and_named_in_one_line(tmp_path, capsys, cut):
    folder = write_planted(tmp_path / "cc")
    for parquet in folder.glob("*.parquet"):
        parquet.unlink()  # as a folder img2dataset is still writing: the parquet comes when the tar is done
    tar = folder / "00001.tar"
    with tarfile.open(tar) as archive:
        members = archive.getmembers()
    data, whole = cut(tar.read_bytes(), members)
    tar.write_bytes(data)
    assert data_command(["index", str(folder), "--min-side", "32"]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"00001.tar is cut short after {whole} samples" in err
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["shard_samples"] == [6, whole] and list(manifest["cut_shards"]) == ["00001.tar"]
    keys, stream = read_keys(folder)  # the reader reads the samples the index counted, and loses none of them
    count = stream.skipped[""]
    assert len(keys) + sum(count.left_out.values()) == sum(manifest["shard_samples"]) and count.lost == 0


def test_a_shard_whose_name_is_not_utf8_is_indexed_and_read(tmp_path, capsys):
    folder = write_planted(tmp_path / "cc")
    for suffix in (".tar", ".parquet"):
        os.rename(folder / f"00000{suffix}", os.fsencode(folder) + b"/0\xff" + suffix.encode())
    assert data_command(["index", str(folder), "--min-side", "32"]) == 0
    manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    assert sorted(manifest["shard_files"]) == ["00001.tar", "0\udcff.tar"]
    assert manifest["samples"] == PLANTED_KEPT and manifest["skipped_by_cause"] == PLANTED_CAUSES
    keys, _ = read_keys(folder)
    assert len(keys) == PLANTED_KEPT == len(set(keys))


@pytest.mark.parametrize(
    "options, message",
    [
        (["--min-side", "99999999999999999999"], "--min-side must be a pixel count from 0 to 1048576"),
        (["--min-side", "1048577"], "--min-side must be a pixel count from 0 to 1048576"),
        # every image of the planted folder is 40 or 16 pixels wide
        (["--min-side", "41"], "every sample is left out (2 status, 12 too_small; --min-side 41)"),
    ],
)
def test_an_index_that_keeps_no_sample_is_refused_in_one_line_and_writes_nothing(tmp_path, capsys, options, message):
    folder = write_planted(tmp_path / "cc")
    assert data_command(["index", str(folder), *options]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mmoe data index: error: ") and message in err
    assert not (folder / "manifest.json").exists()
