"""Tensor-parallel slices: each rank's share of every dense tensor, one file per rank per part.

Roles come from one table keyed by the Linear module's name. A column-parallel layer (q, k, v,
gate, up, fused qkv) is split along its output features, a row-parallel one (o, down) along its
input features, embeddings and LM heads along the vocabulary; 1-D tensors are replicated, and a
bias follows its weight's output split (a row-parallel bias is replicated: it is added once, after
the all-reduce). GPT-2's Conv1D stores weights as [in, out], so its dims are swapped.

For the families tensor-parallel ranks run (tp/layout.py), each rank's file holds exactly the share
that rank runs, by the same rules and the same writer as a rank that writes its own shares
(tp/rankstore.py): fused projections by whole heads and halves, KV heads replicated when fewer than
ranks, a quantized share kept as its codes where it falls on quantization blocks. Their slice records
name the `ranges` they concatenate. Other families' fused projections (query_key_value, c_attn) are
split as one block of rows, and quantized tensors are sliced after dequantization.
"""

from __future__ import annotations

import torch

from ..errors import InvalidOption, UnsupportedModel
from ..store.manifest import FileRecord
from ..store.partfile import encode_part
from ..store.lock import editing
from ..store.reader import Store
from ..store.writer import write_encoded
from ..store.sharding import SliceRecord, load_index

COLUMN = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "qkv_proj", "gate_up_proj",
          "query_key_value", "dense_h_to_4h", "c_attn", "c_fc"}
ROW = {"o_proj", "down_proj", "dense", "dense_4h_to_h", "c_proj"}
VOCAB = {"embed_tokens", "lm_head", "wte", "word_embeddings", "embed_in", "embed_out"}
CONV1D_FAMILIES = {"gpt2"}


def split_dim(name: str, ndim: int, family: str) -> int | None:
    """The dim `name` is split along for TP, or None when every rank gets all of it."""
    module, _, kind = name.rpartition(".")
    role = module.rpartition(".")[2]
    swapped = family in CONV1D_FAMILIES and ndim == 2
    if role in VOCAB and kind == "weight":
        return 0
    if role in COLUMN:
        return 1 if swapped else 0
    if role in ROW and kind == "weight":
        return 0 if swapped else 1
    return None


def tp_file(part: str, rank: int, size: int) -> str:
    """dense/layer_<l>/... for block l, dense/start/... and dense/end/... for the rest."""
    folder = part.replace("mid/", "layer_")
    return f"dense/{folder}/rank_{rank}_of_{size}.safetensors"


def slice_tensor(tensor: torch.Tensor, dim: int | None, rank: int, size: int, name: str) -> torch.Tensor:
    if dim is None:
        return tensor
    if tensor.shape[dim] % size:
        raise InvalidOption(
            f"{name} is {tensor.shape[dim]} long along dim {dim}, which {size} ranks cannot share "
            "equally; pick a --tp that divides it."
        )
    return tensor.chunk(size, dim)[rank]


@editing
def export_tp(store: Store, size: int) -> list[SliceRecord]:
    """Write every part's slices for `size` ranks (experts excluded: they are placed, not sliced)."""
    if size < 1:
        raise InvalidOption(f"--tp must be at least 1, got {size}; pass the number of ranks.")
    index = load_index(store, for_update=True)
    index.slices = [s for s in index.slices if s.count != size]
    layouts = _rank_layouts(store, size)
    if layouts is not None:
        _export_shares(store, size, layouts, index)
        index.save(store)
        return index.slices
    experts = store.expert_tensor_names()
    family = store.manifest.family
    for part in store.parts:
        tensors = {n: t for n, t in store.load(part, verify=True, experts=False).items() if n not in experts}
        for rank in range(size):
            local = {n: slice_tensor(t, split_dim(n, t.ndim, family), rank, size, n) for n, t in tensors.items()}
            encoded = encode_part(local, None)
            name = tp_file(part, rank, size)
            digest = write_encoded(store.root / name, encoded)
            index.files[name] = FileRecord(size=encoded.size, xxh3_128=digest)
            index.slices += [
                SliceRecord(tensor=n, part=part, rank=rank, count=size, split_dim=split_dim(n, tensors[n].ndim, family),
                            file=name, **r)
                for n, r in sorted(encoded.records.items())
            ]
    index.save(store)
    return index.slices


def _rank_layouts(store: Store, size: int) -> list | None:
    """Each rank's shares where tensor-parallel ranks run the store's family (None otherwise), MoE experts
    left out. A row-parallel bias is exported whole to every rank, as a replicated tensor (the rank that
    must not add it writes its own shares instead: tp/rankstore.exported_view)."""
    from ..stream.meta import build_meta_model
    from ..tp.layout import WHOLE, tp_roles
    from ..tp.rankstore import rank_layout

    try:
        model = build_meta_model(store, None)
        tp_roles(model)
    except UnsupportedModel:
        return None
    layouts = [rank_layout(store, model, rank, size) for rank in range(size)]
    for layout in layouts:
        layout.shares = {key: WHOLE if share.zeros else share for key, share in layout.shares.items()
                         if key not in layout.experts.stored}
    return layouts


def _export_shares(store: Store, size: int, layouts: list, index) -> None:
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
