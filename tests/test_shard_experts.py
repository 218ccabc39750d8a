"""Experts on tiers: placement, lazy verified loads, and relocation that survives SIGKILL at every step."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys

import pytest
import torch

import shardstream
from http_server import serve_directory
from shardstream.errors import InvalidOption, StoreCorrupt
from shardstream.shard import (RELOCATION_STEPS, load_expert, load_index, parse_expert_key, parse_tiers,
                               place_experts, relocate, verify_experts_and_slices)
from shardstream.store import verify_store
from shardstream.store.remote import open_remote_store
from test_shard_tp import tiny_store

RELOCATE_SCRIPT = """
import sys
import shardstream
from shardstream.shard import relocate
root, layer, expert, tier, stop = sys.argv[1:]
def on_step(step):
    print(step, flush=True)
    if step == stop:
        sys.stdin.readline()   # hold here until the test kills us
relocate(shardstream.open_store(root), int(layer), int(expert), tier, on_step)
"""


@pytest.fixture
def placed(tmp_path, tmp_path_factory):
    """A private copy of the tiny Mixtral store with experts over three tiers, two outside the store."""
    root = tmp_path / "store"
    shutil.copytree(tiny_store("mixtral", tmp_path_factory), root)
    tiers = {"hot": str(tmp_path / "nvme"), "warm": "tiers/warm", "cold": str(tmp_path / "hdd")}
    store = shardstream.open_store(root)
    place_experts(store, tiers, placement={(1, 2): "cold", (2, 0): "warm"})
    return store, tiers


def expected(store, layer: int, expert: int) -> dict[str, torch.Tensor]:
    prefix = f"model.layers.{layer}.block_sparse_moe.experts.{expert}."
    return {n: store.load_tensor(n) for n in store.manifest.tensors if n.startswith(prefix)}


def assert_loads_exactly(store, layer: int, expert: int) -> None:
    got = load_expert(store, layer, expert).tensors
    want = expected(store, layer, expert)
    assert set(got) == set(want) and len(want) == 3
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_placement_by_tier(placed, tmp_path):
    store, tiers = placed
    index = load_index(store)
    assert len(index.experts) == 3 * 4
    assert (index.experts["1:2"].tier, index.experts["1:2"].hint) == ("cold", 2)
    assert (index.experts["2:0"].tier, index.experts["2:0"].hint) == ("warm", 1)
    assert (index.experts["0:3"].tier, index.experts["0:3"].hint) == ("hot", 0)
    assert (tmp_path / "hdd/experts/tier_cold/group_1/expert_2.safetensors").is_file()
    assert (store.root / "tiers/warm/experts/tier_warm/group_2/expert_0.safetensors").is_file()
    assert (tmp_path / "nvme/experts/tier_hot/group_0/expert_3.safetensors").is_file()
    for layer in range(3):
        for expert in range(4):
            assert_loads_exactly(store, layer, expert)
    assert verify_experts_and_slices(store) == []


def test_relocate_moves_the_file(placed, tmp_path):
    store, _ = placed
    record = relocate(store, 0, 3, "cold")
    assert (record.tier, record.hint) == ("cold", 2)
    assert not (tmp_path / "nvme/experts/tier_hot/group_0/expert_3.safetensors").exists()
    assert (tmp_path / "hdd/experts/tier_cold/group_0/expert_3.safetensors").is_file()
    assert_loads_exactly(store, 0, 3)
    with pytest.raises(InvalidOption, match="has no tier 'tape'"):
        relocate(store, 0, 3, "tape")


@pytest.mark.parametrize("stop", RELOCATION_STEPS)
def test_sigkill_at_each_relocation_step_leaves_a_consistent_store(placed, tmp_path, stop):
    store, _ = placed
    before = load_index(store).experts["1:2"].tier
    proc = subprocess.Popen([sys.executable, "-c", RELOCATE_SCRIPT, str(store.root), "1", "2", "hot", stop],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    steps = []
    while not steps or steps[-1] != stop:
        line = proc.stdout.readline()
        assert line, f"relocation exited before step {stop!r} (steps seen: {steps})"
        steps.append(line.strip())
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert steps == list(RELOCATION_STEPS[: RELOCATION_STEPS.index(stop) + 1])

    store = shardstream.open_store(store.root)
    tier = load_index(store).experts["1:2"].tier
    assert tier == (before if stop in ("copy", "verify") else "hot")
    assert verify_store(store.root)[1] == [] and verify_experts_and_slices(store) == []
    assert_loads_exactly(store, 1, 2)

    relocate(store, 1, 2, "hot")   # the re-run completes the move
    assert load_index(store).experts["1:2"].tier == "hot"
    assert not (tmp_path / "hdd/experts/tier_cold/group_1/expert_2.safetensors").exists()
    assert not list((tmp_path / "nvme").rglob(".tmp-*"))
    assert_loads_exactly(store, 1, 2)


def test_corrupt_expert_is_named_on_first_read_and_never_used(placed, tmp_path):
    store, _ = placed
    expert = load_expert(store, 1, 2)   # lazy: nothing read yet
    path = tmp_path / "hdd/experts/tier_cold/group_1/expert_2.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(data)
    with pytest.raises(StoreCorrupt, match="experts/tier_cold/group_1/expert_2.safetensors fails its checksum"):
        expert.tensors
    with pytest.raises(StoreCorrupt, match="expert_2.safetensors fails its checksum"):
        relocate(store, 1, 2, "hot")
    assert load_index(store).experts["1:2"].tier == "cold"
    assert not (tmp_path / "nvme/experts/tier_hot/group_1/expert_2.safetensors").exists()
    assert [p.reason for p in verify_experts_and_slices(store)] == ["checksum mismatch"]


def test_experts_over_http(placed):
    store, _ = placed
    relocate(store, 2, 1, "warm")
    with serve_directory(store.root) as (url, log):
        remote = open_remote_store(url)
        got = load_expert(remote, 2, 1).tensors
        with pytest.raises(InvalidOption, match="outside the store; relocate it"):
            load_expert(remote, 0, 0).tensors
    assert all(torch.equal(got[n], t) for n, t in expected(store, 2, 1).items())
    assert "/tiers/warm/experts/tier_warm/group_2/expert_1.safetensors" in [r.path for r in log]


@pytest.mark.parametrize("spec", ["hot", "hot=/a,hot=/b", "Hot=/a", "hot="])
def test_bad_tier_spec(spec):
    with pytest.raises(InvalidOption, match="write name=folder pairs"):
        parse_tiers(spec)
    assert parse_tiers("hot=/a,cold=rel") == {"hot": "/a", "cold": "rel"}


@pytest.mark.parametrize("text", ["12", "12:x", "-1:2", ""])
def test_bad_expert_key(text):
    with pytest.raises(InvalidOption, match="write <layer>:<expert>"):
        parse_expert_key(text)
    assert parse_expert_key(" 12:7") == (12, 7)
