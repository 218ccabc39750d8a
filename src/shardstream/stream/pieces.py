"""A streamed block split into pieces, so that only a few Linears' weights are in memory at a time.

A block's forward uses its big tensors one module at a time (q_proj, k_proj, ..., down_proj, or a
fused MoE `experts`), so the block need not be in memory whole: piece 0 holds its small tensors
(norms, routers, biases of the block itself) for the whole block, and every module holding at
least `MIN_PIECE_BYTES` directly (with no parameters below it) is in a piece, in place only while
it runs. Consecutive such modules of one parent share a piece up to `piece_bytes`, so that a block
is a few large reads rather than many small ones: each piece costs a read, a hand-over between
threads and two hooks. The default, `PIECE_BYTES`, makes the reference model's block three pieces
(its small tensors, q/k/v/o_proj: 16 MiB, gate/up/down_proj: 33 MiB); a batch engine, whose KV
caches want the memory, asks for `BATCH_PIECE_BYTES` (16 MiB: q/k/v/o, then gate, up and down
apart). One stream keeps the larger pieces, as their fewer reads, hand-overs and hooks make it faster
(docs/BENCHMARKS.md, section "One stream"). `named_modules()` order is the forward order of every
family we support (tests/test_stream_pieces.py checks it), so the reader can read pieces ahead in that
order.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

MIN_PIECE_BYTES = 1 << 20
PIECE_BYTES = 64 << 20
BATCH_PIECE_BYTES = 16 << 20


@dataclass(frozen=True)
class Piece:
    """The hooks go on `modules` (the block itself for piece 0): the piece is filled when the first of
    them starts, emptied when all have run; `names` are full parameter names."""

    modules: tuple[nn.Module, ...]
    names: frozenset[str]
    nbytes: int   # in memory (the parameters' dtype), not as stored


def _own(module: nn.Module, full: str, names: set[str], element: int | None) -> dict[str, int]:
    """{full name: bytes} of the tensors `module` holds directly, of those in `names` (`element` bytes per
    value; None: their own dtype's)."""
    own = {}
    for attr, value in [*module._parameters.items(), *module._buffers.items()]:
        name = f"{full}.{attr}" if full else attr
        if value is not None and name in names:
            own[name] = value.numel() * (element or value.element_size())
    return own


def split_block(block: nn.Module, prefix: str, names: set[str], limit: int | None = None,
                element: int | None = None) -> list[Piece]:
    """Pieces of `block` (named `prefix`) covering `names`, the parameters its part provides; siblings
    share a piece up to `limit` bytes (default PIECE_BYTES), each value counted `element` bytes (the
    checkpoint's dtype, so that a store is cut alike in every compute dtype; None: the parameters' own).
    The pieces' `nbytes` are in the same count: the caller sets what they hold in memory."""
    limit = limit or PIECE_BYTES
    small: dict[str, int] = {}
    big: list[Piece] = []
    parents: list[str] = []   # of each big piece's modules
    for module_name, module in block.named_modules():
        full = f"{prefix}.{module_name}" if module_name else prefix
        own = _own(module, full, names, element)
        size = sum(own.values())
        leaf = not any(child._parameters for _, child in module.named_modules() if child is not module)
        if not (module_name and leaf and size >= MIN_PIECE_BYTES):
            small.update(own)
            continue
        parent = module_name.rpartition(".")[0]
        if big and parents[-1] == parent and big[-1].nbytes + size <= limit:
            last = big[-1]
            big[-1] = Piece((*last.modules, module), last.names | frozenset(own), last.nbytes + size)
        else:
            big.append(Piece((module,), frozenset(own), size))
            parents.append(parent)
    return [Piece((block,), frozenset(small), sum(small.values())), *big]


def whole(block: nn.Module, names: set[str], nbytes: int) -> list[Piece]:
    """The block as one piece (a part whose tensors are not all in its own file, a pipeline stage)."""
    return [Piece((block,), frozenset(names), nbytes)]


def held_through(pieces: list[Piece], piece: int) -> bool:
    """Piece 0 of a split block stays in place while the block's other pieces come and go: it is
    small, and the reader does not count it against the pieces in flight (else it would hold a
    slot the next big piece needs)."""
    return piece == 0 and len(pieces) > 1


def largest_counted(plan: dict[int, list[Piece]]) -> int:
    """Bytes of the largest piece that takes one of the reader's slots (not a held-through piece 0)."""
    return max((p.nbytes for ps in plan.values() for i, p in enumerate(ps) if not held_through(ps, i)), default=0)


def working_set(plan: dict[int, list[Piece]], in_flight: int) -> int:
    """Bytes the streamed pieces take at most: `in_flight` counted pieces plus two held-through
    pieces 0 (the running block's and the next one's, read ahead)."""
    held = [ps[0].nbytes for ps in plan.values() if held_through(ps, 0)]
    return in_flight * largest_counted(plan) + min(2, len(plan)) * max(held, default=0)
