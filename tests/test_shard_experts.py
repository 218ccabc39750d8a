"""Experts on tiers: placement, lazy verified loads, and relocation that survives SIGKILL at every step."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

import shardstream
import shardstream.store.sharding as sharding
from shardstream.atomic import write_bytes_atomic, write_json_atomic
from shardstream.convert import convert
from http_server import serve_directory
from shardstream.errors import InvalidOption, StoreCorrupt
from shardstream.pipeline.package import package_stage
from shardstream.shard import (RELOCATION_STEPS, define_tiers, load_expert, load_index, parse_expert_key,
                               parse_tiers, place_experts, relocate, relocate_part)
from shardstream.store import verify_sharding, verify_store
from shardstream.store.direct_io import ALIGN, aligned
from shardstream.store.manifest import sealed
from shardstream.store.sharding import INDEX_NAME, INDEX_VERSION, tier_root
from shardstream.stream.direct import read_buffer
from shardstream.store.remote import open_remote_store
from test_shard_tp import tiny_store

PLACE_SCRIPT = """
import sys
import shardstream
import shardstream.shard.experts as experts
import shardstream.store.manifest as manifest
import shardstream.store.sharding as sharding
root, cold, stop = sys.argv[1], sys.argv[2], int(sys.argv[3])
writes = 0
def pausing(real):
    def durable_write(*args, **kwargs):
        global writes
        result = real(*args, **kwargs)
        writes += 1
        if writes == stop:
            print("paused", flush=True)
            sys.stdin.readline()   # hold here until the test kills us
        return result
    return durable_write
experts.write_encoded = pausing(experts.write_encoded)
experts.write_container = pausing(experts.write_container)
sharding.write_json_atomic = pausing(sharding.write_json_atomic)
manifest.write_json_atomic = pausing(manifest.write_json_atomic)
experts.place_experts(shardstream.open_store(root), {"hot": ".", "cold": cold}, placement={(1, 2): "cold"})
print("done", flush=True)
"""

RELOCATE_SCRIPT = """
import sys
import shardstream
from shardstream.shard import relocate, relocate_part
root, what, tier, stop = sys.argv[1:]
def on_step(step):
    print(step, flush=True)
    if step == stop:
        sys.stdin.readline()   # hold here until the test kills us
store = shardstream.open_store(root)
if ":" in what:
    layer, expert = map(int, what.split(":"))
    relocate(store, layer, expert, tier, on_step)
else:
    relocate_part(store, what, tier, on_step)
"""


@pytest.fixture
def original(tmp_path_factory):
    """The tiny Mixtral store as converted, experts inside their blocks' parts (never modified)."""
    return shardstream.open_store(tiny_store("mixtral", tmp_path_factory))


@pytest.fixture
def placed(tmp_path, tmp_path_factory):
    """A private copy of the tiny Mixtral store with experts over three tiers, two outside the store."""
    root = tmp_path / "store"
    shutil.copytree(tiny_store("mixtral", tmp_path_factory), root)
    tiers = {"hot": str(tmp_path / "nvme"), "warm": "tiers/warm", "cold": str(tmp_path / "hdd")}
    store = shardstream.open_store(root)
    place_experts(store, tiers, placement={(1, 2): "cold", (2, 0): "warm"})
    return store, tiers


def as_files_per_expert(store) -> None:
    """Rewrite a placed store as shardstream wrote it before containers: one file per expert, and a version 2
    index whose expert records have no offset, length or checksum of their own (`files` holds it)."""
    index = load_index(store)
    body = asdict(index)
    body["format_version"], body["files"] = 2, {n: f for n, f in body["files"].items() if not n.endswith(".experts")}
    for key, record in index.experts.items():
        file = f"experts/tier_{record.tier}/group_{record.group}/expert_{record.expert}.safetensors"
        data = load_expert(store, record.group, record.expert).contents(verify=True)
        write_bytes_atomic(tier_root(store, index, record.tier) / file, data)
        body["files"][file] = {"size": len(data), "xxh3_128": record.xxh3_128}
        entry = body["experts"][key]
        entry["file"] = file
        for name in ("offset", "length", "xxh3_128"):
            del entry[name]
    for record in index.experts.values():
        (tier_root(store, index, record.tier) / record.file).unlink(missing_ok=True)
    write_json_atomic(store.root / INDEX_NAME, sealed(body))


