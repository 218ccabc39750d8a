"""An agent fetching a packaged stage over HTTP into its cache, checking every file as it streams.

Each file is streamed to a temp file while being hashed and only renamed into place when its size
and xxh3-128 match `stage.json`; a mismatch or a broken connection is retried, then refused. The
cache folder is named by the stage id and counts as complete once its `stage.json` is written.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import httpx
import xxhash

from ..atomic import TEMP_PREFIX, fsync_dir, write_bytes_atomic
from ..errors import SourceUnreachable, StoreCorrupt
from ..store.checksum import checksum_bytes
from ..store.manifest import check_relative
from .package import STAGE_MANIFEST

ATTEMPTS = 3
CHUNK = 1 << 20


def fetch_stage(url: str, stage_id: str, cache: Path, client: httpx.Client) -> tuple[Path, int]:
    """The cached stage folder and how many bytes were downloaded (0 when it was cached)."""
    url = url if url.endswith("/") else url + "/"
    folder = Path(cache) / stage_id
    if (folder / STAGE_MANIFEST).is_file():
        return folder, 0
    body = _get(client, url + STAGE_MANIFEST)
    if checksum_bytes(body) != stage_id:
        raise StoreCorrupt(f"{url}{STAGE_MANIFEST} does not match stage id {stage_id}; re-package the stage.")
    files = json.loads(body)["files"]
    downloaded = 0
    for name, record in files.items():
        check_relative(name, url + STAGE_MANIFEST)
        downloaded += _fetch_file(client, url + name, folder / name, record)
    write_bytes_atomic(folder / STAGE_MANIFEST, body)
    return folder, downloaded


def remove_stage(cache: Path, stage_id: str) -> None:
    shutil.rmtree(Path(cache) / stage_id, ignore_errors=True)


def _fetch_file(client: httpx.Client, url: str, target: Path, record: dict) -> int:
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = target.with_name(TEMP_PREFIX + target.name)
    problem = ""
    for _ in range(ATTEMPTS):
        try:
            size, digest = _stream_to(client, url, temp)
        except httpx.HTTPError as error:
            problem = f"the download broke off ({error})"
            continue
        if (size, digest) == (record["size"], record["xxh3_128"]):
            temp.replace(target)
            fsync_dir(target.parent)
            return size
        problem = f"it arrived as {size} bytes with checksum {digest}, not {record['size']} bytes with {record['xxh3_128']}"
    temp.unlink(missing_ok=True)
    raise StoreCorrupt(f"{url} failed {ATTEMPTS} downloads: {problem}; re-package the stage from a verified store.")


def _stream_to(client: httpx.Client, url: str, path: Path) -> tuple[int, str]:
    hasher, size = xxhash.xxh3_128(), 0
    with client.stream("GET", url) as response, open(path, "wb") as out:
        _check(response, url)
        for chunk in response.iter_bytes(CHUNK):
            hasher.update(chunk)
            out.write(chunk)
            size += len(chunk)
        out.flush()
        os.fsync(out.fileno())   # durable before the caller renames it into place
    return size, hasher.hexdigest()


def _get(client: httpx.Client, url: str) -> bytes:
    try:
        response = client.get(url)
    except httpx.HTTPError as error:
        raise SourceUnreachable(f"{url} could not be fetched ({error}); check that the coordinator serves it.") from None
    _check(response, url)
    return response.content


def _check(response: httpx.Response, url: str) -> None:
    if response.status_code != 200:
        raise SourceUnreachable(f"{url} answered HTTP {response.status_code}; check the coordinator's stage server and token.")
