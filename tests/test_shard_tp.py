"""Tensor-parallel slices: each rank's are its shares, they round-trip, a rank reads only its own bytes, and a
family tensor-parallel ranks do not run is refused."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import warm_python
import torch

import shardstream
from http_server import serve_directory
from shardstream.convert import convert
from shardstream.errors import InvalidOption, StoreCorrupt, StoreIncomplete, UnsupportedModel
from shardstream.shard import INDEX_NAME, export_tp, load_index, load_tp
from shardstream.store import MANIFEST_NAME
from shardstream.store.manifest import canonical_json, sealed
from shardstream.store.remote import open_remote_store
from shardstream.stream.meta import build_meta_model
from shardstream.tp.layout import WHOLE, Take
from shardstream.tp.rankstore import rank_layout
from tiny_models import save_checkpoint

SRC = Path(__file__).resolve().parents[1] / "src"

_STORES: dict[tuple, Path] = {}


def tiny_store(family: str, tmp_path_factory, compression: str | None = None) -> Path:
    """A converted tiny store per (family, compression), built once per test session."""
    key = (family, compression)
    if key not in _STORES:
        folder = tmp_path_factory.mktemp(f"{family}-{compression}")
        save_checkpoint(family, folder / "src")
        convert(folder / "src", folder / "store", compression=compression, progress=False)
        _STORES[key] = folder / "store"
    return _STORES[key]


def _joined(pieces: list[torch.Tensor], records: list, like: torch.Tensor) -> torch.Tensor:
    """The ranks' slices put back where their `ranges` say."""
    dim = records[0].split_dim
    if dim is None:
        return pieces[0]
    out = torch.full_like(like, float("nan"))
    for piece, record in zip(pieces, records):
        at = 0
        for start, stop in record.ranges:
            out.narrow(dim, start, stop - start).copy_(piece.narrow(dim, at, stop - start))
            at += stop - start
    return out


def _rank_shares(store, rank: int, size: int) -> dict[str, Take]:
    """What a rank of `size` runs of each stored dense tensor (tp/layout.py), as the export writes it: a
    row-parallel bias whole on every rank."""
    layout = rank_layout(store, build_meta_model(store, None), rank, size)
    return {key: WHOLE if share.zeros else share for key, share in layout.shares.items()
            if key not in layout.experts.stored}


def _cut(tensor: torch.Tensor, share: Take) -> torch.Tensor:
    """The share's ranges of `tensor`, concatenated (all of it when the share is not split)."""
    if share.dim is None:
        return tensor
    return torch.cat([tensor.narrow(share.dim, start, stop - start) for start, stop in share.ranges], share.dim)


@pytest.mark.parametrize("family, compression", [
    ("llama", None), ("qwen2", None), ("phi3", None), ("mixtral", None),
    ("llama", "4bit"), ("llama", "8bit"), ("llama", "int4"),
])
def test_all_ranks_concatenate_to_the_original(family, compression, tmp_path_factory, tmp_path):
    """Each rank's exported slices are its shares of the whole store's tensors, and put back by their ranges
    the slices of 4 ranks are the tensors (KV heads, 2 here, replicated). On a copy: test_shard_experts
    measures the converted Mixtral store on disk."""
    root = tmp_path / "store"
    shutil.copytree(tiny_store(family, tmp_path_factory, compression), root)
    store = shardstream.open_store(root)
    export_tp(store, 4)
    records = {(s.tensor, s.rank): s for s in load_index(store).slices if s.count == 4}
    shares = [_rank_shares(store, rank, 4) for rank in range(4)]
    for part in store.parts:
        original = store.load(part, tied=False)   # dequantized when the store is quantized
        ranks = [load_tp(store, part, rank, 4) for rank in range(4)]
        dense = {n for n in original if store.manifest.tensors[n].expert is None}
        assert dense and all(set(r) == dense for r in ranks)
        for name in dense:
            for rank in range(4):
                assert torch.equal(ranks[rank][name], _cut(original[name], shares[rank][name])), (name, rank)
            joined = _joined([r[name] for r in ranks], [records[name, rank] for rank in range(4)], original[name])
            assert joined.dtype == original[name].dtype and torch.equal(joined, original[name]), name
    assert any(s.split_dim is not None for s in records.values())
    assert all(s.ranges is not None for s in records.values() if s.split_dim is not None)


