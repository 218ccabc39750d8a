"""Tensor-parallel slices: each rank's share of every dense tensor, one file per rank per part.

The shares are the ones tensor-parallel ranks run (tp/layout.py, from the model's own TP plan), written
by the same code as a rank that writes its own shares (tp/rankstore.py): fused projections by whole heads
and halves, KV heads replicated when fewer than ranks, a quantized share kept as its codes where it falls
on quantization blocks. Slice records name the `ranges` they concatenate. A family those ranks do not run
has no shares to export and is refused: one split table, so an export is always what a rank reads.
"""

from __future__ import annotations

from ..errors import InvalidOption
from ..store.manifest import FileRecord
from ..store.lock import editing
from ..store.reader import Store
from ..store.writer import write_encoded
from ..store.sharding import ShardIndex, SliceRecord, load_index


def tp_file(part: str, rank: int, size: int) -> str:
    """dense/layer_<l>/... for block l, dense/start/... and dense/end/... for the rest."""
    folder = part.replace("mid/", "layer_")
    return f"dense/{folder}/rank_{rank}_of_{size}.safetensors"


@editing
def export_tp(store: Store, size: int) -> list[SliceRecord]:
    """Write every part's slices for `size` ranks (experts excluded: they are placed, not sliced); the index
    is saved once all of them are written, and a family ranks do not run is refused before any is."""
    if size < 1:
        raise InvalidOption(f"--tp must be at least 1, got {size}; pass the number of ranks.")
    layouts = _rank_layouts(store, size)
    index = load_index(store, for_update=True)
    index.slices = [s for s in index.slices if s.count != size]
    _export_shares(store, size, layouts, index)
    index.save(store)
    return index.slices


def _rank_layouts(store: Store, size: int) -> list:
    """Each rank's shares, MoE experts left out. A row-parallel bias is exported whole to every rank, as a
    replicated tensor (the rank that must not add it writes its own shares instead: tp/rankstore.exported_view)."""
    from ..stream.meta import build_meta_model
    from ..tp.layout import WHOLE, check_family
    from ..tp.rankstore import rank_layout

    model = build_meta_model(store, None)
    check_family(model.config, "leave out --tp and run it without --tensor-parallel (layer streaming)")
    layouts = [rank_layout(store, model, rank, size) for rank in range(size)]
    for layout in layouts:
        layout.shares = {key: WHOLE if share.zeros else share for key, share in layout.shares.items()
                         if key not in layout.experts.stored}
    return layouts


def _export_shares(store: Store, size: int, layouts: list, index: ShardIndex) -> None:
    """Every part's rank files, each holding exactly its rank's shares (tp/rankstore.py)."""
    from ..tp.rankstore import encode_rank_part
    from ..tp.reading import ShareReader

    reader = ShareReader(store)
    for part in store.parts:
        for rank in range(size):
            encoded = encode_rank_part(store, part, layouts[rank], reader, experts=False)
            name = tp_file(part, rank, size)
            digest = write_encoded(store.root / name, encoded)
            index.files[name] = FileRecord(size=encoded.size, xxh3_128=digest)
            for tensor, record in sorted(encoded.records.items()):
                share = layouts[rank].shares[tensor]
                index.slices.append(SliceRecord(
                    tensor=tensor, part=part, rank=rank, count=size, split_dim=share.dim, file=name,
                    ranges=None if share.dim is None else [list(r) for r in share.ranges], **record))
