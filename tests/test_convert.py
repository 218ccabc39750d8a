"""The converter end to end: every family, both modes, compression, deletion rules, HTTP, disk."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from shardstream import quant
from shardstream.convert import convert
from shardstream.errors import CorruptShard, DiskSpaceError
from shardstream.store import open_store

from http_server import serve_directory
from tiny_models import save_checkpoint, tiny_config

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gpt2", "mixtral", "qwen2_moe", "qwen3_moe"]


def checkpoint_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def store_tensors(path: Path) -> dict[str, torch.Tensor]:
    store = open_store(path)
    tensors = {}
    for part in store.parts:
        tensors.update(store.load(part))
    return tensors


def layer_spans_shards(folder: Path) -> bool:
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    shards_of_layer: dict[str, set[str]] = {}
    for name, shard in index.items():
        if ".layers." in name or ".h." in name:
            layer = name.split(".layers.")[-1].split(".h.")[-1].split(".")[0]
            shards_of_layer.setdefault(layer, set()).add(shard)
    return any(len(s) > 1 for s in shards_of_layer.values())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("sequential", [False, True], ids=["plain", "sequential"])
def test_every_tensor_equals_the_original(tmp_path, family, sequential):
    src = tmp_path / "src"
    save_checkpoint(family, src)
    assert layer_spans_shards(src), "the fixture must make layers span shards"
    original = checkpoint_tensors(src)
    shards = sorted(p.name for p in src.glob("*.safetensors"))

    convert(src, tmp_path / "store", sequential_shard_processing=sequential, progress=False)

    stored = store_tensors(tmp_path / "store")
    assert set(original) <= set(stored)
    for name, tensor in original.items():
        assert torch.equal(stored[name], tensor), name
    left = sorted(p.name for p in src.glob("*.safetensors"))
    assert left == ([] if sequential else shards)
    assert (src / "config.json").exists() and (tmp_path / "store" / "config.json").exists()


def test_tied_embedding_stored_once(tmp_path):
    save_checkpoint("qwen2", tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "store", progress=False)
    store = open_store(tmp_path / "store")
    assert "lm_head.weight" not in store.manifest.tensors
    assert store.manifest.aliases["lm_head.weight"] == {"target": "model.embed_tokens.weight", "part": "end"}
    end = store.load("end")
    assert torch.equal(end["lm_head.weight"], store.load("start")["model.embed_tokens.weight"])


@pytest.mark.parametrize("method", ["4bit", "8bit", "int4"])
def test_compressed_store_within_bounds(tmp_path, method):
    save_checkpoint("llama", tmp_path / "src")
    original = checkpoint_tensors(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "store", compression=method, sequential_shard_processing=True, progress=False)
    store = open_store(tmp_path / "store")
    stored = store_tensors(tmp_path / "store")
    quantized = 0
    for name, tensor in original.items():
        assert stored[name].dtype == tensor.dtype and stored[name].shape == tensor.shape
        if store.manifest.tensors[name].quant:
            quantized += 1
            bound = quant.max_abs_error_bound(tensor, method)
            assert (stored[name] - tensor).abs().max().item() <= bound, name
        else:
            assert torch.equal(stored[name], tensor), name
    assert quantized >= 4 * 7  # every projection of every block


@pytest.mark.parametrize("sequential,delete_original,left", [
    (False, False, "all"), (False, True, "nothing"),
    (True, False, "metadata"), (True, True, "nothing"),
])
def test_delete_original_rules(tmp_path, sequential, delete_original, left):
    src = tmp_path / "src"
    save_checkpoint("llama", src)
    before = sorted(p.name for p in src.iterdir())
    convert(src, tmp_path / "store", sequential_shard_processing=sequential,
            delete_original=delete_original, progress=False)
    if left == "all":
        assert sorted(p.name for p in src.iterdir()) == before
    elif left == "metadata":
        assert sorted(p.name for p in src.iterdir()) == [n for n in before if not n.endswith(".safetensors")]
    else:
        assert not src.exists() or not any(src.iterdir())
    open_store(tmp_path / "store")


def test_rerun_skips_complete_parts(tmp_path):
    save_checkpoint("llama", tmp_path / "src")
    first = convert(tmp_path / "src", tmp_path / "store", progress=False)
    manifest = (tmp_path / "store" / "manifest.json").read_bytes()
    second = convert(tmp_path / "src", tmp_path / "store", progress=False)
    assert first.parts_written and not second.parts_written
    assert sorted(second.parts_skipped) == sorted(first.parts_written)
    assert (tmp_path / "store" / "manifest.json").read_bytes() == manifest


def test_truncated_shard_aborts_before_anything_is_deleted(tmp_path):
    """Every local shard is checked up front, so a cut last shard costs nothing."""
    src = tmp_path / "src"
    save_checkpoint("llama", src)
    shards = sorted(src.glob("*.safetensors"))
    victim = shards[-1]
    with open(victim, "r+b") as handle:
        handle.truncate(victim.stat().st_size // 2)
    with pytest.raises(CorruptShard, match=victim.name + r".*download"):
        convert(src, tmp_path / "store", sequential_shard_processing=True, progress=False)
    assert all(shard.exists() for shard in shards), "no shard may be deleted before all are checked"
    assert not (tmp_path / "store").exists(), "a failed check creates no output folder"


def test_shard_missing_a_tensor_is_reported(tmp_path):
    src = tmp_path / "src"
    save_checkpoint("llama", src)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.extra.weight"] = "model-00001-of-00005.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CorruptShard, match="model-00001-of-00005.safetensors .* lacks 1 tensors .* model.layers.0.extra.weight"):
        convert(src, tmp_path / "store", progress=False)


def save_wide_llama(folder: Path) -> None:
    """A Llama whose blocks (~400 KB) dwarf the manifest, so disk ratios are meaningful."""
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama")
    config.hidden_size, config.intermediate_size, config.vocab_size = 128, 256, 512
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder, max_shard_size="300KB")


def du(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def test_http_sequential_peak_disk(tmp_path):
    """One shard at a time over real HTTP: disk never holds more than a shard plus the output."""
    src = tmp_path / "src"
    save_wide_llama(src)
    shard_sizes = [p.stat().st_blocks * 512 for p in src.glob("*.safetensors")]
    assert len(shard_sizes) >= 3 and layer_spans_shards(src)
    out = tmp_path / "store"
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(du(out))
            time.sleep(0.001)

    with serve_directory(src) as (url, log):
        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            convert(url, out, sequential_shard_processing=True, progress=False)
        finally:
            stop.set()
            sampler.join()
    assert not (out / ".staging").exists()
    output = du(out)
    assert max(samples) <= (max(shard_sizes) + output) * 1.01
    assert checkpoint_tensors(src).keys() <= store_tensors(out).keys()
    sizes = {f"/{p.name}": p.stat().st_size for p in src.glob("*.safetensors")}
    downloads = [r.path for r in log if r.method == "GET" and r.body_bytes == sizes.get(r.path)]
    assert sorted(downloads) == sorted(sizes), "each shard is downloaded whole once (and headers read apart)"


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_full_disk_aborts_before_filling(tmp_path):
    """What remains to be written is counted up front: a store that cannot fit is not begun."""
    src = tmp_path / "src"
    save_wide_llama(src)
    small = tmp_path / "small"
    small.mkdir()
    if os.system(f"mount -t tmpfs -o size=1500k tmpfs {small}") != 0:
        pytest.skip("tmpfs mount not permitted here")
    try:
        with serve_directory(src) as (url, _):
            with pytest.raises(DiskSpaceError, match=r"free but converting the 10 shards left needs about \d\.\d MB"):
                convert(url, small / "store", sequential_shard_processing=True, progress=False)
        assert not (small / "store").exists(), "the refused conversion leaves no output folder behind"
    finally:
        os.system(f"umount {small}")
    with serve_directory(src) as (url, _):   # on a bigger disk, the same command does the job
        report = convert(url, tmp_path / "moved", sequential_shard_processing=True, progress=False)
    assert report.parts_written and not report.parts_skipped
    assert checkpoint_tensors(src).keys() <= store_tensors(tmp_path / "moved").keys()


def test_low_disk_threshold_warns(tmp_path):
    save_checkpoint("llama", tmp_path / "src")
    with pytest.warns(UserWarning, match="low disk space"):
        convert(tmp_path / "src", tmp_path / "store", progress=False, min_free_space=10**15)
    open_store(tmp_path / "store")


def test_layer_memory_warning_only_where_a_layer_is_held_in_memory(tmp_path):
    """Copying streams a layer through a small buffer; quantizing holds it."""
    save_checkpoint("llama", tmp_path / "src")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert(tmp_path / "src", tmp_path / "plain", progress=False, layer_memory_warning=1000)
    with pytest.warns(UserWarning, match="GB, and quantizing it holds it in memory"):
        convert(tmp_path / "src", tmp_path / "store", progress=False, layer_memory_warning=1000, compression="4bit")


def test_profiling_mode_reports_each_part(tmp_path, capsys):
    save_checkpoint("llama", tmp_path / "src")
    report = convert(tmp_path / "src", tmp_path / "store", profiling_mode=True, compression="4bit", progress=False)
    printed = capsys.readouterr().out
    for part in ("start", "mid/0", "mid/3", "end", "total"):
        assert part in printed
    assert report.profile["mid/0"].quantize_seconds > 0
    profile = json.loads((tmp_path / "store" / "convert_profile.json").read_text())
    assert set(profile["parts"]) == set(open_store(tmp_path / "store").parts)


def test_existing_store_of_another_model_is_refused(tmp_path):
    save_checkpoint("llama", tmp_path / "a")
    save_checkpoint("gpt2", tmp_path / "b")
    convert(tmp_path / "a", tmp_path / "store", progress=False)
    with pytest.raises(ValueError, match="another model or compression"):
        convert(tmp_path / "b", tmp_path / "store", progress=False)
    shutil.rmtree(tmp_path / "store")


def test_maps_from_a_real_index(tmp_path):
    from shardstream.convert import make_plan

    save_checkpoint("qwen2", tmp_path / "src")
    index = json.loads((tmp_path / "src" / "model.safetensors.index.json").read_text())["weight_map"]
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    plan = make_plan(config, index)
    assert plan.expected_parts == ["start", "mid/0", "mid/1", "mid/2", "mid/3", "end"]
    assert plan.tied == ("lm_head.weight", "model.embed_tokens.weight", "end")
    assert plan.part_tensors["end"] == {"model.norm.weight"}
    assert plan.part_tensors["mid/2"] == {n for n in index if n.startswith("model.layers.2.")}
    for part, shards in plan.part_shards.items():
        assert shards == {index[n] for n in plan.part_tensors[part]}
    assert any(len(s) > 1 for s in plan.part_shards.values()), "some layer spans two shards"
    assert {(n, shard) for shard, names in plan.shard_tensors.items() for n in names} == \
        {(n, shard) for n, shard in index.items() if n != "lm_head.weight"}


def test_nothing_is_deleted_or_committed_before_it_is_durable(tmp_path, monkeypatch):
    """Part files and progress records skip their own fsync, so the batched pass
    must cover them: when a source shard is deleted, every tensor taken from it is in a manifest
    that was fsynced, in a file that was fsynced, in a folder that was fsynced; likewise at commit."""
    save_checkpoint("llama", tmp_path / "src")
    weight_map = json.loads((tmp_path / "src" / "model.safetensors.index.json").read_text())["weight_map"]
    store = tmp_path / "store"
    synced: set[Path] = set()
    durable_manifest: dict = {}
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        real_fsync(fd)
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        synced.add(path)
        if path.name.startswith((".tmp-manifest.json", "manifest.json")):
            durable_manifest.clear()
            durable_manifest.update(json.loads(path.read_bytes()))

    def check_durable(names: list[str]) -> None:
        for name in names:
            record = durable_manifest["tensors"].get(name)
            assert record, f"{name} is not in a manifest that was fsynced"
            assert store / record["file"] in synced, f"{record['file']} was never fsynced"
            assert (store / record["file"]).parent in synced, f"the folder of {record['file']} was never fsynced"

    from shardstream.sources.local import LocalSource

    real_release = LocalSource.release
    deleted = []

    def checked_release(self, name: str, delete: bool) -> None:
        if delete:
            check_durable([t for t, shard in weight_map.items() if shard == name])
            deleted.append(name)
        real_release(self, name, delete)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(LocalSource, "release", checked_release)
    convert(tmp_path / "src", store, sequential_shard_processing=True, progress=False)
    assert len(deleted) == len(set(weight_map.values())) > 1
    assert durable_manifest["complete"]
    check_durable(list(weight_map))


def test_shard_cut_after_its_check_fails_with_one_sentence(tmp_path):
    """Tensors are streamed from the shard while writing, after the up-front header check: a shard
    cut in between must still fail naming the shard and the tensor, in one sentence."""
    import xxhash
    from safetensors.torch import load, save_file

    from shardstream.convert import _spans
    from shardstream.safetensors_header import read_header
    from shardstream.store.partfile import encode_part
    from shardstream.store.span import SourceFile

    shard = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(64, 64), "b": torch.arange(8.0)}, shard)
    spans = {s.name: s for s in _spans(SourceFile(shard), read_header(shard), ["a", "b"])}
    streamed = load(b"".join(bytes(piece) for piece in encode_part(spans, None).stream(xxhash.xxh3_128())))
    assert torch.equal(streamed["a"], torch.ones(64, 64)) and torch.equal(streamed["b"], torch.arange(8.0))
    with open(shard, "r+b") as handle:
        handle.truncate(shard.stat().st_size - 100)
    with pytest.raises(CorruptShard, match=r"model\.safetensors ended early inside 'a'; download it again\."):
        list(encode_part(spans, None).stream(xxhash.xxh3_128()))