def expert_files(*roots) -> list[str]:
    """Every expert container and file of one expert under `roots`."""
    return sorted(str(p) for root in roots for p in root.rglob("experts/tier_*/*") if p.is_file()) + \
        sorted(str(p) for root in roots for p in root.rglob("expert_*.safetensors"))


def expected(original, layer: int, expert: int) -> dict[str, torch.Tensor]:
    prefix = f"model.layers.{layer}.block_sparse_moe.experts.{expert}."
    return {n: original.load_tensor(n) for n in original.manifest.tensors if n.startswith(prefix)}


def assert_loads_exactly(store, original, layer: int, expert: int) -> None:
    got = load_expert(store, layer, expert).tensors
    want = expected(original, layer, expert)
    assert set(got) == set(want) and len(want) == 3
    assert all(torch.equal(got[n], want[n]) for n in want)


def containers(root, tier: str, layer: int) -> list[str]:
    """The names of block `layer`'s expert containers on `tier` (rooted at `root`)."""
    return sorted(p.name for p in (root / f"experts/tier_{tier}").glob(f"group_{layer}.*.experts"))


def test_placement_by_tier(placed, original, tmp_path):
    store, tiers = placed
    index = load_index(store)
    assert len(index.experts) == 3 * 4
    assert (index.experts["1:2"].tier, index.experts["1:2"].hint) == ("cold", 2)
    assert (index.experts["2:0"].tier, index.experts["2:0"].hint) == ("warm", 1)
    assert (index.experts["0:3"].tier, index.experts["0:3"].hint) == ("hot", 0)
    assert index.experts["1:2"].file == "experts/tier_cold/group_1.1.experts"
    assert containers(tmp_path / "hdd", "cold", 1) == ["group_1.1.experts"]
    assert containers(store.root / "tiers/warm", "warm", 2) == ["group_2.1.experts"]
    assert containers(tmp_path / "nvme", "hot", 0) == ["group_0.1.experts"]
    for layer in range(3):
        for expert in range(4):
            assert_loads_exactly(store, original, layer, expert)
    assert verify_sharding(store)[1] == []


def test_one_container_per_tier_and_block_each_expert_aligned(placed, tmp_path):
    store, _ = placed
    index = load_index(store)
    homes = {(r.tier, r.group) for r in index.experts.values()}
    assert len(homes) == 3 + 2 == len(expert_files(store.root, tmp_path / "nvme", tmp_path / "hdd"))
    for record in index.experts.values():
        assert record.offset % ALIGN == 0 and 0 < record.length <= index.files[record.file].size - record.offset
        assert load_expert(store, record.group, record.expert).nbytes == record.length
    assert sum(r.length for r in index.experts.values()) <= sum(f.size for f in index.files.values())


def test_one_expert_is_one_read_of_its_own_bytes(placed, original, monkeypatch):
    """Through the real readers: a checked load reads the expert's [offset, offset + length) once, and so
    does a read past the page cache (one O_DIRECT read of its page-rounded bytes at its offset)."""
    store, _ = placed
    reads = []
    read_path, read_at = sharding.read_path, sharding.read_at

    def plain(path, offset, length):
        got = read_path(path, offset, length)
        reads.append(("read_path", Path(path).name, offset, len(got)))
        return got

    def direct(fd, path, view, offset, stop=None, landed=None):
        reads.append(("read_at", Path(path).name, offset, len(view)))
        return read_at(fd, path, view, offset, stop, landed)

    monkeypatch.setattr(sharding, "read_path", plain)
    monkeypatch.setattr(sharding, "read_at", direct)
    expert = load_expert(store, 0, 2)
    record = expert.record
    assert record.offset > 0   # not the container's first expert
    assert_loads_exactly(store, original, 0, 2)
    assert reads == [("read_path", Path(record.file).name, record.offset, record.length)]
    reads.clear()
    expert.fill(read_buffer(aligned(record.length)), drop=True)
    assert reads == [("read_at", Path(record.file).name, record.offset, aligned(record.length))]