def test_a_tied_head_is_the_embedding_slice(tmp_path_factory):
    """qwen2 ties its head to the embedding: the export holds the embedding's vocabulary slices once (in the
    start's rank files), and a rank's head is its slice of them."""
    store = shardstream.open_store(tiny_store("qwen2", tmp_path_factory))
    export_tp(store, 2)
    assert "lm_head.weight" in store.manifest.aliases
    assert "lm_head.weight" not in {s.tensor for s in load_index(store).slices}
    embedding = store.load("start")["model.embed_tokens.weight"]
    rank1 = load_tp(store, "start", 1, 2)["model.embed_tokens.weight"]
    assert torch.equal(rank1, embedding[64:])


def test_fused_projections_are_exported_by_heads_and_halves(tmp_path_factory):
    """A phi3 rank's qkv_proj slice is its q heads, then its k and v heads; its gate_up_proj its share of
    each half: what the rank runs (tp/layout.py), not one block of rows."""
    store = shardstream.open_store(tiny_store("phi3", tmp_path_factory))
    export_tp(store, 2)
    records = {(s.tensor, s.rank): s for s in load_index(store).slices if s.count == 2}
    qkv, gate_up = "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"
    assert records[qkv, 1].ranges == [[16, 32], [40, 48], [56, 64]]   # head_dim 8: q heads 2-3, k and v head 1
    assert records[gate_up, 1].ranges == [[32, 64], [96, 128]]


def test_quantized_slices_keep_their_codes_on_block_boundaries(tmp_path_factory):
    """4-bit blocks of 64 values: q_proj's rows (16 x 32 values) are whole blocks and stay codes; o_proj's
    columns (16 of each row of 32) are not, and are stored dequantized."""
    store = shardstream.open_store(tiny_store("llama", tmp_path_factory, "4bit"))
    export_tp(store, 2)
    records = {(s.tensor, s.rank): s for s in load_index(store).slices if s.count == 2}
    q = records["model.layers.0.self_attn.q_proj.weight", 1]
    assert q.quant["shape"] == [16, 32] and q.dtype == "U8" and q.length == 16 * 32 // 2
    o = records["model.layers.0.self_attn.o_proj.weight", 1]
    assert o.quant is None and o.shape == [32, 16] and o.dtype == "F32"


def test_rank_reads_only_its_own_bytes_over_http(tmp_path_factory):
    root = tiny_store("llama", tmp_path_factory)
    export_tp(shardstream.open_store(root), 4)
    with serve_directory(root) as (url, log):
        store = open_remote_store(url)
        before = len(log)
        tensors = store.load("mid/2", tp_rank=1, tp_size=4)   # the API, over HTTP
        reads = log[before:]
    assert tensors["model.layers.2.self_attn.q_proj.weight"].shape == (8, 32)
    files = sorted(r.path.lstrip("/") for r in reads)
    assert files == ["dense/layer_2/rank_1_of_4.safetensors", INDEX_NAME]
    rank_file = root / "dense/layer_2/rank_1_of_4.safetensors"
    assert sum(r.body_bytes for r in reads) == rank_file.stat().st_size + (root / INDEX_NAME).stat().st_size
    assert rank_file.stat().st_size < (root / "mid/2/weights.safetensors").stat().st_size / 3


def test_corrupt_slice_is_named_and_other_ranks_still_load(tmp_path_factory, tmp_path):
    root = tmp_path / "store"
    shutil.copytree(tiny_store("llama", tmp_path_factory), root)
    store = shardstream.open_store(root)
    export_tp(store, 2)
    bad = root / "dense/layer_1/rank_0_of_2.safetensors"
    data = bytearray(bad.read_bytes())
    data[-3] ^= 0xFF
    bad.write_bytes(data)
    with pytest.raises(StoreCorrupt, match="dense/layer_1/rank_0_of_2.safetensors fails its checksum and is not used; "
                                           r"rewrite a TP slice with `shardstream shard --tp`"):
        load_tp(store, "mid/1", 0, 2)
    q = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(load_tp(store, "mid/1", 1, 2)[q], store.load("mid/1")[q][16:])
    export_tp(store, 2)   # re-running rewrites the damaged file
    assert torch.equal(load_tp(store, "mid/1", 0, 2)[q], store.load("mid/1")[q][:16])


