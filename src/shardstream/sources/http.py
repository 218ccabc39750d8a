"""A checkpoint behind a plain HTTP(S) base URL, downloaded one shard at a time.

Downloads stream into `<name>.part` and resume with a Range request, so a dropped connection or an
interrupted run costs only the bytes not yet received; a shard is renamed into place only after its
size and header check out.
"""

from __future__ import annotations

import json
import os
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

import httpx
from tqdm import tqdm

from shardstream.errors import SourceNotFound, SourceUnreachable
from shardstream.safetensors_header import MAX_HEADER_BYTES, HeaderError, parse_header
from shardstream.sources.base import INDEX_FILE
from shardstream.sources.remote import RemoteSource

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
CHUNK_BYTES = 1 << 20
IDENTITY = {"Accept-Encoding": "identity"}  # sizes must be the file's, not a compressed body's
HEADER_GUESS = 64 * 1024   # first request for a shard's header; most fit, a longer one takes a second


class HttpSource(RemoteSource):
    """`https://host/models/tiny/` holding config.json, the index and the shards."""

    def __init__(
        self,
        base_url: str,
        staging_dir: Path,
        *,
        token: str | None = None,
        progress: bool = True,
        retries: int = 4,
        backoff: float = 0.5,
        timeout: float = 30.0,
    ) -> None:
        base_url = base_url if base_url.endswith("/") else base_url + "/"
        super().__init__(base_url, staging_dir, progress)
        self.base_url = base_url
        self.retries = retries
        self.backoff = backoff
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = httpx.Timeout(timeout, connect=min(timeout, 10.0))

    def url(self, name: str) -> str:
        return self.base_url + quote(name)

    def identity(self) -> tuple[str, dict]:
        return self.base_url, {"shards": {name: [self.shard_size(name)] for name in self.shard_names()}}

    def _published_sha256(self, name: str) -> str | None:
        """From the index's optional `"sha256": {shard: hex}`, else a `<shard>.sha256` file
        (sha256sum's format: the hex digest first)."""
        index = self._read_file(INDEX_FILE)
        if index is not None:
            published = json.loads(index).get("sha256")
            if isinstance(published, dict) and isinstance(published.get(name), str):
                return published[name]
        sidecar = self._read_file(name + ".sha256")
        words = sidecar.decode(errors="replace").split() if sidecar else []
        return words[0] if words else None

    def _read_file(self, name: str) -> bytes | None:
        with self._open("GET", name, missing_ok=True) as response:
            return None if response is None else response.read()

    def _has_file(self, name: str) -> bool:
        with self._open("HEAD", name, missing_ok=True) as response:
            return response is not None

    def _size(self, name: str) -> int | None:
        with self._open("HEAD", name, IDENTITY) as response:
            return _int_header(response, "Content-Length")

    def _tensor_shapes(self, name: str) -> dict[str, list[int]] | None:
        """Read just the header: ask for the file's first bytes (a server without Range support
        streams the file, and the connection is dropped once the header has arrived)."""
        got = self._first_bytes(name, HEADER_GUESS)
        if got is None:
            return None
        prefix, size = got
        if len(prefix) >= 8:
            needed = 8 + struct.unpack("<Q", prefix[:8])[0]
            if len(prefix) < needed <= 8 + MAX_HEADER_BYTES:
                prefix, size = self._first_bytes(name, needed)
        if size is None:
            raise self._corrupt(name, "the server sent no Content-Length", "serve it with a size and run again.")
        try:
            return {n: list(e.shape) for n, e in parse_header(bytes(prefix), size).tensors.items()}
        except HeaderError as exc:
            raise self._corrupt(name, str(exc), f"replace {self.url(name)} with a good copy.") from None

    def _first_bytes(self, name: str, count: int) -> tuple[bytearray, int | None] | None:
        """Up to `count` bytes from the start of the file and the file's size; None if it is absent."""
        with self._open("GET", name, {**IDENTITY, "Range": f"bytes=0-{count - 1}"}, missing_ok=True) as response:
            if response is None:
                return None
            size = _content_range(response)[1] if response.status_code == 206 else _int_header(response, "Content-Length")
            prefix = bytearray()
            for chunk in response.iter_bytes(64 * 1024):
                prefix += chunk
                if len(prefix) >= count:
                    break
        return prefix[:count], size

    def _download(self, name: str) -> Path:
        final = self.staged_path(name)
        part = final.with_name(final.name + ".part")
        failures = 0
        while True:
            try:
                if self._download_once(name, part):
                    return part
            except httpx.TransportError as exc:  # dropped mid-transfer: resume from what arrived
                failures += 1
                if failures > self.retries:
                    raise SourceUnreachable(
                        f"the download of {self.url(name)} kept failing ({exc!r}); run again to resume it."
                    ) from None
                time.sleep(self.backoff * 2 ** (failures - 1))

    def _download_once(self, name: str, part: Path) -> bool:
        """One GET that appends to `part`; False when a stale partial file had to be discarded."""
        offset = part.stat().st_size if part.is_file() else 0
        headers = {**IDENTITY, "Range": f"bytes={offset}-"} if offset else IDENTITY
        with self._open("GET", name, headers, allow=(416,)) as response:
            start, total = _content_range(response)
            resumed = response.status_code == 206 and start == offset
            if offset and not resumed and response.status_code != 200:
                part.unlink()  # 416 or an unexpected range: the partial file is no prefix of this one
                return False
            if not resumed:
                offset = 0  # a server that ignores Range sends the whole file: start over
                total = _int_header(response, "Content-Length")
            with open(part, "ab" if offset else "wb") as out, self._progress_bar(name, total, offset) as bar:
                for chunk in response.iter_bytes(CHUNK_BYTES):
                    out.write(chunk)
                    bar.update(len(chunk))
                out.flush()
                os.fsync(out.fileno())
        size = part.stat().st_size
        if total is not None and size != total:
            part.unlink()
            raise self._corrupt(
                name, f"got {size} bytes, the server announced {total}", "run again to download it afresh."
            )
        return True

    @contextmanager
    def _open(
        self,
        method: str,
        name: str,
        headers: dict[str, str] | None = None,
        *,
        missing_ok: bool = False,
        allow: tuple[int, ...] = (),
    ) -> Iterator[httpx.Response | None]:
        """A streamed response with its status checked (None for a 404 when missing_ok), closed after.

        Each call has its own client, closed with the response: a source has no close() to call, and
        its few requests gain nothing from a pool whose sockets would outlive it.
        """
        url = self.url(name)
        with httpx.Client(headers=self._headers, timeout=self._timeout, follow_redirects=True) as client:
            response = self._send(client, method, url, headers)
            try:
                if response.status_code == 404 and missing_ok:
                    yield None
                    return
                if response.status_code == 404:
                    raise SourceNotFound(
                        f"{url} does not exist (HTTP 404); check the base URL and that it holds {name}."
                    )
                if response.status_code >= 400 and response.status_code not in allow:
                    raise SourceUnreachable(
                        f"{url} answered HTTP {response.status_code}; "
                        "check the URL and the access token, then run again."
                    )
                yield response
            finally:
                response.close()

    def _send(self, client: httpx.Client, method: str, url: str, headers: dict[str, str] | None) -> httpx.Response:
        """Send with retries and exponential backoff on connection errors and transient statuses."""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                response = client.send(client.build_request(method, url, headers=headers), stream=True)
            except httpx.TransportError as exc:
                problem = repr(exc)
                continue
            if response.status_code not in RETRY_STATUSES:
                return response
            response.close()
            problem = f"HTTP {response.status_code}"
        raise SourceUnreachable(
            f"could not get {url} after {self.retries + 1} attempts ({problem}); "
            "check the URL and your connection, then run again."
        )

    def _progress_bar(self, name: str, total: int | None, initial: int) -> tqdm:
        """Byte progress; hidden when disabled, and (tqdm's disable=None) when stderr is not a TTY."""
        return tqdm(
            desc=name, total=total, initial=initial, unit="B", unit_scale=True, unit_divisor=1024,
            leave=False, disable=None if self.progress else True,
        )


def _int_header(response: httpx.Response, key: str) -> int | None:
    value = response.headers.get(key)
    return int(value) if value is not None and value.isdigit() else None


def _content_range(response: httpx.Response) -> tuple[int | None, int | None]:
    """First byte and total size of a `Content-Range: bytes a-b/total` answer (None if absent)."""
    unit, _, spec = response.headers.get("Content-Range", "").partition(" ")
    span, _, total = spec.partition("/")
    start = span.split("-", 1)[0]
    if unit != "bytes":
        return None, None
    return (int(start) if start.isdigit() else None), (int(total) if total.isdigit() else None)
