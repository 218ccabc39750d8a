"""The embedding and the LM head of a real vocabulary: rows read by offset, the head streamed in slices.

A 128k-152k vocabulary makes the embedding matrix (and an untied head) 0.5-1 GB in bf16, as much as
several blocks. The embedding needs only the rows of the tokens in a pass: when it is not in memory
anyway, those rows are read by their offsets in the store file (a few KB per token). The head needs
its whole matrix for every token, as a block does: it stays resident when it fits the resident
budget beside the streamed blocks' working set (and a tied embedding is then that same tensor),
else it is streamed like a block, in slices of rows of one piece's size, the next slice read by a
reader thread while the current one multiplies. Matrices of at least `STREAMED_BYTES` whose rows lie in
runs of the file are handled so (`by_rows`): plainly stored ones (in the parameter's dtype and shape, or
held as stored by a float32 model: WeightMapper.held_as_stored), and 4-bit or 8-bit ones whose rows are
whole blocks of codes, so that a row's codes and its scales are each one run; the rest stay resident.
Each is counted at its stored size, the size it has in memory: a half-precision matrix of a float32
model is never converted whole, nor a quantized one dequantized whole: the rows of a pass (the
embedding) are converted or dequantized, and the head multiplied slice by slice, in float32 by
half_linear.py or from the slice's codes by quant_linear.py (a quantized head is handled only where the
loader holds it packed for that kernel). A streamed matrix's file is checksummed whole on its first use, through a small
buffer, as a streamed block's is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch
from torch import nn

from .. import quant
from ..store import Store
from ..store.direct_io import ALIGN, DirectUnsupported, aligned
from ..store.dtypes import TORCH_DTYPES
from ..store.manifest import TensorRecord
from ..store.reader import read_spans
from .direct import BufferPool, read_ranges, verify_unkept
from .linear import weight_linear
from .mapped import verify_mapped
from .weights import WeightMapper

STREAMED_BYTES = 16 << 20   # smaller matrices (toy vocabularies) stay resident: reading them costs little


@dataclass(frozen=True)
class StoredMatrix:
    """Where a 2-D parameter's rows lie in the store: `rows` x `cols` of `dtype` from `offset` of `file`; of a
    quantized one (`quant`: its meta, quant.py), their codes from `offset` and their scales from `scales`."""

    name: str   # the parameter
    key: str    # the stored tensor
    file: str
    offset: int
    rows: int
    cols: int
    dtype: torch.dtype   # the values' (a quantized matrix's: what its codes decode to)
    quant: dict | None = None
    scales: int = 0

    @property
    def arrays(self) -> list[tuple[int, int, torch.dtype]]:
        """(file offset, bytes a row, element dtype) of each array holding the rows: the values, or the codes
        and the scales (a row is whole blocks: its codes and its scales are each one run)."""
        if self.quant is None:
            return [(self.offset, self.cols * self.dtype.itemsize, self.dtype)]
        method = self.quant["method"]
        scale = quant.SCALE_DTYPES[method]
        return [(self.offset, self.cols * quant.CODE_BITS[method] // 8, torch.uint8),
                (self.scales, self.cols // self.quant["blocksize"] * scale.itemsize, scale)]

    @property
    def row_bytes(self) -> int:
        """Stored bytes a row (codes and scales of a quantized one)."""
        return sum(row for _, row, _ in self.arrays)

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    def matrix(self, arrays: list[torch.Tensor], rows: int) -> torch.Tensor | quant.QuantizedTensor:
        """`rows` consecutive rows from their flat `arrays` (as `arrays` lists them): the values, or the codes
        and scales as a quantized matrix of their own."""
        if self.quant is None:
            return arrays[0].view(rows, self.cols)
        return quant.QuantizedTensor(*arrays, {**self.quant, "shape": [rows, self.cols]})


def by_rows(record: TensorRecord) -> bool:
    """Whether a stored matrix's rows lie in runs of its file, so that some of them can be read by offset: a
    plain one, or 4-bit or 8-bit codes whose rows are whole blocks. int4 interleaves its rows in groups of 16
    (quant_int4.py), so such a matrix stays held packed."""
    meta = record.quant
    if not meta:
        return len(record.shape) == 2
    shape = meta.get("shape", [])
    return meta.get("method") in quant.BLOCKWISE and len(shape) == 2 and shape[1] % meta["blocksize"] == 0


def _stored(store: Store, mapper: WeightMapper, param: str, expected: torch.Tensor) -> StoredMatrix | None:
    """The matrix that fills `param` (an alias resolved to its target), if its rows can be read by offset
    (`by_rows`): a plain one in the parameter's dtype or held as stored (WeightMapper.held_as_stored), or 4-bit
    or 8-bit codes (decoded into the parameter's dtype, as a packed one is)."""
    for part in store.parts:
        if part.startswith("mid/"):
            continue
        for key in store.tensor_names(part):
            if mapper.linear_weight(key, {param}) is None:
                continue
            target = store.manifest.aliases.get(key, {}).get("target", key)
            record = store.manifest.tensors.get(target)
            if record is None or not by_rows(record):
                return None
            meta = record.quant
            if meta:
                if meta["shape"] != list(expected.shape):
                    return None
                codes = {k: v for k, v in meta.items() if k != "absmax"}
                return StoredMatrix(param, target, record.file, record.offset, *meta["shape"],
                                    quant.DTYPES[meta["dtype"]], codes, meta["absmax"]["offset"])
            dtype = TORCH_DTYPES.get(record.dtype)
            if list(record.shape) != list(expected.shape) or dtype != expected.dtype and target not in mapper.held_as_stored:
                return None
            return StoredMatrix(param, target, record.file, record.offset, *record.shape, dtype)
    return None


class Ends:
    """The model's big embedding and head matrices, and where each is served from."""

    def __init__(self, store: Store, model: nn.Module, mapper: WeightMapper, device: torch.device,
                 packed: frozenset[str], uses_embedding: bool = True, uses_head: bool = True):
        """`packed`: the stored tensors the loader hands over packed (BlockLoader.packed_keys); a quantized head
        is handled here only where it is one, multiplied from its codes, so that resident it takes its stored
        size (not where the kernel is off, nor tied to an embedding that cannot look up codes: those are
        dequantized whole at load). `uses_embedding`, `uses_head`: whether the model runs them (a pipeline
        stage's first or last block may be another stage's); one left out is not looked for, and a tied pair
        is then no pair."""
        self.store, self.model = store, model
        self.embedding: StoredMatrix | None = None
        self.head: StoredMatrix | None = None
        self.tied = False
        self.head_resident = True
        self._slot_bytes: dict[str, int] = {}   # parameter -> its slot's bytes in the model's dtype
        if device.type != "cpu" or getattr(store, "remote", False) or model.get_output_embeddings() is None:
            return
        params = dict(model.named_parameters(remove_duplicate=False))
        names = {id(module): name for name, module in model.named_modules(remove_duplicate=False)}
        embedding = f"{names[id(model.get_input_embeddings())]}.weight"
        head = f"{names[id(model.get_output_embeddings())]}.weight"
        self._slot_bytes = {name: params[name].nbytes for name in (embedding, head)}
        self.embedding = _stored(store, mapper, embedding, params[embedding]) if uses_embedding else None
        tied_keys = getattr(model, "all_tied_weights_keys", {}) or {}
        found = _stored(store, mapper, head, params[head]) if uses_head else None
        self.tied = uses_embedding and uses_head and (
            tied_keys.get(head) == embedding or (found is not None and self.embedding is not None and
                                                 (found.file, found.offset) == (self.embedding.file, self.embedding.offset)))
        if self.tied and self.embedding is not None:
            found = replace(self.embedding, name=head)
        self.head = found
        if self.head is not None and self.head.quant is not None and self.head.key not in packed:
            self.head = None   # dequantized whole at load: not held at its stored size, nor multiplied from codes
        if self.embedding is not None and self.embedding.nbytes < STREAMED_BYTES:
            self.embedding = None
        if self.head is not None and self.head.nbytes < STREAMED_BYTES:
            self.head = None
        if self.tied and (self.embedding is None or self.head is None):
            self.embedding = self.head = None   # a tied pair is handled together or not at all

    @property
    def names(self) -> set[str]:
        """The parameters handled here (not read with the resident parts until `place` decides)."""
        return {m.name for m in (self.embedding, self.head) if m is not None}

    @property
    def slot_bytes(self) -> int:
        """Their bytes as the model's parameter slots count them (a tied pair: two slots; the model's dtype)."""
        return sum(self._slot_bytes[m.name] for m in (self.embedding, self.head) if m is not None)

    def place(self, budget: int, streaming: int) -> int:
        """Decide: the head stays resident when its stored bytes (what it holds in memory) fit `budget` beside
        the streamed blocks' working set (`streaming`); a tied embedding follows it, an untied one is read by
        rows. Returns the bytes taken from the budget."""
        self.head_resident = self.head is None or self.head.nbytes + streaming <= budget
        return self.head.nbytes if self.head is not None and self.head_resident else 0

    @property
    def streamed(self) -> set[str]:
        """The parameters not read into memory whole: an embedding read by rows, a streamed head."""
        rows = self.embedding is not None and not (self.tied and self.head_resident)
        return ({self.embedding.name} if rows else set()) | ({self.head.name} if not self.head_resident else set())

    def hook(self, pool: BufferPool, capacity: int, reading: Callable[[], str], verify: bool) -> list:
        """Put the row reader and the streamed head in place (the head read as the loader reads blocks at the
        time: `reading()`, direct.READINGS, which a batch engine may switch later); returns what to remove on
        close."""
        handles: list = []
        streamed = self.streamed
        if self.embedding is not None and self.embedding.name in streamed:
            handles += EmbeddingRows(self.store, self.embedding, self.model.get_input_embeddings(), verify).handles
        if self.head is not None and self.head.name in streamed:
            handles.append(StreamedHead(self.store, self.head, self.model.get_output_embeddings(), pool, capacity,
                                        reading, verify))
        return handles


class _Verified:
    """Checks a store file whole once, through a small buffer (nothing of it stays in memory)."""

    def __init__(self, store: Store, file_name: str, verify: bool):
        self._store, self._file, self._pending = store, file_name, verify

    def check(self) -> None:
        if not self._pending:
            return
        try:
            verify_unkept(self._store, self._file)
        except DirectUnsupported:
            verify_mapped(self._store, self._file)
        self._pending = False


class EmbeddingRows:
    """Hooks on the input embedding: before each pass, its weight becomes the rows of the pass's
    distinct tokens (read by offset: values converted to the model's dtype where held as stored, or
    codes and scales dequantized into it) and the ids
    their positions there; after it, a 0-row stand-in (on the CPU, so that `model.device` stays right).
    The module's own forward (a scaled embedding's scale included) runs unchanged."""

    def __init__(self, store: Store, matrix: StoredMatrix, module: nn.Module, verify: bool):
        self._store, self._matrix, self._module = store, matrix, module
        self._verified = _Verified(store, matrix.file, verify)
        self._dtype = module.weight.dtype
        self._standin = nn.Parameter(torch.empty(0, matrix.cols, dtype=self._dtype), requires_grad=False)
        module._parameters["weight"] = self._standin
        self.handles = [module.register_forward_pre_hook(self._before, with_kwargs=True),
                        module.register_forward_hook(self._after)]

    def _before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        ids = args[0] if args else kwargs.pop("input")
        distinct, inverse = torch.unique(ids, return_inverse=True)
        rows = self.read(distinct.tolist()).to(self._dtype)
        module._parameters["weight"] = nn.Parameter(rows, requires_grad=False)
        return (inverse.reshape(ids.shape), *args[1:]), kwargs

    def _after(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        module._parameters["weight"] = self._standin

    def read(self, ids: list[int]) -> torch.Tensor:
        """Rows `ids` (ascending) of the matrix in its values' dtype, consecutive ones in one read of each
        array (the values; or the codes and the scales, then dequantized: the values `dequantize` gives)."""
        self._verified.check()
        matrix = self._matrix
        runs = []   # (first row, rows)
        start = 0
        while start < len(ids):
            end = start + 1
            while end < len(ids) and ids[end] == ids[end - 1] + 1:
                end += 1
            if ids[start] < 0 or ids[end - 1] >= matrix.rows:
                raise IndexError(f"token id out of range for a vocabulary of {matrix.rows}")
            runs.append((ids[start], end - start))
            start = end
        arrays = []
        for offset, row_bytes, dtype in matrix.arrays:
            out = torch.empty(len(ids) * row_bytes, dtype=torch.uint8)
            read_spans(self._store.file_path(matrix.file), [(offset + first * row_bytes, count * row_bytes)
                                                            for first, count in runs], memoryview(out.numpy()))
            arrays.append(out.view(dtype))
        rows = matrix.matrix(arrays, len(ids))
        return quant.dequantize(rows.data, rows.absmax, rows.meta) if isinstance(rows, quant.QuantizedTensor) else rows


class StreamedHead:
    """The LM head's forward, over slices of its rows read one after another into pool buffers of
    `capacity` bytes (the size of a block piece's, so that the pool reuses the same ones): slice k+1
    is read while slice k multiplies (in float32 by half_linear where the model is float32 and the head
    held as stored; from the slice's codes and scales by quant_linear where quantized). The weight slot
    stays on `meta`; its bias (if any) is resident."""

    def __init__(self, store: Store, matrix: StoredMatrix, module: nn.Module, pool: BufferPool, capacity: int,
                 reading: Callable[[], str], verify: bool):
        self._store, self._matrix, self._module, self._pool = store, matrix, module, pool
        self._capacity, self._reading, self._direct_refused = capacity, reading, False
        self._verified = _Verified(store, matrix.file, verify)
        rows = max(1, (capacity - 2 * ALIGN * len(matrix.arrays)) // matrix.row_bytes)
        self.slices = [(r, min(r + rows, matrix.rows)) for r in range(0, matrix.rows, rows)]
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="shardstream-head")
        module.forward = self.forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._verified.check()
        out = x.new_empty(*x.shape[:-1], self._matrix.rows)
        bias = self._module.bias
        pending = self._reader.submit(self._read, *self.slices[0])
        try:
            for k, (begin, end) in enumerate(self.slices):
                current, pending = pending, None
                buffer, weight = current.result()
                try:
                    if k + 1 < len(self.slices):
                        pending = self._reader.submit(self._read, *self.slices[k + 1])
                    out[..., begin:end] = weight_linear(x, weight, None if bias is None else bias[begin:end])
                finally:
                    del weight
                    self._pool.give([buffer])
        finally:
            if pending is not None:   # a failed product: the read in flight still gives its buffer back
                with contextlib.suppress(Exception):
                    self._pool.give([pending.result()[0]])
        return out

    def _read(self, begin: int, end: int):
        """Rows `begin`-`end` into a pool buffer, each array's run as one aligned range after the previous."""
        matrix = self._matrix
        spans, views = [], []   # views: (position in the buffer, bytes, dtype) of each array's rows
        at = 0
        for offset, row_bytes, dtype in matrix.arrays:
            first, last = offset + begin * row_bytes, offset + end * row_bytes
            spans.append((first // ALIGN * ALIGN, aligned(last)))
            views.append((at + first - spans[-1][0], last - first, dtype))
            at += spans[-1][1] - spans[-1][0]
        buffer = self._pool.take(self._capacity)
        mode = self._reading()
        drop = mode == "dropped"
        try:
            try:
                read_ranges(self._store, matrix.file, spans, buffer, 0, mode == "direct" and not self._direct_refused,
                            drop)
            except DirectUnsupported:
                self._direct_refused = True
                read_ranges(self._store, matrix.file, spans, buffer, 0, False, drop)
        except BaseException:
            self._pool.give([buffer])
            raise
        arrays = [torch.frombuffer(buffer, dtype=dtype, count=nbytes // dtype.itemsize, offset=position)
                  for position, nbytes, dtype in views]
        return buffer, matrix.matrix(arrays, end - begin)

    def remove(self) -> None:
        """Stop the reader; the head is not used after."""
        self._module.__dict__.pop("forward", None)
        self._reader.shutdown(wait=True)
