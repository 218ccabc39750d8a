"""Checkpoint sources against a real tiny checkpoint: on disk, over HTTP, and through huggingface_hub."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from http_server import serve_directory, serve_hub, unused_port

from shardstream.errors import CorruptShard, SourceNotFound, SourceUnreachable, UnsupportedModel, UntrustedPath
from shardstream.sources import HttpSource, LocalSource, open_source
from shardstream.sources.base import INDEX_FILE, SINGLE_FILE

TOKENIZER_FILES = {"tokenizer.json": '{"version": "1.0"}', "tokenizer_config.json": '{"model_max_length": 64}'}


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A tiny Llama saved by transformers twice: in five shards with an index, and as one file."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    root = tmp_path_factory.mktemp("ckpt")
    sharded, single = root / "sharded", root / "single"
    model.save_pretrained(sharded, max_shard_size="8KB")
    model.save_pretrained(single)
    for folder in (sharded, single):
        for name, text in TOKENIZER_FILES.items():
            (folder / name).write_text(text)
    return SimpleNamespace(
        sharded=sharded,
        single=single,
        names=set(model.state_dict()),
        shards=sorted(p.name for p in sharded.glob("*.safetensors")),
    )


@pytest.fixture
def sharded_copy(ckpt: SimpleNamespace, tmp_path: Path) -> Path:
    """A private copy for tests that delete or damage files."""
    return Path(shutil.copytree(ckpt.sharded, tmp_path / "model"))


# Local folders.


def test_local_sharded_folder(ckpt: SimpleNamespace) -> None:
    source = open_source(ckpt.sharded, Path("unused"))
    assert isinstance(source, LocalSource)
    assert set(source.weight_map()) == ckpt.names
    assert len(ckpt.shards) == 5
    assert source.shard_names() == ckpt.shards
    for name in ckpt.shards:
        assert source.shard_size(name) == (ckpt.sharded / name).stat().st_size
        assert source.fetch(name) == ckpt.sharded / name
    assert source.config()["model_type"] == "llama"


def test_local_single_file(ckpt: SimpleNamespace) -> None:
    source = open_source(str(ckpt.single), Path("unused"))
    assert source.weight_map() == dict.fromkeys(ckpt.names, SINGLE_FILE)
    assert source.shard_names() == [SINGLE_FILE]


def test_local_release_deletes_only_when_asked(sharded_copy: Path) -> None:
    source = open_source(sharded_copy, Path("unused"))
    first, second = source.shard_names()[:2]
    source.release(first, delete=False)
    assert (sharded_copy / first).is_file()
    source.release(second, delete=True)
    assert not (sharded_copy / second).exists()
    with pytest.raises(SourceNotFound, match=f"{second} is missing though the index lists it"):
        source.fetch(second)


def test_delete_remaining_removes_the_emptied_folder(sharded_copy: Path) -> None:
    source = open_source(sharded_copy, Path("unused"))
    for name in source.shard_names():
        source.release(name, delete=True)
    source.delete_remaining()
    assert not sharded_copy.exists()


def test_delete_remaining_keeps_files_it_does_not_know(sharded_copy: Path) -> None:
    (sharded_copy / "notes.txt").write_text("mine")
    source = open_source(sharded_copy, Path("unused"))
    for name in source.shard_names():
        source.release(name, delete=True)
    source.delete_remaining()
    assert sorted(p.name for p in sharded_copy.iterdir()) == ["notes.txt"]


def test_copy_metadata(ckpt: SimpleNamespace, tmp_path: Path) -> None:
    copied = open_source(ckpt.sharded, Path("unused")).copy_metadata(tmp_path / "out")
    assert copied == ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    for name in copied:
        assert (tmp_path / "out" / name).read_bytes() == (ckpt.sharded / name).read_bytes()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(copied)  # no temp files left


@pytest.mark.parametrize("bad", ["../x.safetensors", "/etc/passwd", "a/../../x.safetensors", "config.json"])
def test_untrusted_index_entries(sharded_copy: Path, bad: str) -> None:
    index = json.loads((sharded_copy / INDEX_FILE).read_text())
    index["weight_map"]["lm_head.weight"] = bad
    (sharded_copy / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(UntrustedPath, match=f"names shard '{bad}'.*refusing it"):
        open_source(sharded_copy, Path("unused"))


def test_pytorch_bin_only_is_unsupported(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(UnsupportedModel, match="only PyTorch .bin weights; convert it to safetensors first"):
        open_source(tmp_path, Path("unused"))


@pytest.mark.parametrize("spec", ["./no-such-model", "~/no-such-model-xyz", "/no/such/model"])
def test_missing_local_path(spec: str) -> None:
    with pytest.raises(SourceNotFound, match=f"{spec} does not exist; give a checkpoint folder"):
        open_source(spec, Path("unused"))


def test_local_corrupt_shard(sharded_copy: Path) -> None:
    source = open_source(sharded_copy, Path("unused"))
    name = source.shard_names()[1]
    with open(sharded_copy / name, "r+b") as handle:
        handle.truncate(100)
    with pytest.raises(CorruptShard, match=f"shard {name} of local folder .* delete it and download"):
        source.fetch(name)


def test_open_source_picks_the_kind(tmp_path: Path) -> None:
    from shardstream.sources.hub import HubSource

    assert isinstance(open_source("https://host/models/tiny", tmp_path), HttpSource)
    for spec in ("org/name", "hf://org/name"):
        source = open_source(spec, tmp_path, revision="v1")
        assert isinstance(source, HubSource)
        assert source.description == "hub org/name@v1"


# HTTP.


def http_source(base_url: str, staging: Path) -> HttpSource:
    return HttpSource(base_url, staging, progress=False, retries=1, backoff=0)


def test_http_fetches_every_shard(ckpt: SimpleNamespace, tmp_path: Path) -> None:
    with serve_directory(ckpt.sharded) as (url, log):
        source = http_source(url, tmp_path)
        assert source.weight_map() == LocalSource(ckpt.sharded).weight_map()
        for name in source.shard_names():
            original = (ckpt.sharded / name).read_bytes()
            assert source.shard_size(name) == source.shard_size(name) == len(original)
            path = source.fetch(name)
            assert path == tmp_path / name and path.read_bytes() == original
            assert list(tmp_path.iterdir()) == [path]  # one shard on disk, no .part left
            source.release(name, delete=False)
            assert not path.exists()
        assert source.copy_metadata(tmp_path / "out") == LocalSource(ckpt.sharded).copy_metadata(tmp_path / "ref")
    assert len([r for r in log if r.method == "HEAD"]) == len(ckpt.shards)  # sizes asked once each


def test_http_single_file_weight_map_comes_from_its_header(ckpt: SimpleNamespace, tmp_path: Path) -> None:
    with serve_directory(ckpt.single) as (url, _log):
        source = http_source(url, tmp_path)
        assert source.weight_map() == dict.fromkeys(ckpt.names, SINGLE_FILE)
        assert not list(tmp_path.iterdir())


def test_http_resumes_a_partial_download(ckpt: SimpleNamespace, tmp_path: Path) -> None:
    name = ckpt.shards[0]
    original = (ckpt.sharded / name).read_bytes()
    (tmp_path / f"{name}.part").write_bytes(original[:3000])
    with serve_directory(ckpt.sharded) as (url, log):
        assert http_source(url, tmp_path).fetch(name).read_bytes() == original
    downloads = [r for r in log if r.method == "GET" and r.path.endswith(name)]
    assert [(r.range, r.status, r.body_bytes) for r in downloads] == [
        ("bytes=3000-", 206, len(original) - 3000)
    ]


def test_http_reuses_a_complete_staged_shard(ckpt: SimpleNamespace, tmp_path: Path) -> None:
    good, bad = ckpt.shards[:2]
    shutil.copy(ckpt.sharded / good, tmp_path / good)
    (tmp_path / bad).write_bytes(b"left by a crash")
    with serve_directory(ckpt.sharded) as (url, log):
        source = http_source(url, tmp_path)
        assert source.fetch(good).read_bytes() == (ckpt.sharded / good).read_bytes()
        assert source.fetch(bad).read_bytes() == (ckpt.sharded / bad).read_bytes()
    assert [r.path for r in log if r.method == "GET" and r.path.endswith(".safetensors")] == [f"/{bad}"]


def test_http_starts_over_when_the_server_ignores_range(ckpt: SimpleNamespace, tmp_path: Path) -> None:
    name = ckpt.shards[0]
    (tmp_path / f"{name}.part").write_bytes(b"stale bytes")
    with serve_directory(ckpt.sharded, ranges=False) as (url, log):
        path = http_source(url, tmp_path).fetch(name)
    assert path.read_bytes() == (ckpt.sharded / name).read_bytes()
    assert [r.status for r in log if r.path.endswith(name)] == [200]


def test_http_discards_a_part_longer_than_the_file(ckpt: SimpleNamespace, tmp_path: Path) -> None:
    name = ckpt.shards[0]
    original = (ckpt.sharded / name).read_bytes()
    (tmp_path / f"{name}.part").write_bytes(original + b"extra")
    with serve_directory(ckpt.sharded) as (url, log):
        assert http_source(url, tmp_path).fetch(name).read_bytes() == original
    assert [r.status for r in log if r.path.endswith(name)] == [416, 200]


def test_http_truncated_shard_is_corrupt(sharded_copy: Path, tmp_path: Path) -> None:
    name = sorted(p.name for p in sharded_copy.glob("*.safetensors"))[2]
    with open(sharded_copy / name, "r+b") as handle:
        handle.truncate(1000)
    staging = tmp_path / "staging"
    with serve_directory(sharded_copy) as (url, _log):
        source = http_source(url, staging)
        with pytest.raises(CorruptShard, match=f"shard {name} of {url} is corrupt .* run again to download it afresh"):
            source.fetch(name)
    assert not list(staging.iterdir())  # neither the shard nor its .part is kept


def test_http_missing_file_is_not_found(sharded_copy: Path, tmp_path: Path) -> None:
    name = sorted(p.name for p in sharded_copy.glob("*.safetensors"))[0]
    (sharded_copy / name).unlink()
    with serve_directory(sharded_copy) as (url, _log):
        source = http_source(url, tmp_path)
        with pytest.raises(SourceNotFound, match=f"{url}{name} does not exist \\(HTTP 404\\)"):
            source.fetch(name)
        with pytest.raises(SourceNotFound, match=f"{url}nothing/ has no config.json"):
            http_source(url + "nothing/", tmp_path).config()


def test_http_unreachable(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{unused_port()}/models/tiny/"
    with pytest.raises(SourceUnreachable, match=f"could not get {url}config.json after 2 attempts"):
        http_source(url, tmp_path).config()


# Hub, through the real huggingface_hub client pointed at a local server with HF_ENDPOINT.

HUB_SCRIPT = """
import hashlib, json, sys
from pathlib import Path
from shardstream.errors import SourceNotFound
from shardstream.sources import open_source