def test_a_part_without_slices_for_that_many_ranks_is_one_sentence(tmp_path_factory, tmp_path):
    root = tmp_path / "store"
    shutil.copytree(tiny_store("llama", tmp_path_factory), root)
    store = shardstream.open_store(root)
    export_tp(store, 2)
    with pytest.raises(StoreIncomplete) as refused:
        load_tp(store, "mid/0", 0, 8)
    assert str(refused.value) == (f"{root} has no rank 0 of 8 slices for 'mid/0'; run "
                                  f"`shardstream shard {root} --tp 8` first.")


@pytest.mark.parametrize("rank, size, words", [(1, None, "give both tp_rank and tp_size"),
                                                (None, 2, "give both tp_rank and tp_size"),
                                                (2, 2, r"tp_rank must be in \[0, tp_size\)")])
def test_half_given_or_impossible_rank_is_refused(tmp_path_factory, rank, size, words):
    store = shardstream.open_store(tiny_store("llama", tmp_path_factory))
    with pytest.raises(InvalidOption, match=words):
        store.load("mid/0", tp_rank=rank, tp_size=size)


def test_indivisible_split_is_refused(tmp_path_factory):
    store = shardstream.open_store(tiny_store("llama", tmp_path_factory))
    with pytest.raises(UnsupportedModel, match="num_attention_heads is 4: attention heads cannot be split equally over 3 ranks"):
        export_tp(store, 3)
    assert not any(s.count == 3 for s in load_index(store).slices)


@pytest.mark.parametrize("family", ["gpt2", "falcon", "gpt_neox"])
def test_a_family_ranks_do_not_run_is_refused_by_name(family, tmp_path_factory, tmp_path):
    """No TP plan, no tensor-parallel ranks: `shard --tp` says so in one sentence and writes nothing."""
    root = tmp_path / "store"
    shutil.copytree(tiny_store(family, tmp_path_factory), root)
    before = {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    done = warm_python.run([sys.executable, "-m", "shardstream", "shard", str(root), "--tp", "2"],
                           capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 1
    assert done.stderr == (
        "error: tensor parallelism supports model_type llama, mistral, qwen2, qwen3, gemma, phi3, mixtral, qwen2_moe, "
        f"qwen3_moe; this store's is {family!r}: leave out --tp and run it without --tensor-parallel (layer streaming).\n")
    assert {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()} == before
    assert not (root / INDEX_NAME).exists() and not (root / "dense").exists()


def test_index_edit_is_detected(tmp_path_factory, tmp_path):
    root = tmp_path / "store"
    shutil.copytree(tiny_store("llama", tmp_path_factory), root)
    store = shardstream.open_store(root)
    export_tp(store, 2)
    path = root / INDEX_NAME
    path.write_text(path.read_text().replace('"rank": 1', '"rank": 0', 1))
    with pytest.raises(StoreCorrupt, match="sharding.json fails its own checksum"):
        load_tp(store, "mid/0", 0, 2)
    assert (root / MANIFEST_NAME).exists()


def test_index_versions_older_are_read_newer_are_refused(tmp_path_factory, tmp_path):
    """Version 1 (slices without ranges, as shardstream wrote them before) loads; this version writes 3 (2 since
    those fields, 3 since expert containers), so that a shardstream reading only an older one refuses it with
    its sentence; a newer one is refused."""
    root = tmp_path / "store"
    shutil.copytree(tiny_store("llama", tmp_path_factory), root)
    store = shardstream.open_store(root)
    export_tp(store, 2)
    expected = load_tp(store, "mid/1", 0, 2)
    path = root / INDEX_NAME
    body = {k: v for k, v in json.loads(path.read_text()).items() if k != "checksum"}
    assert body["format_version"] == 3
    old = {**body, "format_version": 1,
           "slices": [{k: v for k, v in s.items() if k not in ("ranges", "quant")} for s in body["slices"]]}
    path.write_bytes(canonical_json(sealed(old)))
    loaded = load_tp(shardstream.open_store(root), "mid/1", 0, 2)
    assert loaded.keys() == expected.keys() and all(torch.equal(loaded[n], expected[n]) for n in expected)
    path.write_bytes(canonical_json(sealed({**body, "format_version": 4})))
    with pytest.raises(StoreCorrupt, match="sharding.json was written by a newer shardstream; upgrade shardstream"):
        load_tp(shardstream.open_store(root), "mid/1", 0, 2)
