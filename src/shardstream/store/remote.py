"""A store served over HTTP(S): the manifest once, then only the bytes asked for, by Range reads.

Same interface as the local `Store`, so the streaming runtime and `shard` need not care where the
bytes come from. A whole file is always checked against its checksum before use, because over a
network nothing else guarantees it; a single tensor read by Range is checked against its length.
"""

from __future__ import annotations

from pathlib import PurePosixPath

import httpx

from ..errors import InvalidOption, SourceUnreachable, StoreCorrupt, StoreIncomplete
from .checksum import checksum_bytes
from .manifest import MANIFEST_NAME, Manifest, TensorRecord, json_object
from .reader import Store


class RemoteStore(Store):
    """A store at an http(s) base URL (ending in "/"); every read goes through `read_bytes`."""

    remote = True

    def __init__(self, url: str, manifest: Manifest, client: httpx.Client):
        super().__init__(url, manifest)
        self.root = url   # messages name the URL, not a local path
        self.client = client

    def read_bytes(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes [offset, offset+length) of one file (all of it when length is None)."""
        return _get(self.client, self.root + name, offset, length)

    def file_path(self, name: str) -> str:
        """A manifest file's path below the URL: relocated parts are under their tier's folder,
        which must then be inside the store."""
        placed = self._part_tier(name)
        if placed is None:
            return name
        index, tier = placed
        root = index.tiers[tier]["root"]
        if PurePosixPath(root).is_absolute():
            raise InvalidOption(f"part {name.rpartition('/')[0]} is on tier {tier!r} at {root}, outside the store; "
                                "relocate it to a tier inside the store to serve it over HTTP.")
        return str(PurePosixPath(root) / name)

    def read_raw(self, name: str, offset: int = 0, length: int | None = None) -> bytearray:
        return bytearray(self.read_bytes(name, offset, length))

    def file_version(self, name: str) -> None:
        """None: a remote store's files are read once per open (nothing to compare against)."""
        return None

    def read_file(self, name: str, verify: bool = True) -> bytearray:
        """One whole store file, always checksum-verified (the `verify` flag is kept for the interface)."""
        data = self.read_bytes(self.file_path(name))
        if checksum_bytes(data) != self.manifest.files[name].xxh3_128:
            raise StoreCorrupt(f"{self.root}{name} fails its checksum; re-upload the store and do not use this file.")
        return bytearray(data)

    def read_tensor_bytes(self, record: TensorRecord) -> bytearray:
        spans = [(record.offset, record.length)]
        if record.quant:
            spans.append((record.quant["absmax"]["offset"], record.quant["absmax"]["length"]))
        begin = min(o for o, _ in spans)
        buffer = bytearray(max(o + n for o, n in spans) - begin)
        for offset, length in spans:   # codes and scales may sit far apart: fetch only those bytes
            buffer[offset - begin: offset - begin + length] = self.read_bytes(self.file_path(record.file), offset, length)
        return buffer


def open_remote_store(url: str, *, allow_incomplete: bool = False, timeout: float = 30.0) -> RemoteStore:
    """Fetch and verify manifest.json from `url` (a folder URL; a trailing slash is added)."""
    url = url if url.endswith("/") else url + "/"
    client = httpx.Client(timeout=timeout)
    body = json_object(_get(client, url + MANIFEST_NAME), url + MANIFEST_NAME, "re-upload the store")
    manifest = Manifest.from_dict(body, url + MANIFEST_NAME)
    if not manifest.complete and not allow_incomplete:
        raise StoreIncomplete(f"the store at {url} is incomplete; finish `shardstream convert` before serving it.")
    return RemoteStore(url, manifest, client)


def _get(client: httpx.Client, url: str, offset: int = 0, length: int | None = None) -> bytes:
    headers = {} if length is None else {"Range": f"bytes={offset}-{offset + length - 1}"}
    try:
        response = client.get(url, headers=headers)
    except httpx.HTTPError as exc:
        raise SourceUnreachable(f"{url} could not be fetched ({exc}); check the server and retry.") from None
    if response.status_code == 404:
        raise StoreIncomplete(f"{url} does not exist on the server; re-upload the store.")
    if response.status_code != (200 if length is None else 206):
        raise SourceUnreachable(
            f"{url} answered HTTP {response.status_code} to a{' Range' if length else ''} request; "
            "serve the store from a server that supports Range requests."
        )
    data = response.content
    if length is not None and len(data) != length:
        raise StoreCorrupt(f"{url} returned {len(data)} bytes where {length} were asked; re-upload the store.")
    return data
