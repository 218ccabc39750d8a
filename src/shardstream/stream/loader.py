"""Reading one block, or one piece of a block (see pieces.py), from the store into ready-to-use
parameter tensors on the target device."""

from __future__ import annotations

import logging
import math
import mmap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .. import quant
from ..store import Store
from ..switches import COPY_AHEAD
from ..store.direct_io import ALIGN, DirectUnsupported, aligned
from ..store.dtypes import TORCH_DTYPES
from ..store.manifest import TensorRecord
from ..store.partfile import tensor_from_bytes
from . import half_linear
from ..memory import available_memory
from .residency import AUTO_SHARE
from .direct import BufferPool, block_reading, read_direct, read_ranges, verify_unkept
from .mapped import cool, map_part, map_ranges, release_unviewed, spans, verify_mapped
from .quant_linear import packable
from .pieces import PIECE_BYTES, Piece
from .weights import WeightMapper

log = logging.getLogger("shardstream.stream")

Layout = list[tuple[str, list[tuple[int, int]]]]  # per file: the aligned (begin, end) ranges a piece reads


@dataclass
class LoadedBlock:
    """A block's parameters (or one piece's: `piece`), ready once `ready` (a CUDA event, or None on CPU) has fired."""

    index: int
    params: dict[str, torch.Tensor]
    read_seconds: float
    ready: torch.cuda.Event | None = None
    host: dict[str, torch.Tensor] = field(default_factory=dict)  # pinned copies kept alive until `ready`
    mappings: list = field(default_factory=list)  # the mapped files, hinted cold when the block is released
    buffers: list = field(default_factory=list)  # O_DIRECT buffers, back to `pool` when the block is released
    pool: BufferPool | None = None
    piece: int = 0
    decode: Callable[[], dict[str, torch.Tensor]] | None = None  # left by the reader: run by `wait`, on the CPU

    def cool(self) -> None:
        """The block has run: its pages are the first the kernel should reclaim (see mapped.cool), its
        read buffers are free for the next block (on CUDA once the copy from them has finished: the
        compute stream waited for it, the host did not)."""
        cool(self.mappings)
        if self.pool is not None:
            if self.ready is not None and self.buffers:
                self.ready.synchronize()
            self.pool.give(self.buffers)

    def wait(self) -> None:
        """Make the parameters usable: dequantize what the reader left to the computing thread, or make
        the compute stream wait for the copy (the caching allocator must not reuse the memory early)."""
        if self.decode is not None:
            decode, self.decode = self.decode, None
            self.params = decode()
        if self.ready is None:
            return
        stream = torch.cuda.current_stream()
        stream.wait_event(self.ready)
        for tensor in self.params.values():
            for part in quant.held_by(tensor):
                part.record_stream(stream)
        self.host.clear()


