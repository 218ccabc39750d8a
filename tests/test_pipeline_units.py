"""Pipeline parts in one process: stages against transformers, the wire format, costs, packaging."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from shardstream.convert import convert
from shardstream.errors import PlanInfeasible
from shardstream.pipeline.costs import model_cost
from shardstream.pipeline.planner import UNMEASURED_DISK_BYTES_PER_S, Device, Link, ModelCost, PlanOptions, plan
from shardstream.pipeline.package import package_stage, stage_manifest
from shardstream.pipeline.stage import StageModel
from shardstream.pipeline.transport import pack, unpack
from shardstream.shard import place_experts
from shardstream.store import open_store
from shardstream.store.checksum import checksum_bytes
from shardstream.store.direct_io import aligned
from shardstream.store.sharding import placed_in
from shardstream.stream import experts, quant_linear
from shardstream.switches import DIRECT_IO
from counting import linear_dequantizations
from tiny_models import save_checkpoint

PROMPT = torch.tensor([[1, 5, 9, 20, 33, 7]])


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """{family: (store, reference model)}; qwen2 ties its head to the embeddings, gemma scales them."""
    made = {}
    for family in ("llama", "qwen2", "gemma"):
        folder = tmp_path_factory.mktemp(family)
        reference = save_checkpoint(family, folder / "ckpt")
        convert(folder / "ckpt", folder / "store", progress=False)
        made[family] = (open_store(folder / "store"), reference)
    return made


def _greedy(stages: list[StageModel], tokens: list[int], new: int) -> list[int]:
    """Drive stages by hand as the coordinator does: prefill, then one token per step."""
    position, feed, out = 0, torch.tensor([tokens]), []
    for _ in range(new):
        data = feed
        for stage in stages:
            data = stage.forward("s", position, data)
        position += feed.shape[1]
        out.append(int(data.argmax(-1)))
        feed = torch.tensor([[out[-1]]])
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma"])
@pytest.mark.parametrize("cuts", [(1, 3), (2,), ()])
def test_stages_generate_exactly_what_transformers_generates(stores, family, cuts):
    store, reference = stores[family]
    bounds = [0, *cuts, store.num_layers]
    stages = [StageModel(store, a, b) for a, b in zip(bounds, bounds[1:])]
    expected = reference.generate(PROMPT, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, PROMPT.shape[1]:]
    assert _greedy(stages, PROMPT[0].tolist(), 12) == expected.tolist()


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma"])
def test_streamed_stages_generate_exactly_what_transformers_generates(stores, family):
    """Stages whose blocks are read from disk on every pass give transformers' tokens: a streamed
    stage before one in memory (budget 0: nothing resident), and the whole model as one stage with
    room for one block besides the two in flight (the first block stays); unloading stops the readers."""
    store, reference = stores[family]
    block = model_cost(store).layers[0].weight_bytes
    n = store.num_layers
    expected = reference.generate(PROMPT, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, PROMPT.shape[1]:]
    split = [StageModel(store, 0, 2, stream_budget=0), StageModel(store, 2, n)]
    whole = [StageModel(store, 0, n, stream_budget=3 * block)]
    assert [stage.streamed_blocks for stage in split + whole] == [[0, 1], [], list(range(1, n))]
    for stages in (split, whole):
        assert _greedy(stages, PROMPT[0].tolist(), 12) == expected.tolist()
    for stage in split + whole:
        stage.close()
    with pytest.raises(ValueError, match=r"blocks 0-1 were unloaded; re-send on the current plan"):
        split[0].forward("s", 0, PROMPT)


def test_a_stage_refuses_a_position_its_cache_does_not_hold(stores):
    store, _ = stores["llama"]
    stage = StageModel(store, 0, 2)
    stage.forward("s", 0, PROMPT)
    with pytest.raises(ValueError, match=r"session 's' is at token 6 on blocks 0-1, not 3; replay"):
        stage.forward("s", 3, torch.tensor([[4]]))



@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_a_batched_step_of_sessions_of_different_lengths_equals_their_steps_one_by_one(stores, family):
    """Three sessions (3, 6 and 9 tokens held) take one token each in one pass through two stages:
    the same hidden states and logits as one at a time, and the caches split back give the same
    next steps. gemma scales its embeddings, which the second stage's injected hidden states skip;
    the batched first stage streams its blocks from disk."""
    store, _ = stores[family]
    n = store.num_layers
    batched = [StageModel(store, 0, 2, stream_budget=0), StageModel(store, 2, n)]
    alone = [StageModel(store, 0, 2), StageModel(store, 2, n)]
    prompts = {"a": [1, 5, 9], "b": [3, 4, 5, 6, 7, 8], "c": [9, 8, 7, 6, 5, 4, 3, 2, 1]}
    for stages in (batched, alone):
        for session, prompt in prompts.items():
            stages[1].forward(session, 0, stages[0].forward(session, 0, torch.tensor([prompt])))
    steps = [(session, len(prompt), torch.tensor([[40 + k]])) for k, (session, prompt) in enumerate(prompts.items())]
    hidden = batched[0].forward_batch(steps)
    logits = batched[1].forward_batch([(s, p, h) for (s, p, _), h in zip(steps, hidden)])
    for (session, position, ids), h, out in zip(steps, hidden, logits):
        one = alone[0].forward(session, position, ids)
        torch.testing.assert_close(h, one, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out, alone[1].forward(session, position, one), rtol=1e-5, atol=1e-6)
    for (session, position, _), out in zip(steps, logits):
        for later in range(position + 1, position + 3):
            token = torch.tensor([[later % 100]])
            got = batched[1].forward(session, later, batched[0].forward(session, later, token))
            torch.testing.assert_close(got, alone[1].forward(session, later, alone[0].forward(session, later, token)),
                                       rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="one new token of each of distinct, started sessions"):
        batched[0].forward_batch([("a", 6, torch.tensor([[1]])), ("a", 6, torch.tensor([[2]]))])
    batched[0].close()

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_tensors_cross_the_wire_bit_exact(dtype):
    tensor = (torch.randn(1, 3, 5) * 100).to(dtype)
    header, back = unpack(pack({"session": "x", "step": 2}, tensor))
    assert header["session"] == "x" and header["shape"] == [1, 3, 5] and back.dtype == dtype
    assert torch.equal(back, tensor)


def test_a_header_that_does_not_match_the_bytes_is_refused():
    header, data = pack({}, torch.zeros(2, 2))
    wrong = json.dumps({**json.loads(header), "shape": [2, 3]}).encode()
    with pytest.raises(ValueError, match=r"shape \[2, 3\] torch.float32 carries 16 bytes"):
        unpack([wrong, data])
    with pytest.raises(ValueError, match="dtype 'os.system'"):
        unpack([json.dumps({"dtype": "os.system", "shape": []}).encode(), b""])


def test_costs_come_from_the_manifest_and_match_the_model(stores):
    store, reference = stores["llama"]
    cost = model_cost(store)
    block = sum(p.numel() for p in reference.model.layers[0].parameters())
    assert [c.weight_bytes for c in cost.layers] == [4 * block] * 4
    assert cost.layers[0].kv_bytes_per_token == 2 * 2 * 8 * 4  # k and v x kv heads x head dim x fp32
    assert cost.layers[0].flops_per_token == 2 * block
    assert cost.start_bytes == 4 * reference.model.embed_tokens.weight.numel()
    assert cost.end_bytes == 4 * (reference.lm_head.weight.numel() + reference.model.norm.weight.numel())
    assert cost.activation_bytes_per_token == 32 * 4


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """(cost with its experts in its blocks, the store with them placed apart, transformers' model): a tiny
    Mixtral, 3 blocks of 4 experts, 2 a token."""
    folder = tmp_path_factory.mktemp("mixtral")
    reference = save_checkpoint("mixtral", folder / "ckpt")
    convert(folder / "ckpt", folder / "store", progress=False)
    whole = model_cost(open_store(folder / "store"))
    place_experts(open_store(folder / "store"), {"hot": "."})
    return whole, open_store(folder / "store"), reference


def _block_bytes(reference, experts: bool) -> int:
    """fp32 bytes of block 0's parameters, with or without its experts."""
    return 4 * sum(p.numel() for name, p in reference.model.layers[0].named_parameters()
                   if experts or ".experts." not in name)


def test_a_block_with_experts_in_it_costs_all_of_them(mixtral):
    whole, _, reference = mixtral
    assert [c.weight_bytes for c in whole.layers] == [_block_bytes(reference, experts=True)] * 3
    assert {(c.expert_reading_bytes, c.expert_bytes_per_token) for c in whole.layers} == {(0, 0)}


def test_a_block_with_experts_read_on_demand_costs_its_other_weights_and_their_reading(mixtral):
    """Held: attention, router, norms, and the buffers of one expert read and MAX_DEPTH read ahead (these small
    experts fit READ_AHEAD_BYTES many times); read a token: 2 of its 4 experts."""
    whole, store, reference = mixtral
    cost = model_cost(store)
    lengths = [record.length for record in placed_in(store, 0)]
    assert len(lengths) == 4 and len(set(lengths)) == 1 and lengths[0] > 3 * 16 * 32 * 4   # gate, up, down in fp32
    dense = _block_bytes(reference, experts=False)
    assert [c.weight_bytes for c in cost.layers] == [dense] * 3
    assert dense + 4 * lengths[0] < whole.layers[0].weight_bytes + 4 * lengths[0]   # what was counted before
    assert [c.expert_reading_bytes for c in cost.layers] == [(1 + experts.MAX_DEPTH) * aligned(lengths[0])] * 3
    assert [c.expert_bytes_per_token for c in cost.layers] == [2 * lengths[0]] * 3
    assert [c.flops_per_token for c in cost.layers] == [c.flops_per_token for c in whole.layers]


def _devices(budget: int, disk: float) -> list[Device]:
    return [Device("a", budget, 1.0, disk_bytes_per_s=disk), Device("b", budget, 1.0, disk_bytes_per_s=disk)]


def test_experts_read_on_demand_are_planned_in_memory_and_priced_by_the_disk(mixtral, monkeypatch):
    """Experts as big as the read-ahead (one read ahead, as a Mixtral-8x7B's): two devices that hold the
    blocks without their experts keep them all in memory, where counting every expert held left no split,
    not even streamed. A token reads each block's 2 routed experts from disk:
    a slower disk gives a slower stage, and a device with no measured disk prices them at
    UNMEASURED_DISK_BYTES_PER_S."""
    _, store, _ = mixtral
    length = placed_in(store, 0)[0].length
    monkeypatch.setattr(experts, "READ_AHEAD_BYTES", aligned(length))
    cost = model_cost(store)
    block, reading = cost.layers[0].weight_bytes, cost.layers[0].expert_reading_bytes
    assert reading == 2 * aligned(length)
    options = PlanOptions(context_length=0, objective="throughput", default_link=Link(0.0, 1e30), streaming=False)
    first = cost.start_bytes + 2 * block + reading
    budget = max(first, cost.end_bytes + block + reading)
    stages = plan(cost, _devices(budget, 0.0), options).stages
    assert [(s.device, s.first_layer, s.last_layer_exclusive, s.streamed_bytes_per_token) for s in stages] == [
        ("a", 0, 2, 0), ("b", 2, 3, 0)]
    assert stages[0].memory_bytes == first   # the expert buffers once for its two blocks
    assert [s.expert_bytes_per_token for s in stages] == [2 * 2 * length, 2 * length]
    assert stages[0].read_seconds_per_token == pytest.approx(4 * length / UNMEASURED_DISK_BYTES_PER_S)

    old = ModelCost([replace(c, weight_bytes=c.weight_bytes + 4 * length, expert_reading_bytes=0,
                             expert_bytes_per_token=0) for c in cost.layers], cost.activation_bytes_per_token, cost.start_bytes, cost.end_bytes,
                    cost.end_flops_per_token, cost.head_bytes)
    with pytest.raises(PlanInfeasible, match="No split of the 3 blocks fits in memory"):
        plan(old, _devices(budget, 0.0), options)
    with pytest.raises(PlanInfeasible, match="Streaming blocks from disk does not help"):   # 2 blocks in flight
        plan(old, _devices(budget, 1e6), replace(options, streaming=True))

    times = {}
    for disk in (1e6, 2e6):
        stages = plan(cost, _devices(budget, disk), options).stages
        assert stages[0].read_seconds_per_token == pytest.approx(4 * length / disk)
        flops = sum(c.flops_per_token for c in cost.layers[:2]) / 1e9
        assert stages[0].predicted_seconds_per_token == pytest.approx(flops + 4 * length / disk)
        times[disk] = stages[0].predicted_seconds_per_token
    assert times[1e6] - times[2e6] == pytest.approx(4 * length / 2e6)


def test_the_last_stage_of_a_tied_model_ships_the_embedding_file(stores):
    store, _ = stores["qwen2"]
    files = json.loads(stage_manifest(store, 3, 4))["files"]
    embedding_file = store.manifest.tensors["model.embed_tokens.weight"].file
    assert embedding_file in files and "config.json" in files and "manifest.json" in files
    assert not any(name.startswith("mid/0/") for name in files)
    assert math.isclose(files[embedding_file]["size"], store.manifest.files[embedding_file].size)


def test_a_stage_package_is_named_by_its_manifest_checksum(stores, tmp_path):
    store, _ = stores["llama"]
    package = package_stage(store, 1, 3, tmp_path)
    body = (package.folder / "stage.json").read_bytes()
    assert package.stage_id == checksum_bytes(body) and (package.first, package.last) == (1, 3)
    for name, record in json.loads(body)["files"].items():
        assert (package.folder / name).stat().st_size == record["size"]


def _tree(root, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_cgroup_headroom_reads_v1_and_v2_at_every_level(tmp_path):
    """The layouts of a cgroup v2 host (this machine has v1, tested for real in test_pipeline.py)."""
    from shardstream.memory import available_bytes, cgroup_headroom

    v2 = tmp_path / "v2"
    _tree(v2, {"cgroup.controllers": "cpu memory", "pod/memory.max": "5000\n", "pod/memory.current": "1000\n",
               "pod/app/memory.max": "max\n", "pod/app/memory.current": "700\n"})
    _tree(tmp_path, {"v2.cgroup": "0::/pod/app\n", "v1.cgroup": "4:memory:/docker/abc\n2:cpu:/\n"})
    assert cgroup_headroom(tmp_path / "v2.cgroup", v2) == [4000]
    v1 = tmp_path / "v1"   # a cgroup namespace: the process's own cgroup is the mount's root; 2**63 means no limit
    _tree(v1, {"memory/memory.limit_in_bytes": "734003200", "memory/memory.usage_in_bytes": "134003200"})
    assert cgroup_headroom(tmp_path / "v1.cgroup", v1) == [600_000_000]
    _tree(v1, {"memory/memory.stat": "inactive_file 5\ntotal_inactive_file 100000000\ntotal_active_file 9\n"})
    assert cgroup_headroom(tmp_path / "v1.cgroup", v1) == [700_000_000]   # clean inactive cache is reclaimable
    _tree(v2, {"pod/memory.stat": "active_file 50\ninactive_file 300\n"})
    assert cgroup_headroom(tmp_path / "v2.cgroup", v2) == [4300]
    _tree(v1, {"memory/memory.limit_in_bytes": "9223372036854771712"})
    assert cgroup_headroom(tmp_path / "v1.cgroup", v1) == []
    assert available_bytes(123, tmp_path / "v2.cgroup", v2) == 123
    assert available_bytes(None, tmp_path / "v2.cgroup", v2) == 4300


@pytest.mark.skipif(not quant_linear.available(), reason="no AVX-512 or AVX2, or no C++ compiler: the kernel is off here")
@pytest.mark.parametrize("family, mode", [("llama", "off"), ("llama", "on"), ("qwen2", "off")])   # on: O_DIRECT
def test_the_stages_of_a_quantized_store_multiply_from_its_codes(tmp_path, monkeypatch, family, mode):
    """Two stages of a 4-bit store, the first streamed, give the tokens of one stage holding every block in
    memory, and no Linear weight of theirs is ever dequantized: every product reads the codes as stored (the
    last stage of qwen2 too, whose head is the first stage's embedding)."""
    save_checkpoint(family, tmp_path / "ckpt")
    convert(tmp_path / "ckpt", tmp_path / "store", compression="4bit", progress=False)
    store = open_store(tmp_path / "store")
    monkeypatch.setenv(DIRECT_IO.name, mode)
    n = store.num_layers
    dequantized = linear_dequantizations(monkeypatch)
    split = [StageModel(store, 0, 1, stream_budget=0), StageModel(store, 1, n)]
    whole = StageModel(store, 0, n)
    assert split[0].streamed_blocks == [0] and split[1].streamed_blocks == whole.streamed_blocks == []
    assert _greedy(split, PROMPT[0].tolist(), 8) == _greedy([whole], PROMPT[0].tolist(), 8)
    assert dequantized == []
    # q, k, v, o, gate, up, down of each block; the embedding on the first stage, the head on the last
    assert [len(stage.engine.packed_weights) for stage in split] == [7 + 1, 7 * (n - 1) + 1]
    for stage in [*split, whole]:
        stage.close()
