"""BlockManager and readers: every local format, hf:// through `datasets` streaming, block boundaries."""

from __future__ import annotations

import csv
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest_data import sample_texts, write_txt

from shardstream.data.blocks import BlockManager
from shardstream.data.readers import iter_samples, parse_hub
from shardstream.errors import DatasetError

TEXTS = sample_texts(23)


def _write(fmt: str, path):
    if fmt == "txt":
        path.write_text("\n".join(TEXTS[:10]) + "\n\n   \n" + "\n".join(TEXTS[10:]) + "\n")
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(TEXTS)) + "\n")
    elif fmt == "csv":
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, ["id", "text"])
            writer.writeheader()
            writer.writerows({"id": i, "text": t} for i, t in enumerate(TEXTS))
    elif fmt == "parquet":
        pq.write_table(pa.table({"id": list(range(len(TEXTS))), "text": TEXTS}), path, row_group_size=5)
    return path


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "csv", "parquet"])
def test_each_local_format_yields_all_samples_in_order(tmp_path, fmt):
    path = _write(fmt, tmp_path / f"data.{fmt}")
    assert list(iter_samples(str(path))) == TEXTS
    blocks = BlockManager(str(path), tmp_path / "cache", samples_per_block=10, chunk_size=4)
    assert [blocks.block(i).samples for i in range(3)] == [10, 10, 3]
    assert blocks.chunk(1, 2) == TEXTS[18:20]
    assert blocks.chunk(2, 0) == TEXTS[20:]


def test_folder_reads_files_in_path_order(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    _write("jsonl", folder / "b.jsonl")
    _write("txt", folder / "sub" / "a.txt")
    (folder / "notes.md").write_text("ignored\n")
    assert list(iter_samples(str(folder))) == TEXTS + TEXTS


def test_last_block_and_total_are_known_at_the_end(tmp_path):
    path = write_txt(tmp_path / "a.txt", 30)
    blocks = BlockManager(str(path), tmp_path / "cache", samples_per_block=10, chunk_size=3)
    first = blocks.block(0)
    assert (first.samples, first.is_last, first.chunk_count(3)) == (10, False, 4)
    assert blocks.total_blocks is None
    # Exactly three full blocks: the last one must still be flagged, with no empty fourth block.
    assert blocks.block(2).is_last and blocks.total_blocks == 3
    assert blocks.block(3) is None


def test_blocks_are_cached_on_disk_and_shared(tmp_path):
    path = write_txt(tmp_path / "a.txt", 25)
    first = BlockManager(str(path), tmp_path / "cache", samples_per_block=10, chunk_size=5)
    first.block(2)
    other = BlockManager(str(path), tmp_path / "cache", samples_per_block=10, chunk_size=5)
    assert other.dir == first.dir and other.total_blocks == 3  # known from the cache, before any read
    assert other.chunk(2, 0) == sample_texts(25)[20:]
    assert len(list(other.dir.glob("block_*.parquet"))) == 3
    with path.open("a") as f:
        f.write("one more sample\n")
    assert BlockManager(str(path), tmp_path / "cache", samples_per_block=10, chunk_size=5).dir != first.dir


def test_hub_source_streams_through_datasets(tmp_path):
    data = tmp_path / "hub_dataset" / "data"
    data.mkdir(parents=True)
    _write("jsonl", data / "train-00000.jsonl")
    source = f"hf://{tmp_path / 'hub_dataset'}::train"
    blocks = BlockManager(source, tmp_path / "cache", samples_per_block=8, chunk_size=3)
    assert blocks.block(2).is_last and blocks.total_blocks == 3
    assert blocks.chunk(1, 1) == TEXTS[11:14]


def test_hub_name_parsing():
    assert parse_hub("hf://wikitext:wikitext-2-raw-v1:train").config == "wikitext-2-raw-v1"
    assert parse_hub("hf://stas/openwebtext-10k").split == "train"
    with pytest.raises(DatasetError, match="hf://name:config:split"):
        parse_hub("hf://a:b:c:d")


def test_bad_sources_name_the_file_and_the_fix(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        list(iter_samples(str(tmp_path / "missing.txt")))
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(DatasetError, match="--text-field"):
        list(iter_samples(str(path)))
    path.write_text("{not json\n")
    with pytest.raises(DatasetError, match="line 1 is not JSON"):
        list(iter_samples(str(path)))
    # a record far into the file without the field is located; a field that holds no text is said to be so
    path.write_text("".join(json.dumps({"text": f"sample {i}", "id": i}) + "\n" for i in range(150))
                    + json.dumps({"content": "late"}) + "\n")
    with pytest.raises(DatasetError, match=f"dataset {path} line 151 has no 'text' field; pass --text-field with one "
                                           r"of \['content'\]"):
        list(iter_samples(str(path)))
    with pytest.raises(DatasetError, match=f"dataset {path} line 1: field 'id' holds int 0, not text; pass --text-field "
                                           r"with a field of text, one of \['id', 'text'\]"):   # an AttributeError
        list(iter_samples(str(path), "id"))
    path = tmp_path / "a.csv"
    path.write_text("text,n\nfirst,1\n")
    with pytest.raises(DatasetError, match=f"dataset {path} line 2 has no 'body' field"):
        list(iter_samples(str(path), "body"))
