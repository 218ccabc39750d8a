"""Turn a Hugging Face checkpoint into a layer store, shard by shard.

Plain mode (the default) fetches every shard first, then routes tensors to parts. Sequential mode
fetches one shard, routes its tensors, writes every part it completes, writes what it holds of
still-incomplete parts as a piece file, and deletes the shard before fetching the next: peak disk
is one shard plus the output, and a kill at any point loses nothing that was deleted.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
import warnings
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from tqdm.auto import tqdm

from .config_check import check_config
from .convert_disk import check_disk, compression_ratio, disk_room
from .convert_writes import PartProfile, WritePipeline
from .errors import CorruptShard, InvalidOption, SourceNotFound
from .naming import TensorRouter, router_for
from .options import ConversionOptions, conversion_options
from .safetensors_header import Header, HeaderError, read_header
from .sources import CheckpointSource, LocalSource, open_source
from .sources.base import same_source
from .sources.remote import RemoteSource
from .store import MANIFEST_NAME, Manifest, StoreWriter, load_manifest
from .store.lock import LOCK_NAME, store_lock
from .store.problems import shards_gone
from .atomic import TEMP_PREFIX, write_json_atomic
from .store.dtypes import TORCH_DTYPES
from .store.span import FileSpan, SourceFile

log = logging.getLogger("shardstream.convert")

DEFAULT_MIN_FREE_BYTES = 1_000_000_000
STAGING_DIR = ".staging"
PROFILE_FILE = "convert_profile.json"


@dataclass
class ConvertReport:
    store: Path
    parts_written: list[str]
    parts_skipped: list[str]
    bytes_written: int
    seconds: float
    profile: dict[str, PartProfile] = field(default_factory=dict)

    def summary(self) -> str:
        mb = self.bytes_written / 1e6
        rate = mb / self.seconds if self.seconds else 0.0
        written = len(self.parts_written)
        return (
            f"{written} part{'' if written == 1 else 's'} written, {len(self.parts_skipped)} already complete; "
            f"{mb:.1f} MB in {self.seconds:.1f} s ({rate:.1f} MB/s) -> {self.store}"
        )


@dataclass
class Plan:
    """What goes where: the index parsed into the maps the sequential algorithm needs."""

    router: TensorRouter
    weight_map: dict[str, str]               # tensor -> shard (the tied head left out)
    part_of: dict[str, str]                  # tensor -> part path
    expert_of: dict[str, int]                # tensor -> expert id (MoE, per-expert names)
    part_tensors: dict[str, set[str]]        # part -> tensors it needs
    part_shards: dict[str, set[str]]         # part -> shards holding them
    shard_tensors: dict[str, list[str]]      # shard -> tensors it holds (in index order)
    expected_parts: list[str]
    tied: tuple[str, str, str] | None        # (head name, embedding name, head's part)


def make_plan(config: dict, weight_map: dict[str, str]) -> Plan:
    router = router_for(config, weight_map)
    tied = None
    head_embed = router.tied_head()
    names = dict(weight_map)
    if head_embed and head_embed[1] in names:
        head, embed = head_embed
        tied = (head, embed, router.route(head).part.path)
        names.pop(head, None)
    part_of, expert_of = {}, {}
    part_tensors: dict[str, set[str]] = defaultdict(set)
    part_shards: dict[str, set[str]] = defaultdict(set)
    shard_tensors: dict[str, list[str]] = defaultdict(list)
    for name, shard in names.items():
        route = router.route(name)
        part_of[name] = route.part.path
        if route.expert is not None:
            expert_of[name] = route.expert
        part_tensors[route.part.path].add(name)
        part_shards[route.part.path].add(shard)
        shard_tensors[shard].append(name)
    expected = [p.path for p in router.parts()]
    if tied and tied[2] not in expected:
        expected.append(tied[2])
    for part in expected:
        part_tensors.setdefault(part, set())
    return Plan(router, names, part_of, expert_of, dict(part_tensors), dict(part_shards), dict(shard_tensors),
                expected, tied)


def convert(
    source: str | Path,
    out: str | Path,
    *,
    sequential_shard_processing: bool = False,
    compression: str | None = None,
    delete_original: bool = False,
    profiling_mode: bool = False,
    min_free_space: int = DEFAULT_MIN_FREE_BYTES,
    layer_memory_warning: int | None = None,
    token: str | None = None,
    revision: str | None = None,
    progress: bool = True,
    conversion: ConversionOptions | None = None,
) -> ConvertReport:
    """Convert `source` (local folder, HTTP base URL or Hub id) into the store at `out`.

    Re-running the same call after an interruption finishes the job; parts already written and
    intact are skipped. See README "Sequential conversion" for what gets deleted when.
    `conversion`: `sequential_shard_processing`, `compression`, `token` and `revision` as one
    ConversionOptions value, given instead of one by one (its store_path, if any, is `out`).
    """
    conversion = conversion_options(conversion, ConversionOptions(
        sequential=sequential_shard_processing, compression=compression, hf_token=token, revision=revision))
    started = time.perf_counter()
    out = Path(out)
    _refuse_other_store_path(conversion, out)
    _refuse_store_as_source(source)
    _refuse_unusable_output(out)
    # validate first, create last: nothing is written until the source has answered
    src = open_source(source, out / STAGING_DIR, token=conversion.hf_token, revision=conversion.revision,
                      progress=progress)
    config = src.config()
    plan = make_plan(config, src.weight_map())
    check_config(config, plan.router, src.tensor_shape)
    if isinstance(src, LocalSource):
        src.check_all()
    where, fingerprint = src.identity()
    fresh = Manifest(
        source=where, source_fingerprint=fingerprint, config=config, family=plan.router.family,
        compression=conversion.compression, expected_parts=plan.expected_parts,
    )
    _refuse_other_contents(out, where, fingerprint)   # before the lock file: a folder not ours is left as it is
    with _locked_output(out):
        writer = StoreWriter.open(out, fresh)
        job = _Job(src, plan, writer, conversion,
                   layer_memory_warning or _default_layer_warning(), progress)
        _refuse_unrepairable(src, out, job.shards_to_read(), writer.manifest)
        check_disk(src, out, conversion, job.shards_to_read(), min_free_space)
        writer.begin()   # from now on the folder is recognisably an (unfinished) store
        src.copy_metadata(out)
        job.run()
        if plan.tied:
            head, embed, part = plan.tied
            writer.add_alias(head, embed, part)
        writer.finish()
    if delete_original:
        for shard in src.shard_names():
            src.release(shard, delete=True)
        src.delete_remaining()
    shutil.rmtree(out / STAGING_DIR, ignore_errors=True)
    report = ConvertReport(out, job.writes.written, job.skipped, job.writes.bytes_written,
                           time.perf_counter() - started, job.profile)
    if profiling_mode:
        write_json_atomic(out / PROFILE_FILE, _profile_json(report))
        print(profile_table(report))
    log.info(report.summary())
    return report


def _refuse_other_store_path(conversion: ConversionOptions, out: Path) -> None:
    """A `conversion` that names another store than `out` says two things; neither is picked."""
    named = conversion.store_path
    if named is not None and Path(named).expanduser().resolve() != out.expanduser().resolve():
        raise InvalidOption(f"conversion.store_path is {named} but the store to convert into is "
                            f"{out}; leave store_path out of `conversion`, or give it as `out`.")


def _refuse_store_as_source(source: str | Path) -> None:
    if (Path(source).expanduser() / MANIFEST_NAME).is_file():
        raise InvalidOption(
            f"{source} is already a store; use it directly (generate, serve, inspect), there is nothing to convert."
        )


def _refuse_unusable_output(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise InvalidOption(f"{out} is a file; give a new or empty folder for the store.")


def _refuse_other_contents(out: Path, where: str, fingerprint: dict) -> None:
    """Only a new or empty folder, or an (unfinished) store of this very source, may be written."""
    if not out.is_dir():
        return
    if not (out / MANIFEST_NAME).is_file():
        if any(p.name not in (STAGING_DIR, LOCK_NAME) and not p.name.startswith(TEMP_PREFIX) for p in out.iterdir()):
            raise InvalidOption(
                f"{out} is not empty and is not a shardstream store; give a new or empty folder for the store."
            )
        return
    try:
        body = json.loads((out / MANIFEST_NAME).read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError):
        body = None
    if not (isinstance(body, dict) and {"format_version", "checksum", "expected_parts"} <= body.keys()):
        raise InvalidOption(
            f"{out / MANIFEST_NAME} is not a shardstream store's manifest, so {out} is not a shardstream store; "
            "give a new or empty folder for the store."
        )
    check_same_source(out, where, fingerprint)


def _refuse_unrepairable(src: CheckpointSource, out: Path, shards: list[str], manifest: Manifest) -> None:
    """A re-run that needs shards a sequential run deleted cannot finish: refuse before the store
    is touched (it would be marked incomplete, unusable, for nothing)."""
    if not isinstance(src, LocalSource):
        return   # downloaded again
    gone = [s for s in shards if not (src.root / s).is_file()]
    if gone:
        raise SourceNotFound(f"cannot finish or repair {out}, which was left as it was: "
                             f"{shards_gone(manifest.source, gone, (manifest.source_fingerprint or {}).get('shards', {}))}.")


def check_same_source(store: Path, where: str, fingerprint: dict) -> None:
    """Refuse a store whose recorded source is not this one as it is now: a copy of the same shards
    (same sizes and dates, or the same Hub commit) may finish or reuse it, another model may not."""
    existing = load_manifest(store)
    if not same_source(existing.source_fingerprint, fingerprint):
        raise InvalidOption(
            f"{store} holds a store converted from {existing.source}, and {where} differs from that now "
            "(shard sizes, dates or Hub commit); give another output folder, or delete that one to convert again."
        )


@contextmanager
def _locked_output(out: Path) -> Iterator[None]:
    """The output folder, made if missing, with its lock held (store/lock.py: one writer at a time). One
    this call made is removed again when the conversion stops before it began the store (refused for lack
    of disk space, say), so a refusal leaves nothing behind."""
    made = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InvalidOption(f"cannot create {out} ({exc.strerror}); give a folder you can write to.") from None
    with store_lock(out):
        try:
            yield
        except BaseException:
            if made and not (out / MANIFEST_NAME).exists():
                shutil.rmtree(out, ignore_errors=True)
            raise


def _default_layer_warning() -> int:
    return psutil.virtual_memory().available // 4


class _Job:
    """The shard loop, with its buffers; one instance per convert() call.

    Each shard is read tensor by tensor into per-part buffers; a part is handed to the write
    pipeline (convert_writes) the moment its last tensor arrives, so writing overlaps reading.
    In sequential mode the rest is written as piece files and the shard is released once its
    writes are durable.
    """

    def __init__(self, src: CheckpointSource, plan: Plan, writer: StoreWriter, conversion: ConversionOptions,
                 layer_warning: int, progress: bool):
        self.src, self.plan, self.writer = src, plan, writer
        self.conversion = conversion   # the store's compression (StoreWriter.open refuses another) and mode
        self.layer_warning = layer_warning
        self.progress = progress
        self.buffer: dict[str, dict[str, FileSpan]] = defaultdict(dict)
        self.stored = writer.stored_tensors()            # durably written or handed to the writer
        self.completed = set(writer.manifest.parts)      # likewise, for whole parts
        self.pieced = {r.part for r in writer.manifest.tensors.values()}
        self.warned_parts: set[str] = set()
        self.opened: dict[str, SourceFile] = {}   # sequential: shard -> its open file, until it is deleted
        self.skipped = sorted(writer.manifest.parts)
        self.writes = WritePipeline(writer, plan.expert_of, plan.weight_map)
        self.profile = self.writes.profile

    def run(self) -> None:
        with self.writes:
            self._run()

    def _run(self) -> None:
        shards = self.src.shard_names()
        todo = self.shards_to_read()
        for shard in shards:
            if shard not in todo and self.conversion.sequential:
                self.src.release(shard, delete=True)   # processed by an interrupted run
        # drawn only on a terminal, and closed before an error is printed (never redrawn after it)
        with tqdm(total=len(todo), unit="shard", disable=None if self.progress else True, desc="convert") as bar:
            if not self.conversion.sequential:
                fetched = {s: self._fetch(s) for s in todo}
            for i, shard in enumerate(todo):
                index = shards.index(shard)   # piece files are named by it: the same after a resume
                if self.conversion.sequential:
                    self._check_disk(todo[i:], todo[i - 1] if i else None)
                path, wait = fetched[shard] if not self.conversion.sequential else self._fetch(shard)
                self._process(shard, path, wait, index, last=shard == todo[-1])
                if self.conversion.sequential:
                    self.writes.release_when_written(shard, self._delete, wait=isinstance(self.src, RemoteSource))
                bar.update(1)
        self._safeguard()
        self.writes.drain()
        if not self.conversion.sequential:
            for shard in todo:
                self.src.release(shard, delete=False)

    def shards_to_read(self) -> list[str]:
        """The shards holding tensors that are still to be written (damaged files' ones included)."""
        return [s for s in self.src.shard_names() if self._wanted(s)]

    def _delete(self, shard: str) -> None:
        """Runs once every write from the shard is durable: closed at once, its space is free when the
        next shard's room is counted (a writer thread may still hold a span of it for a moment)."""
        self.opened.pop(shard).close()
        self.src.release(shard, delete=True)

    def _wanted(self, shard: str) -> list[str]:
        """The shard's tensors not yet stored, in parts not yet complete: what it is read for."""
        return [n for n in self.plan.shard_tensors.get(shard, ())
                if n not in self.stored and self.plan.part_of[n] not in self.completed]

    def _check_disk(self, todo: list[str], previous: str | None) -> None:
        """Before each shard of a sequential run: the rest must still fit (convert() checked it all
        before the first; this catches what else fills the disk meanwhile). The shards converted before
        are deleted on the release thread once their output is written, the `previous` one's maybe not
        yet; where the room left does not hold its output beside the next shard's (a source on the same
        disk, with room for one shard's output), this waits for their deletion first."""
        free, needed = disk_room(self.src, self.writer.root, self.conversion, todo)
        ratio = compression_ratio(self.conversion.compression)
        unwritten = int((self.src.shard_size(previous) or 0) * ratio) if previous else 0
        if free < needed + unwritten:
            self.writes.wait_for_releases()
        check_disk(self.src, self.writer.root, self.conversion, todo)

    def _fetch(self, shard: str) -> tuple[Path, float]:
        started = time.perf_counter()
        path = self.src.fetch(shard)
        return path, time.perf_counter() - started

    def _process(self, shard: str, path: Path, wait: float, index: int, last: bool) -> None:
        try:
            header = read_header(path)
        except HeaderError as exc:
            raise CorruptShard(
                f"shard {shard} is corrupt ({exc}); delete it and download the checkpoint again."
            ) from None
        wanted = self._wanted(shard)
        touched: list[str] = []
        source = SourceFile(path)
        if self.conversion.sequential:
            self.opened[shard] = source
        for span in _spans(source, header, wanted):
            part = self.plan.part_of[span.name]
            self.buffer[part][span.name] = span
            if part not in touched:
                touched.append(part)
                self.profile[part].wait_seconds += wait
            self._warn_if_large(part)
            if self._complete(part):   # written while the rest of the shard is read
                self._submit(part, piece=index if part in self.pieced else None, complete=True)
        if self.conversion.sequential and not last:
            for part in sorted(self.buffer, key=self.plan.expected_parts.index):
                self._submit(part, piece=index, complete=False)
        log.info("processed shard %s", shard)

    def _complete(self, part: str) -> bool:
        needed = self.plan.part_tensors[part]
        return all(n in self.buffer.get(part, ()) or n in self.stored for n in needed)

    def _submit(self, part: str, piece: int | None, complete: bool) -> None:
        tensors = self.buffer.pop(part, {})
        self.stored.update(tensors)
        (self.completed if complete else self.pieced).add(part)
        self.writes.submit(part, tensors, piece, complete)

    def _warn_if_large(self, part: str) -> None:
        """Parts are copied from their shards through a small buffer; only quantizing one holds it in memory."""
        if self.writer.manifest.compression is None:
            return
        size = sum(t.nbytes for t in self.buffer[part].values())
        if size > self.layer_warning and part not in self.warned_parts:
            self.warned_parts.add(part)
            warnings.warn(
                f"part {part} is {size / 1e9:.2f} GB, and quantizing it holds it in memory "
                f"(warning threshold {self.layer_warning / 1e9:.2f} GB).",
                stacklevel=2,
            )

    def _safeguard(self) -> None:
        """Final pass: every expected part must be complete; write any the loop left behind."""
        for part in self.plan.expected_parts:
            if part in self.completed:
                continue
            if self._complete(part):
                self._submit(part, piece=len(self.src.shard_names()) if part in self.pieced else None,
                             complete=True)
                continue
            lacking = sorted(self.plan.part_tensors[part] - self.stored - set(self.buffer.get(part, ())))
            shards = sorted({self.plan.weight_map[n] for n in lacking})
            raise CorruptShard(
                f"part {part} cannot be completed: {len(lacking)} tensors (e.g. {lacking[0]!r}) are in "
                f"{', '.join(shards)}, which is no longer available; restore it and re-run."
            )


def _spans(source: SourceFile, header: Header, names: list[str]) -> list[FileSpan]:
    """The named tensors as spans of the shard, in file order: nothing is read here, the writer
    threads stream each part's bytes straight from the shard (checked complete by its header)."""
    entries = sorted((header.tensors[n] for n in names), key=lambda e: e.begin)
    return [FileSpan(source, e.name, header.data_start + e.begin, e.nbytes, TORCH_DTYPES[e.dtype], tuple(e.shape))
            for e in entries]


def profile_table(report: ConvertReport) -> str:
    rows = ["part        read s   wait s  quant s  write s       MB"]
    total = PartProfile()
    for part, p in report.profile.items():
        rows.append(f"{part:<10} {p.read_seconds:7.3f} {p.wait_seconds:8.3f} {p.quantize_seconds:8.3f} "
                    f"{p.write_seconds:8.3f} {p.bytes_written / 1e6:8.2f}")
        for key in ("read_seconds", "wait_seconds", "quantize_seconds", "write_seconds", "bytes_written"):
            setattr(total, key, getattr(total, key) + getattr(p, key))
    rows.append(f"{'total':<10} {total.read_seconds:7.3f} {total.wait_seconds:8.3f} "
                f"{total.quantize_seconds:8.3f} {total.write_seconds:8.3f} {total.bytes_written / 1e6:8.2f}")
    return "\n".join(rows)


def _profile_json(report: ConvertReport) -> dict:
    return {
        "seconds": report.seconds,
        "bytes_written": report.bytes_written,
        "parts": {p: vars(v) for p, v in report.profile.items()},
    }


__all__ = ["ConvertReport", "convert", "make_plan", "profile_table"]
