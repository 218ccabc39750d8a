"""From what the user names (Hub id, URL, checkpoint folder or store) to an open, complete store.

The cache (~/.cache/shardstream/<slug>, or $SHARDSTREAM_CACHE) is keyed by what the source *is*,
not by how it was typed: a folder's resolved absolute path, a URL, or a Hub id with its revision;
and by the compression asked for, so a 4-bit copy lives beside the plain one. A cached store whose
local source has changed since (shard sizes or dates) is converted again. A store the user names is
never silently used with another compression than the one asked for.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
from dataclasses import replace
from pathlib import Path

from ..convert import check_same_source, convert
from ..interrupted import rerun_continues
from ..errors import InvalidOption, StoreIncomplete
from ..options import ConversionOptions
from ..switches import CACHE
from ..sources import HUB_ID, LocalSource
from ..store import MANIFEST_NAME, Manifest, Store, load_manifest, open_store
from ..tp.rankstore import rank_share

log = logging.getLogger("shardstream.resolve")


def source_key(source: str, conversion: ConversionOptions = ConversionOptions()) -> str:
    """A folder's resolved absolute path, a URL as given, or `hf://id@revision` (the conversion's)."""
    if source.startswith(("http://", "https://")):
        return source.rstrip("/") + "/"
    path = Path(source).expanduser()
    hub_id = source.removeprefix("hf://")
    if source.startswith("hf://") or (not path.exists() and HUB_ID.fullmatch(hub_id)):
        return f"hf://{hub_id}@{conversion.revision or 'main'}"
    return str(path.resolve())


def default_store_path(source: str, conversion: ConversionOptions = ConversionOptions()) -> Path:
    """~/.cache/shardstream/<name>[-<compression>]-<hash of the source key and compression> (or under
    $SHARDSTREAM_CACHE); an uncompressed store's key leaves compression out, so that stores already
    converted into the cache keep their path."""
    base = Path(CACHE.get() or Path.home() / ".cache" / "shardstream")
    key = source_key(str(source), conversion)
    name = re.sub(r"[^A-Za-z0-9._-]+", "--", key.rstrip("/").rsplit("/", 1)[-1]).strip("-.") or "model"
    if conversion.compression:
        key, name = f"{key}#{conversion.compression}", f"{name}-{conversion.compression}"
    return base / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def ensure_store(source: str | os.PathLike, conversion: ConversionOptions = ConversionOptions(),
                 **convert_options) -> Store:
    """Open the store (`conversion.store_path`, else the cache's), converting `source` into it first with
    `conversion` (and convert()'s `convert_options`) when it is missing or unfinished.

    `source` may itself be a store folder; an unfinished one is finished from the source its
    manifest records, with the compression it records unless another is asked for.
    """
    source = str(source)
    store_path = conversion.store_path
    given_store = (Path(source) / MANIFEST_NAME).is_file() and (
        store_path is None or Path(store_path).expanduser().resolve() == Path(source).expanduser().resolve())
    if given_store:
        manifest = load_manifest(Path(source))
        _refuse_rank_share(source, manifest)
        conversion = replace(conversion, store_path=source, compression=conversion.compression or manifest.compression)
        source = manifest.source or source
    cached = conversion.store_path is None
    path = default_store_path(source, conversion) if cached else Path(conversion.store_path)
    if (path / MANIFEST_NAME).is_file() and not cached:
        _check_compression(path, conversion.compression)
    if (path / MANIFEST_NAME).is_file() and not given_store:
        _check_recorded_source(path, source, cached)
    try:
        return open_store(path)
    except StoreIncomplete:
        if Path(source).resolve() == path.resolve():
            raise
        if given_store:
            _refuse_lost_source(path, source)
            log.warning("the store at %s is unfinished; finishing its conversion from %s.", path, source)
    with rerun_continues():   # a Ctrl-C now leaves a conversion that the same command continues
        convert(source, path, conversion=conversion, **convert_options)
    return open_store(path)


def _refuse_lost_source(path: Path, source: str) -> None:
    """An unfinished store whose recorded checkpoint folder is gone: said as such, not as a checkpoint the
    user never named."""
    if Path(source).is_absolute() and not Path(source).exists():
        raise StoreIncomplete(
            f"the store at {path} is unfinished, and {source}, the checkpoint it was being converted from, is not "
            f"there any more; run `shardstream convert CHECKPOINT {path}` with the checkpoint's new place to "
            "finish it.")


def _refuse_rank_share(folder: str, manifest: Manifest) -> None:
    """A tensor-parallel rank's share folder holds a part of each split weight, not a model to run."""
    share = rank_share(manifest)
    if share is not None:
        rank, ranks = share
        raise InvalidOption(
            f"{folder} is rank {rank} of {ranks}'s share of the store at {manifest.source}, written by a "
            f"tensor-parallel run (it holds 1/{ranks} of each split weight); give {manifest.source} instead, to "
            f"run it whole or as {ranks} ranks (`torchrun --nproc-per-node {ranks} -m shardstream generate "
            f"{manifest.source} --tensor-parallel`)."
        )


def _check_compression(path: Path, wanted: str | None) -> None:
    """A named store of another compression is refused, not used as it is (nor converted over)."""
    have = load_manifest(path).compression
    if wanted is not None and wanted != have:
        raise InvalidOption(
            f"{path} holds a store converted with compression {have or 'none'}, not {wanted}; leave compression "
            f"out to use it as it is, or name another folder (layer_shards_saving_path, --store-path) for a "
            f"{wanted} store."
        )


def _check_recorded_source(path: Path, source: str, cached: bool) -> None:
    """A store made from other shards, or from this folder before it changed, is not used: the
    cache's copy is converted again, a store the user named is refused. Hub and URL sources
    are not asked again (that would need the network each time); their key holds the revision."""
    local = Path(source).expanduser()
    if source.startswith(("http://", "https://", "hf://")) or not local.is_dir():
        return
    try:
        check_same_source(path, *LocalSource(local).identity())
    except InvalidOption:
        if not cached:
            raise
        log.warning("%s changed since it was converted into %s; converting it again.", source, path)
        shutil.rmtree(path)
