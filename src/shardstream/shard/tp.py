"""Tensor-parallel slices: each rank's share of every dense tensor, one file per rank per part.

Roles come from one table keyed by the Linear module's name. A column-parallel layer (q, k, v,
gate, up, fused qkv) is split along its output features, a row-parallel one (o, down) along its
input features, embeddings and LM heads along the vocabulary; 1-D tensors are replicated, and a
bias follows its weight's output split (a row-parallel bias is replicated: it is added once, after
the all-reduce). GPT-2's Conv1D stores weights as [in, out], so its dims are swapped. Fused
projections (qkv_proj, gate_up_proj, query_key_value, c_attn) are split as one block of rows, which
round-trips exactly; a runtime that wants whole heads per rank must re-order them first.
Quantized stores are sliced after dequantization, so slices are stored in the original dtype.
"""

from __future__ import annotations

import torch

from ..errors import InvalidOption
from ..store.manifest import FileRecord
from ..store.partfile import encode_part
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


def export_tp(store: Store, size: int) -> list[SliceRecord]:
    """Write every part's slices for `size` ranks (experts excluded: they are placed, not sliced)."""
    if size < 1:
        raise InvalidOption(f"--tp must be at least 1, got {size}; pass the number of ranks.")
    index = load_index(store, for_update=True)
    index.slices = [s for s in index.slices if s.count != size]
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
