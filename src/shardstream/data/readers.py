"""Turn a dataset source into one stream of text samples, in a fixed order.

The order must be the same on every machine and every run: block and chunk numbers in the tracker
are positions in this stream. Empty and whitespace-only samples are skipped everywhere, so they
never count towards a block.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from shardstream.errors import DatasetError

LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet", ".csv")


@dataclass(frozen=True)
class HubSource:
    """`hf://name:config:split`: anything `datasets.load_dataset` accepts as a name, streamed."""

    name: str
    config: str | None
    split: str


def parse_hub(source: str) -> HubSource:
    """Parse `hf://name[:config[:split]]`; the split defaults to `train`."""
    parts = source.removeprefix("hf://").split(":")
    if not parts[0] or len(parts) > 3:
        raise DatasetError(f"dataset {source!r} is not hf://name:config:split; write it as hf://wikitext:wikitext-2-raw-v1:train.")
    parts += [""] * (3 - len(parts))
    return HubSource(parts[0], parts[1] or None, parts[2] or "train")


def local_files(source: str) -> list[Path]:
    """The files of a local source, sorted by path so every machine reads them in one order."""
    path = Path(source)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in LOCAL_SUFFIXES)
        if not files:
            raise DatasetError(f"dataset folder {source} has no {', '.join(LOCAL_SUFFIXES)} files; point --dataset-file at a folder or file with samples.")
        return files
    if not path.is_file():
        raise DatasetError(f"dataset file {source} does not exist; check the --dataset-file path.")
    if path.suffix not in LOCAL_SUFFIXES:
        raise DatasetError(f"dataset file {source} has an unsupported suffix; use one of {', '.join(LOCAL_SUFFIXES)}.")
    return [path]


def _field(record: dict, text_field: str, where: Path | str) -> str | None:
    """A record's text; `where` (the file, and the line where there is one) names a record without it."""
    if text_field not in record:
        raise DatasetError(f"dataset {where} has no {text_field!r} field; pass --text-field with one of {sorted(record)}.")
    text = record[text_field]
    if text is not None and not isinstance(text, str):
        raise DatasetError(f"dataset {where}: field {text_field!r} holds {type(text).__name__} {text!r:.40}, not text; "
                           f"pass --text-field with a field of text, one of {sorted(record)}.")
    return text


def _read_txt(path: Path, text_field: str) -> Iterator[str]:
    with path.open(encoding="utf-8") as f:
        yield from f


def _read_jsonl(path: Path, text_field: str) -> Iterator[str]:
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"dataset file {path} line {number} is not JSON ({e.msg}); fix or remove that line.") from None
            yield record if isinstance(record, str) else _field(record, text_field, f"{path} line {number}")


def _read_csv(path: Path, text_field: str) -> Iterator[str]:
    with path.open(encoding="utf-8", newline="") as f:
        for number, record in enumerate(csv.DictReader(f), 2):   # line 1 names the columns
            yield _field(record, text_field, f"{path} line {number}")


def _read_parquet(path: Path, text_field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    reader = pq.ParquetFile(path)
    if text_field not in reader.schema_arrow.names:
        raise DatasetError(f"dataset {path} has no {text_field!r} column; pass --text-field with one of {reader.schema_arrow.names}.")
    for batch in reader.iter_batches(columns=[text_field], batch_size=8192):
        yield from batch.column(0).to_pylist()


_READERS = {".txt": _read_txt, ".jsonl": _read_jsonl, ".csv": _read_csv, ".parquet": _read_parquet}


def _read_hub(hub: HubSource, text_field: str) -> Iterator[str]:
    import datasets

    from shardstream.sources.hub import check_hub_reachable

    if not Path(hub.name).exists():   # a local dataset folder needs no Hub
        check_hub_reachable(f"dataset hf://{hub.name}")
    try:
        stream = datasets.load_dataset(hub.name, hub.config, split=hub.split, streaming=True)
    except Exception as e:  # datasets raises many unrelated types for "not found"/"no network"
        raise DatasetError(f"dataset hf://{hub.name} could not be opened ({e}); check the name, config and split, and network access.") from None
    for record in stream:
        yield _field(record, text_field, f"hf://{hub.name}")


def iter_samples(source: str, text_field: str = "text") -> Iterator[str]:
    """Every non-empty sample of `source` (local file, folder or hf:// name), in stream order."""
    if source.startswith("hf://"):
        raw = _read_hub(parse_hub(source), text_field)
    else:
        raw = (text for path in local_files(source) for text in _READERS[path.suffix](path, text_field))
    for text in raw:
        if text is not None and text.strip():
            yield text.rstrip("\n")