@pytest.mark.parametrize("layout", ["containers", "files per expert"])
def test_a_store_sharded_before_containers_reads_verifies_and_relocates(placed, original, tmp_path, layout):
    store, _ = placed
    if layout == "files per expert":
        as_files_per_expert(store)
        assert len(expert_files(store.root, tmp_path / "nvme", tmp_path / "hdd")) == 12
    store = shardstream.open_store(store.root)
    for layer in range(3):
        for expert in range(4):
            assert_loads_exactly(store, original, layer, expert)
    assert verify_sharding(store)[1] == []
    relocate(store, 0, 1, "cold")   # block 0 is packed into containers; the others keep their files
    assert containers(tmp_path / "hdd", "cold", 0) and not list((tmp_path / "nvme/experts/tier_hot").glob("group_0/*"))
    assert verify_sharding(store)[1] == []
    place_experts(store, {"hot": str(tmp_path / "nvme"), "warm": "tiers/warm", "cold": str(tmp_path / "hdd")})
    assert len(expert_files(store.root, tmp_path / "nvme", tmp_path / "hdd")) == 3 + 3
    assert not list(store.root.rglob("expert_*.safetensors")) and not list(tmp_path.rglob("expert_*.safetensors"))
    assert verify_sharding(store)[1] == [] and load_index(store).format_version == INDEX_VERSION
    for layer in range(3):
        for expert in range(4):
            assert_loads_exactly(store, original, layer, expert)


def test_placing_again_rewrites_no_container_that_holds_what_it_should(placed, tmp_path):
    store, tiers = placed
    before = {p: p.stat().st_ino for p in map(Path, expert_files(store.root, tmp_path / "nvme", tmp_path / "hdd"))}
    place_experts(store, dict(reversed(tiers.items())))   # the same tiers, slowest listed first
    after = {p: p.stat().st_ino for p in map(Path, expert_files(store.root, tmp_path / "nvme", tmp_path / "hdd"))}
    assert after == before
    assert (load_index(store).experts["1:2"].hint, load_index(store).experts["0:3"].hint) == (0, 2)
    assert verify_sharding(store)[1] == []


def test_a_tier_added_later_ranks_after_the_tiers_it_joins(placed, tmp_path):
    store, tiers = placed
    index = load_index(store, for_update=True)
    define_tiers(store, index, {"archive": str(tmp_path / "tape")})
    define_tiers(store, index, {"hot": tiers["hot"], "spare": str(tmp_path / "spare")})   # hot keeps its rank
    assert {name: tier["hint"] for name, tier in index.tiers.items()} == {
        "hot": 0, "warm": 1, "cold": 2, "archive": 3, "spare": 4}


def assert_same_parts(store, original) -> None:
    """Every part loads the same tensors as the converted store, experts included."""
    for part in original.parts:
        got, want = store.load(part, verify=True), original.load(part)
        assert set(got) == set(want) == set(store.tensor_names(part)), part
        assert all(torch.equal(got[n], want[n]) for n in want), part


def disk_bytes(*roots) -> int:
    return sum(p.stat().st_size for root in roots for p in root.rglob("*") if p.is_file())


def test_placing_stores_each_expert_once(placed, original, tmp_path):
    store, _ = placed
    assert not [n for n, r in store.manifest.tensors.items() if r.expert is not None]
    for layer in range(3):
        assert store.manifest.parts[f"mid/{layer}"].files == [f"mid/{layer}/weights-without-experts.safetensors"]
        assert [p.name for p in (store.root / f"mid/{layer}").iterdir()] == ["weights-without-experts.safetensors"]
    assert_same_parts(store, original)
    assert original.part_nbytes("mid/1") * 0.9 < store.part_nbytes("mid/1") < original.part_nbytes("mid/1") * 1.1
    expert_bytes = sum(r.length for r in original.manifest.tensors.values() if r.expert is not None)
    assert expert_bytes > disk_bytes(original.root) / 2
    placed_bytes = disk_bytes(store.root, tmp_path / "nvme", tmp_path / "hdd")
    assert placed_bytes < disk_bytes(original.root) * 1.1   # not the experts twice
    assert verify_store(store.root)[1] == [] and verify_sharding(store)[1] == []


def test_rerunning_convert_on_a_placed_store_changes_nothing(placed, original):
    store, _ = placed
    before = (store.root / "manifest.json").read_bytes()
    report = convert(original.root.parent / "src", store.root, progress=False)
    assert report.parts_written == [] and (store.root / "manifest.json").read_bytes() == before
    assert_same_parts(shardstream.open_store(store.root), original)


@pytest.mark.parametrize("compression", ["4bit", "8bit"])
def test_quantized_experts_move_without_requantizing(tmp_path, tmp_path_factory, compression):
    original = shardstream.open_store(tiny_store("mixtral", tmp_path_factory, compression))
    shutil.copytree(original.root, tmp_path / "store")
    store = shardstream.open_store(tmp_path / "store")
    place_experts(store, {"hot": ".", "cold": str(tmp_path / "hdd")}, placement={(0, 1): "cold"})
    assert all(r.tensors[n].get("quant") for r in load_index(store).experts.values() for n in r.tensors
               if n.endswith("w1.weight"))
    assert_same_parts(store, original)


