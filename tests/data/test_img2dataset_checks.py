"""An indexed img2dataset folder whose shards, parquets and manifest disagree: refused in one line, never read wrong."""

from __future__ import annotations

import json
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mmoe.data.cli import data_command
from mmoe.data.converters.common import ConversionError
from mmoe.data.img2dataset import index_folder, not_downloaded
from mmoe.data.shards import resolve_shards
from mmoe.data.streams import ShardStream
from tests.data.img2dataset_layout import Attempt, write_planted, write_shard


def read_keys(folder) -> list[str]:
    return list(ShardStream(resolve_shards(str(folder)), lambda sample: sample["__key__"]))


def _add_shard(folder):
    shutil.copy(folder / "00001.tar", folder / "00002.tar")
    shutil.copy(folder / "00001.parquet", folder / "00002.parquet")
    return "00002.tar"


def _replace_shard(folder):
    write_shard(folder, 1, [Attempt(), Attempt(), Attempt(), Attempt(), Attempt()])
    return "00001.tar"


def _touch_shard(folder):
    stat = os.stat(folder / "00000.tar")
    os.utime(folder / "00000.tar", ns=(stat.st_atime_ns, stat.st_mtime_ns + 5_000_000_000))
    return "00000.tar"


def _remove_shard(folder):
    (folder / "00001.tar").unlink()
    return "00001.tar"


def _add_oddly_named_shard(folder):
    shutil.copy(folder / "00001.tar", folder / "extra.tar")
    return "extra.tar"


@pytest.mark.parametrize("change", [_add_shard, _replace_shard, _touch_shard, _remove_shard, _add_oddly_named_shard])
def test_a_shard_changed_after_indexing_is_refused_naming_the_folder_and_the_shard(tmp_path, change):
    folder = write_planted(tmp_path / "cc")
    index_folder(folder, min_side=32)
    assert len(read_keys(folder)) == 9
    shard = change(folder)
    with pytest.raises(ValueError) as error:
        resolve_shards(str(folder))
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"{folder}: ") and shard in message
    index_folder(folder, min_side=32)
    assert resolve_shards(str(folder))  # indexed again, the folder is read


def _rewrite_parquet(path, keep):
    rows = pq.read_table(path).to_pylist()
    pq.write_table(pa.Table.from_pylist(keep(rows), schema=pq.read_schema(path)), path)


def _drop_two_successes(rows):
    successes = [index for index, row in enumerate(rows) if row["status"] == "success"]
    return [row for index, row in enumerate(rows) if index not in successes[-2:]]


def _other_keys(rows):
    return [{**row, "key": "zz" + row["key"]} for row in rows]