staging, dest = Path(sys.argv[1]), Path(sys.argv[2])
source = open_source("tiny-org/tiny", staging, progress=False)
out = {"kind": type(source).__name__, "weight_map": source.weight_map(), "shards": source.shard_names()}
out["sizes"] = {name: source.shard_size(name) for name in out["shards"]}
out["fetched"], out["left_after_release"] = {}, []
for name in out["shards"]:
    path = source.fetch(name)
    out["fetched"][name] = hashlib.sha256(path.read_bytes()).hexdigest()
    source.release(name, delete=False)
    out["left_after_release"] += [p.name for p in staging.glob("*.safetensors*")]
out["copied"] = source.copy_metadata(dest)
out["single"] = open_source("hf://tiny-org/single", staging, progress=False).weight_map()
for spec in ("tiny-org/absent", "tiny-org/tiny"):
    try:
        open_source(spec, staging, progress=False).fetch("model-00009-of-00009.safetensors")
    except SourceNotFound as exc:
        out.setdefault("errors", []).append(str(exc))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def hub_run(ckpt: SimpleNamespace, tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("hub")
    with serve_hub({"tiny-org/tiny": ckpt.sharded, "tiny-org/single": ckpt.single}) as (url, _log):
        env = {**os.environ, "HF_ENDPOINT": url.rstrip("/"), "HF_HOME": str(tmp / "hf_home")}
        env.pop("HF_HUB_OFFLINE", None)
        done = subprocess.run(
            [sys.executable, "-c", HUB_SCRIPT, str(tmp / "staging"), str(tmp / "out")],
            env=env, capture_output=True, text=True, timeout=120,
        )
    assert done.returncode == 0, done.stderr
    return {**json.loads(done.stdout), "out": tmp / "out"}


def test_hub_weight_map_and_sizes(ckpt: SimpleNamespace, hub_run: dict) -> None:
    assert hub_run["kind"] == "HubSource"
    assert hub_run["weight_map"] == LocalSource(ckpt.sharded).weight_map()
    assert hub_run["shards"] == ckpt.shards
    assert hub_run["sizes"] == {name: (ckpt.sharded / name).stat().st_size for name in ckpt.shards}
    assert hub_run["single"] == dict.fromkeys(ckpt.names, SINGLE_FILE)


def test_hub_fetch_and_release(ckpt: SimpleNamespace, hub_run: dict) -> None:
    import hashlib

    expected = {name: hashlib.sha256((ckpt.sharded / name).read_bytes()).hexdigest() for name in ckpt.shards}
    assert hub_run["fetched"] == expected
    assert hub_run["left_after_release"] == []


def test_hub_copy_metadata(ckpt: SimpleNamespace, hub_run: dict) -> None:
    assert hub_run["copied"] == ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    for name in hub_run["copied"]:
        assert (hub_run["out"] / name).read_bytes() == (ckpt.sharded / name).read_bytes()


def test_hub_not_found_messages(hub_run: dict) -> None:
    assert hub_run["errors"] == [
        "tiny-org/absent is not on the Hub or is private; check the id, or pass a token that can read it.",
        "'model-00009-of-00009.safetensors' is not a shard of hub tiny-org/tiny; "
        "use one of the names from shard_names().",
    ]
