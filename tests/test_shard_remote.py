"""A store read over a real local HTTP server: verified manifest, whole parts, single tensors by Range."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import shardstream
from http_server import serve_directory
from shardstream.errors import SourceUnreachable, StoreCorrupt, StoreIncomplete
from shardstream.store.remote import open_remote_store
from test_shard_tp import tiny_store


@pytest.fixture
def root(tmp_path, tmp_path_factory):
    copy = tmp_path / "store"
    shutil.copytree(tiny_store("llama", tmp_path_factory, "4bit"), copy)
    return copy


def test_part_and_tensor_match_the_local_store_and_read_only_their_bytes(root):
    local = shardstream.open_store(root)
    with serve_directory(root) as (url, log):
        remote = open_remote_store(url.rstrip("/"))
        assert remote.parts == local.parts
        remote.load("mid/0")   # also reads sharding.json once, if another test sharded the shared tiny store
        log.clear()
        part = remote.load("mid/1")
        assert [(r.path, r.body_bytes) for r in log] == [("/mid/1/weights.safetensors", local.part_nbytes("mid/1"))]
        log.clear()
        name = "model.layers.3.self_attn.q_proj.weight"   # quantized: codes and scales, Range reads
        tensor = remote.load_tensor(name)
    record = local.manifest.tensors[name]
    assert {(r.path, r.status) for r in log} == {("/mid/3/weights.safetensors", 206)}
    assert sum(r.body_bytes for r in log) == record.length + record.quant["absmax"]["length"]
    assert torch.equal(tensor, local.load_tensor(name))
    want = local.load("mid/1")
    assert set(part) == set(want) and all(torch.equal(part[n], want[n]) for n in want)


def test_corrupt_file_is_named_and_never_used(root):
    path = root / "mid/2/weights.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(data)
    with serve_directory(root) as (url, _):
        remote = open_remote_store(url)
        with pytest.raises(StoreCorrupt, match=r"mid/2/weights.safetensors fails its checksum; re-upload"):
            remote.load("mid/2")
        assert remote.load("mid/0")


def test_edited_manifest_is_refused(root):
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["family"] = "gpt2"
    (root / "manifest.json").write_text(json.dumps(manifest))
    with serve_directory(root) as (url, _):
        with pytest.raises(StoreCorrupt, match="manifest.json fails its own checksum"):
            open_remote_store(url)


def test_missing_file_and_server_without_ranges(root):
    (root / "end/weights.safetensors").unlink()
    with serve_directory(root, ranges=False) as (url, _):
        remote = open_remote_store(url)
        with pytest.raises(StoreIncomplete, match="end/weights.safetensors does not exist on the server"):
            remote.load("end")
        with pytest.raises(SourceUnreachable, match="supports Range requests"):
            remote.load_tensor("model.layers.0.self_attn.q_proj.weight")
    with pytest.raises(SourceUnreachable, match="could not be fetched"):
        open_remote_store(url)