@pytest.mark.parametrize(
    "keep, key",
    [(_drop_two_successes, "000010005"), (lambda rows: [], "000010000"), (_other_keys, "000010000")],
    ids=["tar-holds-more", "empty-parquet", "other-keys"],
)
def test_a_tar_sample_its_parquet_does_not_list_is_refused_in_one_line(tmp_path, capsys, keep, key):
    folder = write_planted(tmp_path / "cc")
    _rewrite_parquet(folder / "00001.parquet", keep)
    assert data_command(["index", str(folder), "--min-side", "32"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "00001.tar" in err and key in err and "00001.parquet" in err
    assert not (folder / "manifest.json").exists()


def test_tar_samples_the_parquet_marks_failed_are_left_out_by_status_when_read(tmp_path):
    folder = write_planted(tmp_path / "cc")
    marked = {"000000003": "failed_to_download", "000000005": "success ", "000000006": "SUCCESS"}
    _rewrite_parquet(
        folder / "00000.parquet",
        lambda rows: [{**row, "status": marked.get(row["key"], row["status"])} for row in rows],
    )  # noqa: E501
    manifest = index_folder(folder, min_side=32)
    keys = read_keys(folder)
    assert not set(marked) & set(keys)
    assert len(keys) == len(set(keys)) == manifest["samples"]
    assert {manifest["excluded"]["00000.tar"][key] for key in marked} == {"status"}


def test_a_key_repeated_in_a_later_shard_is_read_once_whatever_order_the_parquet_lists_it(tmp_path):
    folder = tmp_path / "cc"
    folder.mkdir()
    write_shard(folder, 0, [Attempt(key="a0"), Attempt(key="a1"), Attempt(key="a2")])
    write_shard(folder, 1, [Attempt(key="b0"), Attempt(key="a0"), Attempt(key="a1")])
    _rewrite_parquet(folder / "00001.parquet", lambda rows: rows[::-1])
    manifest = index_folder(folder, min_side=1)
    keys = read_keys(folder)
    assert sorted(keys) == ["a0", "a1", "a2", "b0"] and manifest["samples"] == 4


def _sizes(value):
    def keep(rows):
        return [{**row, "width": value, "height": value} if row["status"] == "success" else row for row in rows]

    return keep


def test_sizes_given_as_numeric_strings_are_filtered_by_min_side(tmp_path):
    folder = write_planted(tmp_path / "cc")
    for parquet in folder.glob("*.parquet"):
        rows = pq.read_table(parquet).to_pylist()
        rows = [{**row, "width": str(row["width"]), "height": f" {row['height']}.0"} for row in rows if row["width"]]
        pq.write_table(pa.Table.from_pylist(rows), parquet)
    manifest = index_folder(folder, min_side=32)
    assert manifest["skipped_by_cause"]["too_small"] == 1
    with pytest.raises(ConversionError, match=r"every sample is left out \(12 too_small; --min-side 64\)"):
        index_folder(folder, min_side=64)  # none claims a key


@pytest.mark.parametrize("value", ["ten", "inf", "-5", float("inf"), 1e300, -5.0])
def test_a_size_that_is_not_a_pixel_count_is_one_line_naming_the_file_row_and_field(tmp_path, capsys, value):
    folder = write_planted(tmp_path / "cc")
    rows = pq.read_table(folder / "00000.parquet").to_pylist()
    kind = str if isinstance(value, str) else float
    widths = pa.array([value] + [None if row["width"] is None else kind(row["width"]) for row in rows[1:]])
    table = pa.Table.from_pylist(rows).drop_columns(["width"]).append_column("width", widths)
    pq.write_table(table, folder / "00000.parquet")
    assert data_command(["index", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "00000.parquet: row 0: field 'width'" in err


def test_min_side_reads_the_original_sides_img2dataset_resized_away(tmp_path, capsys):
    # img2dataset --image_size 64: every stored image is 64 px; the 25- and 48-px originals are too small.
    folder = tmp_path / "cc"
    folder.mkdir()
    write_shard(
        folder, 0, [Attempt(side=64, original=25), Attempt(side=64, original=300), Attempt(side=64, original=48)]
    )
    assert data_command(["index", str(folder), "--min-side", "32"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["skipped_by_cause"]["too_small"] == 1 and printed["samples"] == 2
    assert printed["sides_read_from"] == {"original_width/original_height": 3}
    (folder / "00000.parquet").unlink()  # the tar's json members say the same
    assert index_folder(folder, min_side=64)["excluded"] == {
        "00000.tar": {"000000000": "too_small", "000000002": "too_small"}
    }


def test_without_original_sides_min_side_reads_width_and_height_and_says_so(tmp_path):
    folder = tmp_path / "cc"
    folder.mkdir()
    write_shard(folder, 0, [Attempt(side=20, original=300), Attempt(side=64)])
    parquet = folder / "00000.parquet"
    pq.write_table(pq.read_table(parquet).drop_columns(["original_width", "original_height"]), parquet)
    manifest = index_folder(folder, min_side=32)
    assert manifest["excluded"] == {"00000.tar": {"000000000": "too_small"}}
    assert manifest["sides_read_from"] == {"width/height": 2}


def test_the_failed_download_line_counts_only_samples_the_tars_never_held(tmp_path):
    folder = write_planted(tmp_path / "cc")
    table = pq.read_table(folder / "00000.parquet").to_pylist()
    table[0]["status"] = "failed_to_resize"  # a tar sample its parquet marks failed: read, and left out by status
    pq.write_table(pa.Table.from_pylist(table), folder / "00000.parquet")
    manifest = index_folder(folder, min_side=32)
    assert manifest["statuses"] == {"failed_to_download": 2, "failed_to_resize": 1}
    assert manifest["not_in_tars"] == {"failed_to_download": 2}
    line = not_downloaded(str(folder))
    assert "2 of the 14 samples img2dataset tried (14.3%) are not in its tars (2 failed_to_download;" in line
    for parquet in folder.glob("*.parquet"):  # indexed from the tars' json alone: every sample is in a tar
        parquet.unlink()
    index_folder(folder, min_side=32)
    assert not_downloaded(str(folder)) is None
