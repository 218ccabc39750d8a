"""Reading a store: list its parts and load any one of them without touching the others."""

from __future__ import annotations

import copy
import mmap
import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from .. import quant
from ..errors import InvalidOption, PartNotFound
from . import problems
from .checksum import checksum_bytes
from .manifest import Manifest, TensorRecord
from .partfile import decode_tensor
from .sharding import Expert, ShardIndex, load_expert, load_index, load_tp, placed_in, read_path, tier_root


def read_spans(path: Path, spans: list[tuple[int, int]], into: memoryview) -> None:
    """Read each (offset, length) byte range of the file at `path` into `into`, one after the other: the
    bytes of part of a tensor (embedding rows, a rank's share) without the rest of its file."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise problems.missing(path) from None
    try:
        done = 0
        for offset, length in spans:
            got = 0
            while got < length:
                n = os.preadv(fd, [into[done + got:done + length]], offset + got)
                if not n:
                    raise problems.shorter(path)
                got += n
            done += length
    finally:
        os.close(fd)


class Store:
    """A layer store on disk. `load(part)` reads exactly that part's file (plus tied tensors, and
    a block's experts where `shardstream shard --experts` stored them apart)."""

    remote = False

    def __init__(self, root: Path, manifest: Manifest):
        self.root = Path(root)
        self.manifest = manifest

    @property
    def config(self) -> dict:
        return self.manifest.config

    @property
    def parts(self) -> list[str]:
        return self.manifest.ordered_parts()

    @property
    def num_layers(self) -> int:
        return sum(1 for p in self.manifest.expected_parts if p.startswith("mid/"))

    def part_nbytes(self, part: str) -> int:
        """Stored bytes of the part, its experts stored apart included."""
        return self._part(part).nbytes + sum(r.length for r in self._placed(part))

    def part_files(self, part: str) -> list[str]:
        """The manifest files holding the part (names relative to the store; see `file_path`)."""
        return list(self._part(part).files)

    def read_files(self, part: str) -> list[str]:
        """The manifest files a load of the part reads: its own, and those its tied aliases point into (a tied
        head's embedding, stored with the start)."""
        aliased = [self.manifest.tensors[a["target"]].file for a in self.manifest.aliases.values() if a["part"] == part]
        return list(dict.fromkeys([*self._part(part).files, *aliased]))

    def parts_of(self, blocks: range) -> list[str]:
        """The parts a model of these blocks reads, in order: theirs, the start with the first block, the end
        with the last (a pipeline stage's; all of them for the whole model)."""
        def read(part: str) -> bool:
            kind, _, index = part.partition("/")
            if kind == "mid":
                return int(index) in blocks
            return (part != "start" or blocks.start == 0) and (part != "end" or blocks.stop == self.num_layers)

        return [part for part in self.parts if read(part)]

    def tensor_names(self, part: str) -> list[str]:
        """Names a load of this part returns, tied aliases and experts stored apart included."""
        placed = [n for r in self._placed(part) for n in r.tensors]
        return sorted(set(self._part(part).tensors + self._tied(part) + placed))

    def tensor_shapes(self, part: str) -> dict[str, list[int]]:
        """The shape of each tensor a load of `part` returns (as loaded, i.e. dequantized), reading none."""
        records = {n: asdict(self.manifest.tensors[self.manifest.aliases.get(n, {}).get("target", n)])
                   for n in self._part(part).tensors + self._tied(part)}
        records.update({n: r for expert in self._placed(part) for n, r in expert.tensors.items()})
        return {n: (r.get("quant") or {}).get("shape") or r["shape"] for n, r in records.items()}

    def expert_tensor_names(self) -> set[str]:
        """Every MoE expert tensor, wherever it is stored."""
        names = {n for n, r in self.manifest.tensors.items() if r.expert is not None}
        if self.manifest.sharding:
            names.update(n for r in load_index(self).experts.values() for n in r.tensors)
        return names

    def file_path(self, name: str) -> Path:
        """Where a manifest file is: under the store root, or under the root of the tier its part
        was relocated to (`shardstream relocate --part`); a file lives in its part's folder."""
        placed = self._part_tier(name)
        return self.root / name if placed is None else tier_root(self, *placed) / name

    def _part_tier(self, name: str) -> tuple[ShardIndex, str] | None:
        """(index, tier) of the relocated part holding manifest file `name` (it sits in its part's
        folder); None when that part is under the store root."""
        if not self.manifest.sharding:
            return None
        index = load_index(self)
        tier = index.parts.get(name.rpartition("/")[0])
        return None if tier is None else (index, tier)

    def read_raw(self, name: str, offset: int = 0, length: int | None = None) -> bytearray:
        """Bytes of any file under the store root, unchecked (callers check against their index)."""
        return read_path(self.root / name, offset, length)

    def view(self, manifest: Manifest) -> "Store":
        """This store's files read through another manifest (one rank's TP slices: sharding.rank_view): a
        copy of this store, local or remote (sharing its connection), that lists what `manifest` lists."""
        view = copy.copy(self)
        view.manifest = manifest
        return view

    def file_version(self, name: str) -> tuple[int, int, int] | None:
        """Identity of one version of a file (every atomic replace is a new inode), to cache what was parsed from it."""
        try:
            stat = (self.root / name).stat()
        except FileNotFoundError:
            return (-1, -1, -1)
        return (stat.st_ino, stat.st_size, stat.st_mtime_ns)

    def read_file(self, name: str, verify: bool = False) -> bytearray:
        """The whole of one store file, checked against its size (and checksum when asked)."""
        path = self.file_path(name)
        record = self.manifest.files[name]
        try:
            with open(path, "rb", buffering=0) as handle:
                size = os.fstat(handle.fileno()).st_size
                if size != record.size:
                    raise problems.wrong_size(path, size, record.size)
                buffer = bytearray(size)
                view = memoryview(buffer)
                done = 0
                while done < size:
                    n = handle.readinto(view[done:])
                    if not n:
                        break
                    done += n
        except FileNotFoundError:
            raise problems.missing(path) from None
        if verify and checksum_bytes(buffer) != record.xxh3_128:
            raise problems.fails_checksum(path)
        return buffer

    def read_tensor_bytes(self, record: TensorRecord) -> bytearray:
        """Only the bytes of one stored tensor (and its scales), for reading a single tensor."""
        path = self.file_path(record.file)
        spans = [(record.offset, record.length)]
        if record.quant:
            spans.append((record.quant["absmax"]["offset"], record.quant["absmax"]["length"]))
        begin = min(o for o, _ in spans)
        end = max(o + n for o, n in spans)
        try:
            with open(path, "rb") as handle:
                handle.seek(begin)
                data = bytearray(handle.read(end - begin))
        except FileNotFoundError:
            raise problems.missing(path) from None
        if len(data) != end - begin:
            raise problems.shorter(path)
        return data

    def load_expert(self, layer: int, expert: int) -> Expert:
        """One expert placed by `shardstream shard --experts`; its file is read (and checksum-verified)
        on first use of `.tensors`."""
        return load_expert(self, layer, expert)

    def load_tensor(self, name: str, device: str | torch.device = "cpu", dequantize: bool = True) -> torch.Tensor:
        """One tensor by name (an alias resolves to its target), reading only its bytes; a quantized one as its
        codes and scales (`quant.QuantizedTensor`) when not `dequantize`."""
        target = self.manifest.aliases.get(name, {}).get("target", name)
        record = self.manifest.tensors.get(target)
        if record is None:
            raise PartNotFound(f"the store at {self.root} has no tensor named {name!r}.")
        data = self.read_tensor_bytes(record)
        base = min(record.offset, record.quant["absmax"]["offset"]) if record.quant else record.offset
        tensor = decode_tensor(data, base, record, dequantize=dequantize)
        return tensor if isinstance(tensor, quant.QuantizedTensor) else tensor.to(device)

    def load(self, part: str, device: str | torch.device = "cpu", verify: bool = False,
             read: Callable[[str], bytearray | mmap.mmap] | None = None, experts: bool = True,
             tp_rank: int | None = None, tp_size: int | None = None,
             keep_quantized: frozenset[str] = frozenset(), tied: bool = True) -> dict[str, torch.Tensor]:
        """All tensors of one part, dequantized (but those named in `keep_quantized`: their codes and
        scales as a `quant.QuantizedTensor`), on `device`; tied tensors included unless `tied=False` (a
        caller holding their targets already: a tied head read again would be a second copy of the
        embedding), and the block's experts stored apart unless `experts=False` (a runtime that loads
        them on demand).

        `read(file_name)` supplies each file's bytes (default: `read_file`, a checked copy); the
        streaming runtime passes one that maps the file instead. `verify` also checks expert files.
        With `tp_rank` and `tp_size`, only that rank's tensor-parallel slices (see `load_tp`).
        """
        if tp_rank is not None or tp_size is not None:
            if tp_rank is None or tp_size is None:
                raise InvalidOption("give both tp_rank and tp_size to load one rank's slices, or neither.")
            return load_tp(self, part, tp_rank, tp_size, device)
        record = self._part(part)
        read = read or (lambda name: self.read_file(name, verify=verify))
        tensors: dict[str, torch.Tensor] = {}
        for file_name in record.files:
            buffer = read(file_name)
            for name in record.tensors:
                meta = self.manifest.tensors[name]
                if meta.file == file_name:
                    tensors[name] = decode_tensor(buffer, 0, meta, dequantize=name not in keep_quantized)
        for alias, info in self.manifest.aliases.items():
            if tied and info["part"] == part:
                tensors[alias] = self.load_tensor(info["target"], dequantize=info["target"] not in keep_quantized)
        placed = self._placed(part) if experts else []
        if placed:
            index = load_index(self)
            for record in placed:
                tensors.update(Expert(self, index, record).read(verify or self.remote))
        if torch.device(device).type != "cpu":
            tensors = {n: t.to(device, non_blocking=True) for n, t in tensors.items()}
        return tensors

    def _tied(self, part: str) -> list[str]:
        """Names a load of `part` returns that alias a tensor stored elsewhere (a tied head)."""
        return [n for n, a in self.manifest.aliases.items() if a["part"] == part]

    def _placed(self, part: str):
        kind, _, layer = part.partition("/")
        return placed_in(self, int(layer)) if kind == "mid" and layer.isdigit() else []

    def _part(self, part: str):
        try:
            return self.manifest.parts[part]
        except KeyError:
            raise self.no_part(part) from None

    def no_part(self, part: str) -> PartNotFound:
        """The error for a part name this store does not have, naming the first ones it has."""
        known = ", ".join(self.parts[:4]) + (" ..." if len(self.parts) > 4 else "")
        return PartNotFound(
            f"the store at {self.root} has no part {part!r} (it has: {known}); run `shardstream inspect` to list them.")