# durable writes of placing 3 layers x 4 experts (1:2 cold): per layer a container a tier (layer 1: hot, then
# cold), the index (the first time also the manifest's pointer to it), the part without experts, the
# manifest; then the index once more
@pytest.mark.parametrize("stop", [1, 3, 6, 7, 8, 10, 13, 15])
def test_sigkill_while_placing_leaves_a_store_that_loads(tmp_path, tmp_path_factory, original, stop):
    shutil.copytree(original.root, tmp_path / "store")
    proc = subprocess.Popen([sys.executable, "-c", PLACE_SCRIPT, str(tmp_path / "store"), str(tmp_path / "hdd"), str(stop)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "paused"
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL

    store = shardstream.open_store(tmp_path / "store")
    assert verify_store(store.root)[1] == [] and verify_sharding(store)[1] == []
    assert_same_parts(store, original)

    place_experts(store, {"hot": ".", "cold": str(tmp_path / "hdd")}, placement={(1, 2): "cold"})   # the re-run finishes
    assert load_index(store).experts["1:2"].tier == "cold" and len(load_index(store).experts) == 12
    assert not [n for n, r in store.manifest.tensors.items() if r.expert is not None]
    assert not list(store.root.rglob(".tmp-*")) and not list((tmp_path / "hdd").rglob(".tmp-*"))
    assert sorted(p.name for p in (store.root / "mid/1").iterdir()) == ["weights-without-experts.safetensors"]
    assert_same_parts(shardstream.open_store(store.root), original)


def test_relocate_moves_the_expert_between_containers(placed, original, tmp_path):
    store, _ = placed
    record = relocate(store, 0, 3, "cold")
    assert (record.tier, record.hint, record.file) == ("cold", 2, "experts/tier_cold/group_0.1.experts")
    assert containers(tmp_path / "nvme", "hot", 0) == ["group_0.2.experts"]   # the old one, with 0:3, is gone
    assert containers(tmp_path / "hdd", "cold", 0) == ["group_0.1.experts"]
    assert {r.file for r in load_index(store).experts.values() if r.group == 0 and r.tier == "hot"} == \
        {"experts/tier_hot/group_0.2.experts"}
    for expert in range(4):
        assert_loads_exactly(store, original, 0, expert)
    record = relocate(store, 0, 3, "hot")   # back again: new names once more, the cold container emptied away
    assert containers(tmp_path / "nvme", "hot", 0) == ["group_0.3.experts"] and not containers(tmp_path / "hdd", "cold", 0)
    assert_loads_exactly(store, original, 0, 3)
    assert verify_sharding(store)[1] == []
    with pytest.raises(InvalidOption, match="has no tier 'tape'"):
        relocate(store, 0, 3, "tape")


def test_a_relocated_part_and_its_stage_package_keep_the_blocks_containers(placed, original, tmp_path):
    """Moving a block's part leaves its experts where they are placed; a pipeline stage of that block ships
    its containers whole (from both tiers) with an index naming each expert's bytes in them."""
    store, _ = placed
    relocate_part(store, "mid/1", "warm")
    assert_same_parts(store, original)
    package = package_stage(store, 1, 2, tmp_path / "stages")
    listed = json.loads((package.folder / "stage.json").read_text())["files"]
    named = {r.file for r in load_index(store).experts.values() if r.group == 1}
    assert {n for n in listed if n.startswith("experts/")} == named and len(named) == 2
    staged = shardstream.open_store(package.folder)
    for expert in range(4):
        assert_loads_exactly(staged, original, 1, expert)


def kill_relocation_at(root, what: str, tier: str, stop: str) -> list[str]:
    """Relocate an expert ("<layer>:<expert>") or a part in a real subprocess, SIGKILL it right
    after step `stop`; the steps it reported."""
    proc = subprocess.Popen([sys.executable, "-c", RELOCATE_SCRIPT, str(root), what, tier, stop],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    steps = []
    while not steps or steps[-1] != stop:
        line = proc.stdout.readline()
        assert line, f"relocation exited before step {stop!r} (steps seen: {steps})"
        steps.append(line.strip())
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    return steps


@pytest.mark.parametrize("layout", ["containers", "files per expert"])
@pytest.mark.parametrize("stop", RELOCATION_STEPS)
def test_sigkill_at_each_relocation_step_leaves_a_consistent_store(placed, original, tmp_path, stop, layout):
    store, _ = placed
    if layout == "files per expert":
        as_files_per_expert(store)
    before = load_index(store).experts["1:2"].tier
    steps = kill_relocation_at(store.root, "1:2", "hot", stop)
    assert steps == list(RELOCATION_STEPS[: RELOCATION_STEPS.index(stop) + 1])

    store = shardstream.open_store(store.root)
    tier = load_index(store).experts["1:2"].tier
    assert tier == (before if stop in ("copy", "verify") else "hot")
    assert verify_store(store.root)[1] == [] and verify_sharding(store)[1] == []
    for expert in range(4):   # the block's other experts, in the containers rewritten, too
        assert_loads_exactly(store, original, 1, expert)

    relocate(store, 1, 2, "hot")   # the re-run completes the move
    assert load_index(store).experts["1:2"].tier == "hot"
    assert not containers(tmp_path / "hdd", "cold", 1)   # 1:2 was its only expert there
    named = {r.file for r in load_index(store).experts.values() if r.group == 1}
    assert [f"experts/tier_hot/{name}" for name in containers(tmp_path / "nvme", "hot", 1)] == sorted(named)
    assert not list((tmp_path / "nvme").rglob(".tmp-*"))
    for expert in range(4):
        assert_loads_exactly(store, original, 1, expert)


def damage(path, record) -> None:
    """Flip a bit inside one expert's bytes in its container."""
    data = bytearray(path.read_bytes())
    data[record.offset + record.length - 5] ^= 0x01
    path.write_bytes(data)


def test_corrupt_expert_is_named_on_first_read_and_never_used(placed, original, tmp_path):
    store, _ = placed
    relocate(store, 1, 3, "cold")   # two experts in the cold container of block 1: 1:3 stays sound
    expert = load_expert(store, 1, 2)   # lazy: nothing read yet
    record = expert.record
    damage(tmp_path / "hdd" / record.file, record)
    with pytest.raises(StoreCorrupt, match=r"experts/tier_cold/group_1\.2\.experts \(expert 1:2\) fails its checksum"):
        expert.tensors
    assert_loads_exactly(store, original, 1, 3)   # its neighbour is checked alone, and reads
    with pytest.raises(StoreCorrupt, match=r"\(expert 1:2\) fails its checksum"):
        relocate(store, 1, 2, "hot")
    assert load_index(store).experts["1:2"].tier == "cold"
    assert containers(tmp_path / "nvme", "hot", 1) == [Path(load_index(store).experts["1:0"].file).name]
    assert [(p.file, p.reason) for p in verify_sharding(store)[1]] == \
        [(str(tmp_path / "hdd" / record.file), "checksum mismatch in expert 1:2")]


def test_experts_over_http(placed, original):
    store, _ = placed
    relocate(store, 2, 1, "warm")
    with serve_directory(store.root) as (url, log):
        remote = open_remote_store(url)
        got = load_expert(remote, 2, 1).tensors
        with pytest.raises(InvalidOption, match="outside the store; relocate it"):
            load_expert(remote, 0, 0).tensors
    assert all(torch.equal(got[n], t) for n, t in expected(original, 2, 1).items())
    record = load_index(store).experts["2:1"]
    assert [(r.path, r.status, r.body_bytes) for r in log if "experts" in r.path] == \
        [(f"/tiers/warm/{record.file}", 206, record.length)]   # one ranged read of the expert's own bytes


@pytest.mark.parametrize("spec", ["hot", "Hot=/a", "hot="])
def test_bad_tier_spec(spec):
    with pytest.raises(InvalidOption, match="write name=folder pairs"):
        parse_tiers(spec)
    with pytest.raises(InvalidOption, match="--tiers names tier 'hot' twice; give each tier one folder."):
        parse_tiers("hot=/a,hot=/b")
    assert parse_tiers("hot=/a,cold=rel") == {"hot": "/a", "cold": "rel"}


@pytest.mark.parametrize("text", ["12", "12:x", "-1:2", ""])
def test_bad_expert_key(text):
    with pytest.raises(InvalidOption, match="write <layer>:<expert>"):
        parse_expert_key(text)
    assert parse_expert_key(" 12:7") == (12, 7)