class BlockLoader:
    """Store part -> converted parameters on `device`.

    Parts are mapped, not copied (see mapped.py). Checksums are verified the first time each part
    is read in this process (`verify=True`), so a corrupt store fails on the first token instead of
    giving wrong text; later reads of the same part skip the hash. On CUDA the bytes go through pinned memory and a side stream, so the copy
    overlaps the previous block's compute.

    Blocks (not the resident parts) are read past the page cache into reused buffers instead when they
    cannot all stay in it (see direct.py; `reading=None` asks `block_reading`): with O_DIRECT
    (`direct`), or read and dropped from the cache (`dropped`); a filesystem that refuses O_DIRECT
    switches this loader back to mapping for good. On CUDA the
    pieces are always read into the pool's buffers, which are page-locked once (through the page
    cache when not direct): the copy to the GPU then goes straight from them. The first pieces that
    fit `host_budget` stay there after their first read (`_reserve`): later tokens only copy them.

    A streamed block is read piece by piece (`load_piece`, after `plan`): only the checkpoint
    tensors that map onto the piece, each as its own page-aligned byte range, into a buffer of one
    size for every piece (two sizes: held-through pieces 0, the rest), so any free buffer fits the
    next piece and the pool never holds more than the pieces in flight. The first piece read of a
    block hashes the block's whole files first, through a small buffer.

    A quantized piece is dequantized by the reader while `decode_in_reader` holds, else by the thread
    that computes with it (`LoadedBlock.wait`); the model sets it per pass (see model.COMPUTE_BOUND_ROWS).
    Its Linear weights are not dequantized at all where `pack_linear_weights` marked them: they
    go to the model as the codes read (quant_linear.py).
    """

    def __init__(self, store: Store, mapper: WeightMapper, device: torch.device, verify: bool,
                 experts: bool = True, reading: str | None = None, blocks: range | None = None):
        self.store = store
        self.blocks = range(store.num_layers) if blocks is None else blocks   # block `index` is part mid/{blocks[index]}
        # how streamed blocks are read ('mapped', 'dropped', 'direct': direct.READINGS); may change once
        self.reading = (block_reading(store, copy_free=device.type == "cuda", blocks=self.blocks)
                        if reading is None else reading)
        self._pool = BufferPool(pin=device.type == "cuda")
        self._experts = experts   # False: experts stored apart are left out (loaded on demand)
        self.mapper = mapper
        self.device = device
        self._verify = verify
        self._verified: set[str] = set()
        self._verifying = threading.Lock()
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._collect = threading.local()  # load() gathers the mappings that read() makes
        self._pieces: dict[tuple[int, int], list[str] | None] = {}   # None: read with the whole block
        self._layouts: dict[tuple[int, int], Layout] = {}
        self._capacity: dict[tuple[int, int], int] = {}   # bytes of a piece's read buffer
        self._exact: dict[tuple[int, int], tuple[int, int]] = {}   # a piece's own bytes: read, dequantized
        self._decoded: dict[tuple[int, int], int] = {}    # bytes of its dequantized tensors' buffer (0: none)
        self.held: frozenset = frozenset()   # keys of the held-through pieces (see pieces.held_through)
        self.decode_in_reader = True
        self.packed_keys: frozenset[str] = frozenset()   # checkpoint keys handed over packed (quant.QuantizedTensor)
        # on a GPU every quantized block tensor is copied as its codes, dequantized there unless packed (to_device)
        self._codes_to_device = frozenset(name for name, record in store.manifest.tensors.items()
                                          if record.quant and device.type == "cuda")
        self._resident_packed: frozenset[str] = frozenset()   # those kept packed in resident parts too
        self._packing_saves: dict[str, tuple[int, bool]] = {}   # parameter name -> (bytes packing saves, also resident)
        self.host_budget = 0   # CUDA: bytes of streamed pieces kept page-locked in host RAM (see _reserve)
        self._kept: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._kept_bytes = 0
        self._reserved: dict[tuple[int, int], int] = {}   # pieces being read to be kept -> bytes counted
        self._kept_buffers: list = []
        self._keeping = threading.Lock()
        self.bytes_read = 0   # tensors' own bytes read (resident parts once, streamed pieces every time)
        self._counting = threading.Lock()
        files = self.store.manifest.files
        self._block_capacity = max((files[f].size for p, rec in self.store.manifest.parts.items()
                                    if p.startswith("mid/") for f in rec.files), default=0)

    @property
    def direct(self) -> bool:
        """Streamed blocks are read with O_DIRECT."""
        return self.reading == "direct"

    @property
    def dropped(self) -> bool:
        """Streamed blocks are read through the page cache and dropped from it at once."""
        return self.reading == "dropped"

    def close(self) -> None:
        self._kept.clear()
        self._kept_buffers.clear()
        self._pool.close()

    def _reserve(self, key: tuple[int, int]) -> bool:
        """On CUDA, whether a streamed piece read for the first time is to stay page-locked in host RAM, so
        that later tokens only copy it to the GPU: even from the page cache, reading a piece again into the
        pinned buffers costs several times its copy to the GPU (docs/BENCHMARKS.md, section "Streaming on a
        GPU"). The first pieces read are kept while their own bytes (read and
        dequantized, in buffers of their exact size) fit `host_budget`, as with resident blocks
        (residency.py); they are counted from now."""
        read, decoded = self._exact[key]
        size = aligned(max(read, 1)) + (aligned(decoded) if decoded else 0)
        with self._keeping:
            if key in self._kept or key in self._reserved or self._kept_bytes + size > self.host_budget:
                return False
            self._kept_bytes += size
            self._reserved[key] = size
        return True

    def _unreserve(self, key: tuple[int, int]) -> None:
        with self._keeping:
            self._kept_bytes -= self._reserved.pop(key)

    def _keep(self, key: tuple[int, int], tensors: dict[str, torch.Tensor], buffers: list) -> dict[str, torch.Tensor]:
        """Keep a reserved piece's tensors (the read buffers they view stay out of the pool); tensors made
        anew (dequantized on the host) are pinned too, beyond the reservation. Returns the tensors to copy."""
        pinned = {name: _pinned(t) for name, t in tensors.items()}
        with self._keeping:
            self._kept_bytes += sum(_nbytes(t) for name, t in pinned.items() if t is not tensors[name])
            del self._reserved[key]
            self._kept[key] = pinned
            self._kept_buffers.extend(buffers)
            buffers.clear()
        return pinned

    def copies_only(self, keys: list[tuple[int, int]]) -> bool:
        """Whether loading any of these pieces now only queues its copy to the GPU: each is kept page-locked
        in host RAM (see blocks.StreamedBlocks; $SHARDSTREAM_COPY_AHEAD=0 keeps them on the reader threads)."""
        if self._copy_stream is None or COPY_AHEAD.off():
            return False
        with self._keeping:
            return all(key in self._kept for key in keys)

    def choose_reading_again(self, head_bytes: int) -> None:
        """Ask again how the blocks are read, once the resident parts are in memory and some blocks are known
        to be streamed. Mapped, the resident blocks, the head (`head_bytes`) and the streamed blocks
        are all pages of the store's files: streaming through them pays only where all of those fit at once
        in `auto`'s share of the memory left, the rest being the activations' and the KV cache's. Otherwise
        the streamed blocks are evicted and read again every pass, and the reclaim slows the products too."""
        if self.reading == "mapped":
            self.reading = block_reading(self.store, memory=int(available_memory()[0] * AUTO_SHARE) - head_bytes,
                                         copy_free=self.device.type == "cuda", blocks=self.blocks)

    def read_past_the_cache(self) -> None:
        """Read streamed blocks past the page cache from now on (O_DIRECT, else dropped reads), unless they
        are read so already or $SHARDSTREAM_DIRECT_IO=off keeps them mapped: a batch engine's KV caches want
        the memory the cached blocks would take."""
        if self.reading != "direct":
            reading = block_reading(self.store, memory=0, copy_free=True)
            if reading != "mapped":
                self.reading = reading

    def pack_linear_weights(self, linear_weights: set[str], parts: list[str] | None = None) -> None:
        """Hand these Linears' and embeddings' weights (parameter names) over as stored, where a kernel multiplies
        them so: quantized ones packed (quant_linear.packable), and on the CPU the half-precision matrices of a
        float32 model (`_holds_as_stored`: "bfloat16 weights, float32 math", multiplied by half_linear), which
        stay so in resident parts too. A tied tensor is handed over so only when every parameter it fills here
        is one of them (a tied embedding and head: one tensor serves both; a pipeline stage may hold only one of
        the two). `parts`: the store parts this model reads (default all). On a CUDA GPU (the Triton kernel), only
        the streamed blocks' quantized weights: they cross the bus as codes and stay so on the GPU; resident
        blocks and the parts outside the blocks are dequantized once, at load, where the cost is paid once. Call
        before reading anything."""
        on_cpu = self.device.type == "cpu"
        manifest = self.store.manifest
        tensors = manifest.tensors
        read = set(manifest.parts if parts is None else parts)
        aliases: dict[str, list[str]] = {}
        for alias, info in manifest.aliases.items():
            if info["part"] in read:
                aliases.setdefault(info["target"], []).append(alias)
        packed = {}
        held: set[str] = set()
        converted = 0   # half-precision matrices the kernel does not take
        saves: dict[str, tuple[int, bool]] = {}
        seen: set[str] = set()
        for part in manifest.parts:
            if part not in read or not (on_cpu or part.startswith("mid/")):
                continue
            for key in self.store.tensor_names(part):
                target = manifest.aliases.get(key, {}).get("target", key)
                if target in seen or target not in tensors:
                    continue
                seen.add(target)
                # the names this model reads the stored tensor by: its own where its part is read, its tied aliases
                keys = [target] * (tensors[target].part in read) + aliases.get(target, [])
                names = [self.mapper.linear_weight(k, linear_weights) for k in keys]
                if not names or None in names:
                    continue
                record = tensors[target]
                quantized = packable(record.quant, self.device)
                as_stored = self._holds_as_stored(names[0], record)
                converted += as_stored is False
                if not (quantized or as_stored):
                    continue
                if quantized:
                    resident = on_cpu   # a GPU dequantizes resident parts once, at load
                    packed[target] = resident
                    stored = record.stored_bytes
                else:
                    resident = True
                    held.update([target, *keys])
                    stored = record.length
                saves[names[0]] = (self.mapper.nbytes(names[0]) - stored, resident)
                saves.update({other: (self.mapper.nbytes(other), resident) for other in names[1:]})   # the same tensor
        self.packed_keys = frozenset(packed)
        self._resident_packed = frozenset(key for key, resident in packed.items() if resident)
        self.mapper.held_as_stored = frozenset(held)
        self._packing_saves = saves
        if held:
            log.info("weights: %d half-precision matrices stay as stored in memory, multiplied in float32 "
                     "(half_linear); norms and biases are converted", len(held))
        if converted:
            log.info("weights: %d half-precision matrices are converted to float32, twice their stored size in "
                     "memory: the half-precision kernel (half_linear) does not take them here", converted)

    def _holds_as_stored(self, name: str, record: TensorRecord) -> bool | None:
        """Whether parameter `name` of a float32 model on the CPU keeps the half-precision matrix `record` as
        stored, for half_linear to multiply (asked with a 0-row tensor of its dtype and width); None where it
        is no such matrix."""
        dtype = TORCH_DTYPES.get(record.dtype)
        if (self.device.type != "cpu" or record.quant or dtype not in (torch.bfloat16, torch.float16)
                or self.mapper.dtype(name) != torch.float32 or len(record.shape) != 2):
            return None
        return half_linear.available() and half_linear.supports(torch.empty(0, record.shape[1], dtype=dtype),
                                                                torch.float32)

    def held_bytes(self, names: set[str] | frozenset[str]) -> int:
        """Bytes these streamed parameters take in memory: packed or held as stored where they are, else in the
        model's dtype."""
        return sum(self.mapper.nbytes(name) for name in names) - self.packing_saves(names)

    def packing_saves(self, names: set[str] | frozenset[str], resident: bool = False) -> int:
        """Bytes of memory that the packed (or held as stored) ones among these parameters save against their
        size in the model's dtype, streamed or (`resident`) in a resident part (on a GPU those are dequantized)."""
        total = 0
        for name in names:
            saved, also_resident = self._packing_saves.get(name, (0, False))
            total += saved if also_resident or not resident else 0
        return total

    @property
    def pool(self) -> BufferPool:
        return self._pool

    @property
    def kept(self) -> frozenset[tuple[int, int]]:
        """The streamed pieces kept page-locked in host RAM (see `_reserve`)."""
        with self._keeping:
            return frozenset(self._kept)

    @property
    def kept_bytes(self) -> int:
        """Bytes of host RAM the kept pieces take, and those of reads under way that will be kept."""
        return self._kept_bytes

    def piece_buffer_bytes(self) -> int:
        """Bytes of a streamed piece's read buffer (not a held-through one; see `plan`): what a streamed
        head's slices take (ends.py), so that the pool serves both with the same buffers."""
        return aligned(max((size for key, size in self._capacity.items() if key not in self.held), default=PIECE_BYTES))

    def part(self, index: int) -> str:
        """The store part that block `index` (counted from the first of `blocks`) is read from."""
        return f"mid/{self.blocks[index]}"

    def checkpoint_keys(self, index: int) -> list[str]:
        """The checkpoint tensors a load of block `index` gives."""
        return self.store.tensor_names(self.part(index))

    def split(self, index: int, pieces: list[Piece]) -> list[list[str]] | None:
        """The checkpoint keys of each piece of block `index`; None when the block must be read whole
        (a remote store, tensors stored outside the part's own files, or a key feeding two pieces)."""
        keys = self.checkpoint_keys(index)
        if getattr(self.store, "remote", False) or not set(keys) <= set(self.store.manifest.parts[self.part(index)].tensors):
            return None
        owner = {name: i for i, piece in enumerate(pieces) for name in piece.names}
        out: list[list[str]] = [[] for _ in pieces]
        for key in keys:
            homes = {owner[name] for name in self.mapper.target_names([key]) if name in owner}
            if len(homes) > 1:
                return None
            if homes:
                out[homes.pop()].append(key)
        return out

    def plan(self, pieces: dict[tuple[int, int], list[str] | None], held: frozenset) -> None:
        """The pieces `load_piece` reads: key (block, piece) -> checkpoint keys (None: the whole block).
        Held-through pieces share one size of read buffer and one of dequantization buffer, the others
        another, so that any free buffer of a kind fits the next piece."""
        self._pieces, self.held = dict(pieces), held
        self._layouts = {key: _layout(self.store, names) for key, names in pieces.items() if names is not None}
        read = {key: sum(e - b for _, ranges in layout for b, e in ranges) for key, layout in self._layouts.items()}
        decoded = {key: sum(self._decoded_bytes(name) for name in pieces[key]) for key in self._layouts}
        self._exact = {key: (read[key], decoded[key]) for key in read}
        for group in (held, read.keys() - held):
            for need, sizes in ((read, self._capacity), (decoded, self._decoded)):
                size = max((need[key] for key in group if key in need), default=0)
                sizes.update({key: size for key in group if key in need})

    def read(self, parts: list[str], resident: bool = False, keep: frozenset[str] | None = None,
             tied: bool = True, mappings: list | None = None) -> dict[str, torch.Tensor]:
        """Checkpoint tensors of these parts on the CPU, checksum-verified on their first read: mapped
        files (appended to `mappings` when given), or (for a block, inside `load`) pool buffers read with
        O_DIRECT. Packed where marked (`pack_linear_weights`; in a `resident` part, only on the CPU: a GPU
        dequantizes resident parts once), or where `keep` says. `tied=False` leaves tied aliases out (see `Store.load`)."""
        if keep is None:
            keep = self._resident_packed if resident else self.packed_keys
        tensors: dict[str, torch.Tensor] = {}
        direct = getattr(self._collect, "buffers", None) is not None
        for part in parts:
            verify = self._verify and part not in self._verified
            if direct and self.direct:
                try:
                    tensors.update(self._read_direct(part, verify, keep))
                except DirectUnsupported:
                    self.reading = "mapped"
            if not (direct and self.direct):
                tensors.update(map_part(self.store, part, verify=verify, experts=self._experts,
                                        mappings=getattr(self._collect, "mappings", None) if mappings is None else mappings,
                                        keep_quantized=keep,
                                        tied=tied))
            if verify:
                self._verified.add(part)
            self._count(self.store.manifest.parts[part].tensors)
        return tensors

    def _count(self, names: list[str]) -> None:
        """Add these stored tensors' bytes (codes and scales of a quantized one) to `bytes_read`."""
        tensors = self.store.manifest.tensors
        total = sum(tensors[n].stored_bytes for n in names if n in tensors)
        with self._counting:
            self.bytes_read += total

    def _read_direct(self, part: str, verify: bool, keep: frozenset[str]) -> dict[str, torch.Tensor]:
        taken: list = []

        def read(file_name: str) -> memoryview:
            buffer, view = read_direct(self.store, file_name, self._pool, verify, self._block_capacity)
            taken.append(buffer)
            return view

        try:
            tensors = self.store.load(part, read=read, verify=verify, experts=self._experts, keep_quantized=keep)
        except BaseException:
            self._pool.give(taken)
            raise
        self._collect.buffers.extend(taken)
        return tensors

    def load(self, index: int, resident: bool = False) -> LoadedBlock:
        """Block `index` whole (a `resident` one to stay in memory: see `read`)."""
        started = time.perf_counter()
        self._collect.mappings = mappings = []
        self._collect.buffers = buffers = []
        try:
            tensors = self.read([self.part(index)], resident, keep=self._codes_to_device or None)
        except BaseException:
            self._pool.give(buffers)
            raise
        finally:
            self._collect.mappings = self._collect.buffers = None
        block = self.to_device(index, tensors, self._resident_packed if resident else self.packed_keys)
        if resident:   # in memory for good: the file pages that conversion copied are not kept as well
            release_unviewed(mappings, block.params.values())
        block.mappings, block.buffers, block.pool = mappings, buffers, self._pool
        block.read_seconds = time.perf_counter() - started
        return block

    def to_device(self, index: int, tensors: dict[str, torch.Tensor | quant.QuantizedTensor],
                  packed: frozenset[str] = frozenset()) -> LoadedBlock:
        """Checkpoint tensors -> the block's parameters on the device. On CUDA the bytes are copied as read
        (from page-locked memory, on the copy stream), then dequantized (but the `packed` ones) and converted
        there: a quantized block crosses the bus as its codes."""
        if self._copy_stream is None:
            return LoadedBlock(index, self.mapper.convert(tensors), 0.0)
        host = {name: _pinned(t) for name, t in tensors.items()}
        with torch.cuda.stream(self._copy_stream):
            moved = {name: _copied(t, self.device, name in packed) for name, t in host.items()}
            params = self.mapper.convert(moved)
            ready = torch.cuda.Event()
            ready.record(self._copy_stream)
        return LoadedBlock(index, params, 0.0, ready, host)

    def load_piece(self, key: tuple[int, int]) -> LoadedBlock:
        """Piece `key` = (block, piece) as planned; the whole block where the plan says None."""
        index, piece = key
        names = self._pieces[key]
        if key in self._kept:
            started = time.perf_counter()
            item = self.to_device(index, self._kept[key], self.packed_keys)
            item.piece, item.read_seconds = piece, time.perf_counter() - started
            return item
        if names is None:
            item = self.load(index)
            item.piece = piece
            return item
        started = time.perf_counter()
        self._verify_block(index)
        self._count(names)
        mappings: list = []
        buffers: list = []
        keep = self._pool.pin and self._reserve(key)
        try:
            located = None
            if self.direct or self.dropped or self._pool.pin:
                try:
                    located = self._read_piece_into_buffer(key, buffers, keep)
                except DirectUnsupported:
                    self.reading = "mapped"
                    if self._pool.pin:
                        located = self._read_piece_into_buffer(key, buffers, keep)
            if located is None:
                mapped = map_ranges(self.store, names, mappings)
                located = lambda file_name, offset: (mapped[file_name], offset)  # noqa: E731

            def decode() -> dict[str, torch.Tensor]:
                return self._decode(key, names, located, buffers, keep)

            if self._pool.pin:
                tensors = decode()
                item = self.to_device(index, self._keep(key, tensors, buffers) if keep else tensors, self.packed_keys)
            elif self.decode_in_reader or not self._decoded.get(key):
                item = self.to_device(index, decode(), self.packed_keys)
            else:
                item = LoadedBlock(index, {}, 0.0, decode=lambda: self.mapper.convert(decode()))
        except BaseException:
            self._pool.give(buffers)
            if keep:
                self._unreserve(key)
            raise
        item.piece = piece
        item.mappings, item.buffers, item.pool = mappings, buffers, self._pool
        item.read_seconds = time.perf_counter() - started
        return item

    def _verify_block(self, index: int) -> None:
        """The first piece read of a block checks its files whole, as a whole-block read would."""
        part = self.part(index)
        with self._verifying:   # the prefetcher's readers may be reading two pieces of the block at once
            if not self._verify or part in self._verified:
                return
            for file_name in self.store.part_files(part):
                if self.direct or self.dropped:
                    try:
                        verify_unkept(self.store, file_name, self.direct)
                        continue
                    except DirectUnsupported:
                        self.reading = "mapped"
                verify_mapped(self.store, file_name)
            self._verified.add(part)

    def _read_piece_into_buffer(self, key: tuple[int, int], buffers: list,
                                exact: bool = False) -> Callable[[str, int], tuple[mmap.mmap, int]]:
        """Read the piece's ranges into one pool buffer (with O_DIRECT when `direct`; of the piece's own
        size when `exact`, else its group's); returns where a file offset landed in it."""
        buffer = self._pool.take(self._exact[key][0] if exact else self._capacity[key])
        buffers.append(buffer)
        placed: dict[str, list[tuple[int, int, int]]] = {}   # file -> (begin, end, position in buffer)
        at = 0
        for file_name, ranges in self._layouts[key]:
            start = at
            at = read_ranges(self.store, file_name, ranges, buffer, at, self.direct, drop=self.dropped)
            placed[file_name] = []
            for begin, end in ranges:
                placed[file_name].append((begin, end, start))
                start += end - begin

        def located(file_name: str, offset: int) -> tuple[mmap.mmap, int]:
            ranges = placed[file_name]
            begin, _, position = next((r for r in ranges if r[0] <= offset < r[1]), ranges[0])  # no bytes: anywhere
            return buffer, position + offset - begin

        return located

    def _decode(self, key: tuple[int, int], names: list[str], located: Callable[[str, int], tuple[mmap.mmap, int]],
                buffers: list, exact: bool = False) -> dict[str, torch.Tensor]:
        """The piece's tensors viewing the bytes read; quantized ones dequantized into one pool buffer,
        reused piece after piece: fresh tensors per piece would spend dequantization's time on page faults
        (docs/BENCHMARKS.md, section "Quantized stores")."""
        def view(file_name: str, offset: int, dtype: str, shape: list[int]) -> torch.Tensor:
            return tensor_from_bytes(*located(file_name, offset), dtype, shape)

        output, at = None, 0
        tensors = {}
        for name in names:
            record = self.store.manifest.tensors[name]
            stored = view(record.file, record.offset, record.dtype, record.shape)
            if record.quant:
                absmax = record.quant["absmax"]
                scales = view(record.file, absmax["offset"], absmax["dtype"], absmax["shape"])
            if name in self.packed_keys or name in self._codes_to_device:
                stored = quant.QuantizedTensor(stored, scales, record.quant)
            elif record.quant:
                if output is None:
                    output = self._pool.take(self._exact[key][1] if exact else self._decoded[key])
                    buffers.append(output)
                meta = record.quant
                count = math.prod(meta["shape"])
                out = torch.frombuffer(output, dtype=quant.DTYPES[meta["dtype"]], count=count, offset=at) if count else None
                stored = quant.dequantize(stored, scales, meta, out)
                at += self._decoded_bytes(name)
            tensors[name] = stored
        return tensors

    def _decoded_bytes(self, name: str) -> int:
        """Bytes a quantized tensor takes dequantized, rounded up to a cache line (0 when not quantized or
        handed over packed)."""
        record = self.store.manifest.tensors[name]
        if not record.quant or name in self.packed_keys or name in self._codes_to_device:
            return 0
        return -(-quant.dequantized_nbytes(record.quant) // 64) * 64


def _pinned(tensor: torch.Tensor | quant.QuantizedTensor) -> torch.Tensor | quant.QuantizedTensor:
    """The tensor in page-locked memory (itself when it views a pinned read buffer already)."""
    if isinstance(tensor, quant.QuantizedTensor):
        data, absmax = _pinned(tensor.data), _pinned(tensor.absmax)
        return tensor if data is tensor.data and absmax is tensor.absmax else quant.QuantizedTensor(data, absmax, tensor.meta)
    return tensor if tensor.is_pinned() else tensor.pin_memory()


def _copied(tensor: torch.Tensor | quant.QuantizedTensor, device: torch.device,
            packed: bool = False) -> torch.Tensor | quant.QuantizedTensor:
    """A pinned host tensor copied to `device` (asynchronously, on the current stream); codes dequantized there
    unless `packed` (multiplied from the codes: quant_triton.py)."""
    if isinstance(tensor, quant.QuantizedTensor):
        data, absmax = (t.to(device, non_blocking=True) for t in (tensor.data, tensor.absmax))
        return quant.QuantizedTensor(data, absmax, tensor.meta) if packed else quant.dequantize(data, absmax, tensor.meta)
    return tensor.to(device, non_blocking=True)


def _nbytes(tensor: torch.Tensor | quant.QuantizedTensor) -> int:
    return sum(part.nbytes for part in quant.held_by(tensor))


def _layout(store: Store, names: list[str]) -> Layout:
    """Per file, the page-aligned byte ranges holding these tensors (and their scales), merged where they touch."""
    by_file: dict[str, list[tuple[int, int]]] = {}
    for name in names:
        record = store.manifest.tensors[name]
        by_file.setdefault(record.file, []).extend((b // ALIGN * ALIGN, aligned(e)) for b, e in spans(record))
    layout = []
    for file_name in sorted(by_file):
        merged: list[tuple[int, int]] = []
        for begin, end in sorted(by_file[file_name]):
            if merged and begin <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
            else:
                merged.append((begin, end))
        layout.append((file_name, merged))
    return layout
