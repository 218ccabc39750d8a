"""On-demand MoE experts: a tiny Mixtral streams with experts on two tiers, reading only routed experts (and
so do tiny Qwen2-MoE and Qwen3-MoE, their experts on one tier)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from shardstream.convert import convert
from shardstream.errors import InvalidOption, StoreCorrupt, StoreIncomplete
from shardstream.shard import load_index, place_experts
from shardstream.store import open_store
from shardstream.store.sharding import Expert, _read_direct
from shardstream.stream import StreamingModel
from shardstream.store.direct_io import aligned
from shardstream.stream.direct import read_buffer
from tiny_models import save_checkpoint

LAYERS, EXPERTS, TOP_K = 3, 4, 2
COLD = {(0, 1): "cold", (1, 3): "cold", (2, 0): "cold", (2, 2): "cold"}


def _store(tmp: Path, place: bool = True):
    """A converted tiny Mixtral and its transformers twin; experts over a hot (in-store) and a cold tier."""
    reference = save_checkpoint("mixtral", tmp / "ckpt")
    convert(tmp / "ckpt", tmp / "store", progress=False)
    store = open_store(tmp / "store")
    if place:
        place_experts(store, {"hot": ".", "cold": str(tmp / "cold")}, placement=COLD)
    return reference, store


@pytest.fixture(scope="module")
def placed(tmp_path_factory):
    return _store(tmp_path_factory.mktemp("experts"))


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "qwen3_moe"])
def family_placed(request, tmp_path_factory):
    """Each MoE family converted with its experts placed apart: the two-tier Mixtral, the Qwen ones on one tier."""
    if request.param == "mixtral":
        return request.getfixturevalue("placed")
    tmp = tmp_path_factory.mktemp(request.param)
    reference = save_checkpoint(request.param, tmp / "ckpt")
    convert(tmp / "ckpt", tmp / "store", progress=False)
    store = open_store(tmp / "store")
    place_experts(store, {"hot": "."})
    return reference, store


def _sizes(reference) -> tuple[int, int, int]:
    """(blocks, experts a block, experts routed to a token) of the reference's config."""
    config = reference.config
    return config.num_hidden_layers, getattr(config, "num_local_experts", None) or config.num_experts, \
        config.num_experts_per_tok


@pytest.fixture
def file_reads(monkeypatch) -> list[str]:
    """Every expert read (the container it is read from), by wrapping the store's expert readers (the real
    reads still happen)."""
    reads: list[str] = []
    for method in ("raw", "fill"):
        real = getattr(Expert, method)

        def counting(self, *args, real=real, **kwargs):
            reads.append(self.record.file)
            return real(self, *args, **kwargs)

        monkeypatch.setattr(Expert, method, counting)
    return reads


def _routed(reference, ids: torch.Tensor, **kwargs) -> tuple[int, object]:
    """How many distinct (layer, expert) pairs transformers' own router picks, and its output."""
    picked: set[tuple[int, int]] = set()
    hooks = [layer.mlp.experts.register_forward_pre_hook(
        lambda module, args, i=i: picked.update((i, e) for e in args[1].unique().tolist()))
        for i, layer in enumerate(reference.model.layers)]
    with torch.no_grad():
        out = reference(ids, use_cache=True, **kwargs)
    for hook in hooks:
        hook.remove()
    return len(picked), out


def test_placement_spans_both_tiers(placed):
    _, store = placed
    tiers = {record.tier for record in load_index(store).experts.values()}
    assert tiers == {"hot", "cold"} and load_index(store).experts["2:2"].tier == "cold"


@pytest.mark.parametrize("budget, experts", [(0, "on_demand"), ("auto", "on_demand"), (0, "with_block")],
                         ids=["streamed", "resident", "with-block"])
def test_logits_and_generate_match_transformers(family_placed, budget, experts):
    """Experts are stored apart (on their tiers only): on demand, or read back with their block."""
    reference, store = family_placed
    assert not any(r.expert is not None for r in store.manifest.tensors.values())
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    with StreamingModel(store, experts=experts, max_resident_memory=budget) as model:
        got = model(ids).logits
        with torch.no_grad():
            want = reference(ids).logits
        assert (got - want).abs().max().item() <= 1e-5
        tokens = model.generate(ids, max_new_tokens=6, do_sample=False)
        assert torch.equal(tokens, reference.generate(ids, max_new_tokens=6, do_sample=False))


def test_reads_only_routed_experts(family_placed, file_reads):
    reference, store = family_placed
    layers, experts, top_k = _sizes(reference)
    ids = torch.randint(3, 128, (1, 4), generator=torch.Generator().manual_seed(2))
    with StreamingModel(store, experts="on_demand", max_resident_memory=0, prefetching=False,
                        max_expert_memory=0) as model:   # none kept: every pass reads what it routes to
        routed, prefill = _routed(reference, ids)
        out = model(ids, use_cache=True)
        assert model.experts.loads == len(file_reads) == routed <= layers * ids.shape[1] * top_k
        step = prefill.logits[:, -1:].argmax(-1)
        routed, _ = _routed(reference, step, past_key_values=prefill.past_key_values)
        before = model.experts.loads
        model(step, past_key_values=out.past_key_values, use_cache=True)
        decoded = model.experts.loads - before
        assert decoded == routed <= layers * top_k < layers * experts
        assert len(file_reads) == model.experts.loads


def test_unplaced_store_is_refused_and_corrupt_expert_named(tmp_path):
    _, store = _store(tmp_path, place=False)
    with pytest.raises(InvalidOption, match="no placed expert"):
        StreamingModel(store, experts="on_demand")
    with pytest.raises(InvalidOption, match="experts must be one of"):
        StreamingModel(store, experts="lazy")
    place_experts(store, {"hot": ".", "cold": str(tmp_path / "cold")}, placement=COLD)
    for expert in range(EXPERTS):  # whichever layer-0 expert the router picks first is damaged
        record = load_index(store).experts[f"0:{expert}"]
        root = tmp_path / "cold" if record.tier == "cold" else store.root
        path = root / record.file
        data = bytearray(path.read_bytes())
        data[record.offset + record.length - 1] ^= 0xFF
        path.write_bytes(bytes(data))
    corrupt = r"group_0\.1\.experts \(expert 0:\d\) fails its checksum"
    for experts, held in (("on_demand", 0), ("with_block", "auto")):   # read on routing, or with the block
        with StreamingModel(store, experts=experts, max_resident_memory=0, max_expert_memory=held) as model:
            with pytest.raises(StoreCorrupt, match=corrupt):
                model(torch.tensor([[5, 6, 7]]))
    with pytest.raises(StoreCorrupt, match=corrupt):   # all of them fit: read, and checked, at load
        StreamingModel(store, experts="on_demand", max_resident_memory=0)


@pytest.mark.parametrize("experts_at_once", [1, 3])
@pytest.mark.parametrize("budget", [0, "auto"], ids=["streamed", "resident"])
def test_experts_held_stay_within_max_expert_memory(placed, budget, experts_at_once):
    """A pass routing to more experts than fit reads each once and keeps no more than the budget: the same
    tokens as transformers."""
    reference, store = placed
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    with StreamingModel(store, experts="on_demand", max_resident_memory=budget) as model:
        one = model.experts.expert_bytes
    with StreamingModel(store, experts="on_demand", max_resident_memory=budget,
                        max_expert_memory=experts_at_once * one) as model:
        routed, want = _routed(reference, ids)
        got = model(ids).logits
        assert (got - want.logits).abs().max().item() <= 1e-5
        assert model.experts.loads == routed > LAYERS * experts_at_once
        assert 0 < model.experts.cache.peak_bytes <= experts_at_once * one
        tokens = model.generate(ids, max_new_tokens=6, do_sample=False)
        assert torch.equal(tokens, reference.generate(ids, max_new_tokens=6, do_sample=False))


def test_experts_that_all_fit_are_read_at_load(placed, file_reads):
    """With max_expert_memory='auto' and room for them all, every expert is read once at load, so a pass reads no
    file and every routing is served from memory, with transformers' logits; an explicit budget that holds them
    all still reads on routing."""
    reference, store = placed
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(3))
    routed, want = _routed(reference, ids)
    with StreamingModel(store, experts="on_demand", max_resident_memory=0) as model:
        assert len(file_reads) == len(model.experts.cache) == model.experts.count
        got = model(ids).logits
        assert len(file_reads) == model.experts.count and model.experts.loads == 0
        assert model.experts.cache.stats.hits == routed and model.experts.cache.stats.misses == 0
        assert (got - want.logits).abs().max().item() <= 1e-5
    file_reads.clear()
    with StreamingModel(store, experts="on_demand", max_resident_memory=0, max_expert_memory=None) as model:
        assert not file_reads and not len(model.experts.cache)


def test_experts_kept_serve_the_next_pass_unread(placed, file_reads):
    """Within the budget every routed expert stays after its pass: the same pass again reads no file, each
    routing a hit, and gives the same bits."""
    reference, store = placed
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(3))
    with StreamingModel(store, experts="on_demand", max_resident_memory=0, max_expert_memory=None) as model:
        routed, _ = _routed(reference, ids)
        first = model(ids).logits
        assert model.experts.loads == len(file_reads) == routed == model.experts.cache.stats.misses
        assert torch.equal(model(ids).logits, first)
        assert model.experts.loads == len(file_reads) == routed == model.experts.cache.stats.hits


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_expert_memory=1 << 20), "max_expert_memory applies only with experts='on_demand'"),
    (dict(experts="on_demand", max_expert_memory=-1), "max_expert_memory must be 'auto', None"),
    (dict(experts="on_demand", max_expert_memory="1GB"), "max_expert_memory must be 'auto', None"),
])
def test_max_expert_memory_is_checked(placed, kwargs, message):
    _, store = placed
    with pytest.raises(InvalidOption, match=message):
        StreamingModel(store, **kwargs)


def test_missing_expert_file_is_named(tmp_path):
    _, store = _store(tmp_path)
    for record in load_index(store).experts.values():
        if record.group == 0:
            ((tmp_path / "cold") if record.tier == "cold" else store.root).joinpath(record.file).unlink(missing_ok=True)
    missing = r"group_0\.1\.experts is missing; run `shardstream verify`"
    with StreamingModel(store, experts="on_demand", max_resident_memory=0, max_expert_memory=0) as model:
        with pytest.raises(StoreIncomplete, match=missing):   # read on routing
            model(torch.tensor([[5, 6, 7]]))
    with pytest.raises(StoreIncomplete, match=missing):   # all of them fit: read at load
        StreamingModel(store, experts="on_demand", max_resident_memory=0)


def _top_4_store(tmp: Path, model_type: str, dtype: torch.dtype = torch.float32, compression: str | None = None,
                 **extra):
    """A tiny model of `model_type` that picks 4 of 8 experts, converted (with `compression`), its experts placed
    apart; and its transformers twin."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                  num_experts=8, num_experts_per_tok=4, decoder_sparse_step=1, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                  max_position_embeddings=128, **extra)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    reference.save_pretrained(tmp / "ckpt")
    convert(tmp / "ckpt", tmp / "store", compression=compression, progress=False)
    store = open_store(tmp / "store")
    place_experts(store, {"hot": "."})
    return reference, store


TOP_4_EXPERT_BYTES = 3 * 32 * 16 * 4   # an expert's gate, up and down in float32 (_top_4_store)


@pytest.mark.parametrize("model_type, extra", [
    ("qwen3_moe", dict(head_dim=8, norm_topk_prob=True)),
    ("qwen2_moe", dict(shared_expert_intermediate_size=32)),
])
def test_top_4_families_match_transformers(tmp_path, model_type, extra):
    """Qwen3-MoE and Qwen2-MoE (a shared expert beside the routed ones) pick 4 of 8: with one, three or all
    experts held, the logits are transformers' within float rounding (its own grouped and eager experts
    differ as much: gate and up are two products here, one there) and the greedy tokens are its own."""
    reference, store = _top_4_store(tmp_path, model_type, **extra)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(ids).logits
    tokens = reference.generate(ids, max_new_tokens=6, do_sample=False)
    one = TOP_4_EXPERT_BYTES
    for budget in ("auto", one, 3 * one):
        with StreamingModel(store, experts="on_demand", max_resident_memory=0, max_expert_memory=budget) as model:
            got = model(ids).logits
            assert (got - want).abs().max().item() <= 1e-6
            assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), tokens)


def test_held_experts_multiply_first_and_add_in_expert_order(tmp_path, monkeypatch):
    """A pass multiplies the experts it holds before those it reads, so that none waits behind a read, yet adds
    their outputs in expert order, as transformers does: the logits are the same bits as when every expert is
    read in expert order (four outputs a token, each sum rounded to bfloat16: their order shows)."""
    import shardstream.stream.experts as experts

    _, store = _top_4_store(tmp_path, "qwen3_moe", torch.bfloat16, head_dim=8, norm_topk_prob=True)
    ids = torch.tensor([[11, 42]])
    with StreamingModel(store, experts="on_demand", max_resident_memory=0, max_expert_memory=0) as model:
        want = model(ids).logits
        held = model.experts.expert_bytes   # an expert as held, buffer alignment included
    multiplied, multiply, forward = [], experts._multiply, experts.OnDemandExperts._forward

    def recording_forward(self, *args):
        multiplied.append([])   # the experts this pass multiplies, in order
        return forward(self, *args)

    def recording_multiply(block, weights, expert, *rest):
        multiplied[-1].append(expert)
        multiply(block, weights, expert, *rest)

    monkeypatch.setattr(experts.OnDemandExperts, "_forward", recording_forward)
    monkeypatch.setattr(experts, "_multiply", recording_multiply)
    with StreamingModel(store, experts="on_demand", max_resident_memory=0,
                        max_expert_memory=8 * held) as model:
        model(ids[:, :1])   # holds the experts of the first token, which the pass below routes to again
        multiplied.clear()
        got = model(ids).logits
    assert any(order != sorted(order) for order in multiplied)   # held ones came before lower ones read
    assert torch.equal(got, want)


def test_expert_reads_past_the_page_cache_give_the_same_tensors(tmp_path):
    """Experts that outgrow memory are read with O_DIRECT into the page-aligned read buffers (any other
    buffer falls back to reads dropped from the page cache): the same tensors as a plain read, and a
    damaged file fails its checksum either way."""
    _, store = _store(tmp_path)
    index = load_index(store)
    for record in list(index.experts.values())[:3]:
        expert = Expert(store, index, record)
        size = expert.nbytes
        assert _read_direct(expert.path, read_buffer(aligned(size)), record.offset, size) == size   # O_DIRECT taken
        expected = expert.read(verify=True)
        for buffer in (read_buffer(aligned(size)), bytearray(size)):
            for drop in (True, False):
                got = expert.tensors_in(buffer, *expert.fill(buffer, drop=drop))
                assert got.keys() == expected.keys() and all(torch.equal(got[n], expected[n]) for n in got)
    data = bytearray(expert.path.read_bytes())
    data[record.offset + size // 2] ^= 0xFF
    expert.path.write_bytes(bytes(data))
    for buffer in (read_buffer(aligned(size)), bytearray(size)):
        with pytest.raises(StoreCorrupt, match="fails its checksum"):
            expert.tensors_in(buffer, *expert.fill(buffer, drop=True))


def test_an_expert_is_hashed_on_its_first_read_in_the_process_only(tmp_path, monkeypatch):
    """As a block's part: an expert's checksum is checked the first time the process reads it, and its later reads
    (nothing kept: every pass reads what it routes to) by their length only, without a core hashing beside the
    read; `verify_checksums=False` hashes none, so a damaged expert of the right length is not refused."""
    fills: list[tuple[str, bool]] = []
    real = Expert.fill

    def recording(self, *args, **kwargs):
        done, hashing = real(self, *args, **kwargs)
        fills.append((self.record.key, hashing is not None))
        return done, hashing

    monkeypatch.setattr(Expert, "fill", recording)
    _, store = _store(tmp_path)
    ids = torch.tensor([[5, 6, 7]])
    options = dict(experts="on_demand", max_resident_memory=0, max_expert_memory=0, prefetching=False)
    with StreamingModel(store, **options) as model:
        first = model(ids).logits
        read_first = list(fills)
        assert read_first and all(hashed for _, hashed in read_first)
        assert len({key for key, _ in read_first}) == len(read_first) == model.experts.loads
        again = model(ids).logits
        assert sorted(key for key, _ in fills[len(read_first):]) == sorted(key for key, _ in read_first)
        assert not any(hashed for _, hashed in fills[len(read_first):])
        assert torch.equal(first, again)
    for expert in range(EXPERTS):   # every layer-0 expert damaged, its length kept
        record = load_index(store).experts[f"0:{expert}"]
        path = (tmp_path / "cold" if record.tier == "cold" else store.root) / record.file
        data = bytearray(path.read_bytes())
        data[record.offset + record.length // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    fills.clear()
    with StreamingModel(store, **options, verify_checksums=False) as model:
        model(ids)
        assert fills and not any(hashed for _, hashed in fills)
    with StreamingModel(store, **options) as model, pytest.raises(StoreCorrupt, match="fails its checksum"):
        model(ids)


@pytest.mark.parametrize("drop", [True, False])
def test_a_read_made_without_its_checksum_is_checked_by_its_length(tmp_path, drop):
    """A read not hashed (the expert passed its checksum earlier in the process, or checksums are off) still
    refuses bytes cut short: the container's last expert, its file truncated."""
    _, store = _store(tmp_path)
    index = load_index(store)
    record = max(index.experts.values(), key=lambda r: (r.file, r.offset))
    expert = Expert(store, index, record)
    with open(expert.path, "r+b") as handle:
        handle.truncate(record.offset + record.length - 100)
    buffer = read_buffer(aligned(record.length))
    done, hashing = expert.fill(buffer, drop=drop, verify=False)
    assert hashing is None and done == record.length - 100
    with pytest.raises(StoreCorrupt, match=rf"\(expert {record.key}\) is {done} bytes, not the {record.length} its index"):
        expert.tensors_in(buffer, done, hashing)


@pytest.mark.parametrize("direct", [True, False])
def test_a_read_is_hashed_piece_by_piece_as_it_lands(tmp_path, monkeypatch, direct):
    """An expert's checksum is made while it is read, a piece at a time (O_DIRECT requests or plain chunks),
    and is the checksum of exactly its bytes, not of the page-rounded tail an O_DIRECT read brings."""
    import xxhash

    from shardstream.store import direct_io, sharding
    from shardstream.store.checksum import HashAsRead

    monkeypatch.setattr(direct_io, "LANDED_PIECE", 3 * 4096)
    monkeypatch.setattr(sharding, "READ_CHUNK", 3 * 4096)
    size = 10 * 4096 + 123
    data = bytes(range(256)) * (aligned(size + 4096) // 256)
    (tmp_path / "container").write_bytes(data)
    record = sharding.FileRecord(size=size, xxh3_128=xxhash.xxh3_128_hexdigest(data[4096:4096 + size]))
    hashed = []
    buffer = read_buffer(aligned(size))
    hashing = HashAsRead(memoryview(buffer)[:size])
    landed = lambda done: (hashed.append(done), hashing.landed(done))  # noqa: E731
    if direct:
        done = _read_direct(tmp_path / "container", buffer, 4096, size, landed=landed)
    else:
        done = sharding._read_plain(tmp_path / "container", memoryview(buffer)[:size], 4096, False, landed=landed)
    assert done == size and hashing.hexdigest() == record.xxh3_128
    assert hashed == [3 * 4096, 6 * 4096, 9 * 4096, aligned(size) if direct else size]


@pytest.mark.parametrize("compression", [None, "4bit", "int4"])
def test_experts_multiply_from_stored_bf16_or_codes_in_float32(tmp_path, compression):
    """A bf16 store computed in float32 (the path of a CPU without bf16 instructions), plain or quantized:
    experts on demand multiply the bf16 values or the codes as stored, so an expert held takes its file's
    bytes, not a float32 copy; the logits are those of the same store with its experts read with their block
    (dequantized there), within the rounding of int4's products."""
    reference = save_checkpoint("mixtral", tmp_path / "ckpt", dtype=torch.bfloat16)
    convert(tmp_path / "ckpt", tmp_path / "store", compression=compression, progress=False)
    store = open_store(tmp_path / "store")
    place_experts(store, {"hot": "."})
    experts = reference.model.layers[0].mlp.experts
    float32_bytes = 4 * (experts.gate_up_proj[0].numel() + experts.down_proj[0].numel())
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    with StreamingModel(store, compute_dtype="float32", max_resident_memory=0) as model:
        want, tokens = model(ids).logits, model.generate(ids, max_new_tokens=6, do_sample=False)
    with StreamingModel(store, experts="on_demand", compute_dtype="float32", max_resident_memory=0,
                        max_expert_memory=None) as model:
        got = model(ids).logits
        if compression == "int4":   # its products round the activations to 8 bits (int4_linear.py), per row
            assert (got - want).abs().max().item() <= 0.02 * want.abs().max().item()
        else:
            assert (got - want).abs().max().item() <= 1e-5
            assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), tokens)
        held = model.experts.cache
        assert held.held_bytes <= len(held) * model.experts.expert_bytes
        assert model.experts.expert_bytes < float32_bytes


def test_a_decode_step_in_bf16_multiplies_its_experts_in_float32_rounded_once(tmp_path, monkeypatch):
    """In bf16 math a decode step's row goes through the half-precision kernel (float32 sums rounded once to
    bf16, as torch's bf16 product rounds its own): the logits of the same store with its experts read with
    their block, within bf16 rounding, step after step."""
    save_checkpoint("mixtral", tmp_path / "ckpt", dtype=torch.bfloat16)
    convert(tmp_path / "ckpt", tmp_path / "store", progress=False)
    store = open_store(tmp_path / "store")
    place_experts(store, {"hot": "."})
    from shardstream.stream import experts as module, half_linear

    kernel_rows = []   # rows the kernel multiplied, by the real kernel (wrapped to count)
    real = half_linear.linear

    def counting(x, weight, bias):
        kernel_rows.append(x.shape[0])
        return real(x, weight, bias)

    monkeypatch.setattr(module.half_linear, "linear", counting)
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(1))
    steps = {}
    for experts in ("with_block", "on_demand"):
        with StreamingModel(store, experts=experts, compute_dtype="bfloat16", max_resident_memory=0) as model:
            out = model(ids, use_cache=True)
            past, logits = out.past_key_values, []
            for _ in range(4):   # the same tokens on both sides: each step's logits compared alone
                out = model(torch.tensor([[5 + len(logits)]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits.append(out.logits.float())
            steps[experts] = torch.cat(logits)
    scale = steps["with_block"].abs().max().item()
    assert (steps["on_demand"] - steps["with_block"]).abs().max().item() <= 2e-2 * scale
    assert kernel_rows and set(kernel_rows) <= {1, 2} or not half_linear.available()


@pytest.mark.parametrize("sequences", [1, 3])
@pytest.mark.parametrize("compression, compute", [(None, "float32"), (None, "bfloat16"), ("int4", "float32")])
def test_a_decode_step_multiplies_the_experts_it_holds_together_with_the_bits_of_one_by_one(
        tmp_path, monkeypatch, compression, compute, sequences):
    """A decode step multiplies the held experts that one token alone routes to in two kernel calls (their gates
    and ups, then their downs), not three an expert, for one sequence or a batch (whose experts routed to by two
    tokens go one by one): bf16 weights in float32 or bf16 math, and int4 codes, give step after step the same
    logits, bit for bit, as multiplying every expert alone."""
    from shardstream.stream import experts as module, half_linear, int4_linear

    _, store = _top_4_store(tmp_path, "qwen3_moe", torch.bfloat16, compression, head_dim=8)
    real, together = module._multiply_together, []

    def recording(*args):
        together.append(real(*args))
        return together[-1]

    def decode_steps() -> torch.Tensor:
        with StreamingModel(store, experts="on_demand", compute_dtype=compute, max_resident_memory=0,
                            max_expert_memory=None) as model:
            out = model(torch.tensor([[11, 42, 7], [3, 8, 60], [21, 2, 90]][:sequences]), use_cache=True)
            past, logits = out.past_key_values, []
            for token in (5, 9, 5, 9):   # routed again: held
                out = model(torch.tensor([[token], [token + 20], [token + 40]][:sequences]), past_key_values=past,
                            use_cache=True)
                past = out.past_key_values
                logits.append(out.logits)
            return torch.cat(logits)

    monkeypatch.setattr(module, "_multiply_together", recording)
    got = decode_steps()
    monkeypatch.setattr(module, "_multiply_together", lambda *args: set())
    assert torch.equal(got, decode_steps())
    assert any(together) or not (int4_linear if compression else half_linear).available()


def test_blocks_are_sized_without_the_experts_read_on_demand(family_placed):
    """A block whose experts are read on demand keeps only its other weights in memory, so that is all residency
    counts for it: a budget of those bytes keeps every block resident, and no expert fills a block's slot."""
    reference, store = family_placed
    experts = {n for n, p in reference.named_parameters() if ".experts." in n}
    others = [sum(p.numel() * p.element_size() for n, p in layer.named_parameters() if ".experts." not in f".{n}")
              for layer in reference.model.layers]
    with StreamingModel(store, experts="on_demand", max_resident_memory=sum(others), max_expert_memory=0) as model:
        assert list(model.report().block_bytes) == others
        assert model.resident_blocks == list(range(len(others)))
        with StreamingModel(store, experts="with_block", max_resident_memory=sum(others)) as whole:
            assert all(b > o for b, o in zip(whole.report().block_bytes, others))   # experts counted with their block
        ids = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            assert (model(ids).logits - reference(ids).logits).abs().max().item() <= 1e-5
        assert experts and all(model.model.get_parameter(n).device.type == "meta" for n in experts)


@pytest.mark.parametrize("large", [False, True], ids=["small-experts", "large-experts"])
@pytest.mark.parametrize("read_ahead", [True, False], ids=["reading-ahead", "one-read"])
def test_experts_read_ahead_of_the_router_are_used_or_stopped(family_placed, file_reads, monkeypatch, read_ahead,
                                                             large):
    """With nothing held, each block's likely experts are read while the block before it runs: a right guess
    is that block's read (the same reads counted as with no guessing), a wrong one is read (or stopped) and
    freed; prefetching=False reads after routing only. The tokens are transformers', and the reads never take
    more buffers than they have room for. Experts as large as READ_AHEAD_BYTES are read on one thread, one
    after the other, the guesses and their checks too."""
    from shardstream.stream import experts as module

    if large:
        monkeypatch.setattr(module, "READ_AHEAD_BYTES", 1)
    reference, store = family_placed
    ids = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(4))
    want = reference.generate(ids, max_new_tokens=8, do_sample=False)
    loads = {}
    for prefetching in (False, True):
        file_reads.clear()
        with StreamingModel(store, experts="on_demand", max_resident_memory=0, max_expert_memory=0,
                            prefetching=prefetching) as model:
            experts = model.experts
            experts.read_ahead = read_ahead
            assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False), want)
            guesses, loads[prefetching] = experts.guesses, experts.loads
            # every read is a routed one or a guess (a guess stopped before its read began reads nothing)
            assert experts.loads - guesses.right <= len(file_reads) <= experts.loads - guesses.right + guesses.made
            assert experts._buffers.allocated <= 1 + experts.depth(read_ahead)
            assert experts._executor()._max_workers == (2 if read_ahead and not large else 1)
            if prefetching and read_ahead:   # guesses take the reads' room but one: none where there is one
                assert 0 < guesses.right < guesses.made and guesses.wasted_bytes > 0
                assert experts.report()["guessed_right"] == guesses.right
            else:
                assert guesses.made == 0
    assert loads[True] == loads[False]


def test_a_read_ahead_of_the_router_stops_between_pieces(tmp_path, monkeypatch):
    """A stoppable expert read asks for STOP_PIECE bytes at a time and ends before the first piece after it is
    stopped, by O_DIRECT or by plain reads, saying how much it had read; kept, it reads the rest of the expert
    in one request."""
    import shardstream.store.direct_io as direct_io

    monkeypatch.setattr(direct_io, "STOP_PIECE", 4096)
    _, store = _store(tmp_path)
    index = load_index(store)
    expert = Expert(store, index, next(iter(index.experts.values())))
    size = expert.nbytes
    assert size > 3 * 4096

    class After(direct_io.Stoppable):
        """Stopped (or kept) by the read's own thread once it has read `pieces` pieces; the sizes it asked for."""

        def __init__(self, pieces: int, keep: bool):
            super().__init__()
            self.pieces, self.keep, self.asked = pieces, keep, []

        def piece(self, usual: int, done: int) -> int:
            if len(self.asked) == self.pieces:
                self.stopped, self.kept = not self.keep, self.keep
            self.asked.append(super().piece(usual, done))
            return self.asked[-1]

    for buffer, drop in ((read_buffer(aligned(size)), True), (bytearray(size), False)):
        stop = After(2, keep=False)
        with pytest.raises(direct_io.ReadStopped) as stopped:
            expert.fill(buffer, drop=drop, stop=stop)
        assert stopped.value.done == 2 * 4096 and stop.asked == [4096, 4096]
        kept = After(2, keep=True)
        got = expert.tensors_in(buffer, *expert.fill(buffer, drop=drop, stop=kept))
        assert all(torch.equal(got[n], t) for n, t in expert.read(verify=True).items())
        assert kept.asked[:2] == [4096, 4096] and kept.asked[2] > 4096 and len(kept.asked) == 3


def test_guesses_seldom_right_are_cut_to_a_probe_and_come_back_when_right():
    """The policy alone, over a real thread pool (reads that fill nothing): while most recent guesses are
    wrong, a pass may guess one expert once every PROBE_EVERY passes; right guesses bring the whole room back.
    Wrong ones give their buffer back, right ones are handed over checked."""
    from concurrent.futures import ThreadPoolExecutor

    from shardstream.stream import experts as module

    from shardstream.store.checksum import HashAsRead

    given = []
    filled = lambda layer, expert, stop: module._Filled(None, f"buffer {expert}", 10, HashAsRead(memoryview(b"")))  # noqa: E731
    guesses = module._Guesses(fill=filled,
                              check=lambda layer, read: ("checked", read.result().buffer), give=given.append)
    with ThreadPoolExecutor(2) as threads:
        passes = 0
        while guesses.allowance(3) == 3:   # every guess wrong
            guesses.start(threads, 1, [0, 1, 2], 3)
            assert guesses.settle(1, [5], threads) == {}
            passes += 1
        assert 0 < passes < module.GUESS_MEMORY and guesses.precision < module.GUESS_PRECISION
        # a guess still queued when it is found wrong is cancelled, never read: the others give their buffer back
        assert len(given) <= 3 * passes and set(given) <= {f"buffer {e}" for e in (0, 1, 2)}
        allowed = [guesses.allowance(3) for _ in range(2 * module.PROBE_EVERY - 1)]
        assert allowed.count(1) == 2 and set(allowed) == {0, 1}
        while guesses.precision < module.GUESS_PRECISION:   # probes that are right
            guesses.start(threads, 1, [4], 1)
            right = guesses.settle(1, [4, 6], threads)
            assert list(right) == [4] and right[4].result() == ("checked", "buffer 4")
        assert guesses.allowance(3) == 3
    assert guesses.made == 3 * passes + guesses.right and guesses.wasted_bytes == 10 * len(given)


def test_no_guess_is_made_for_a_block_whose_experts_are_all_held(tmp_path, monkeypatch):
    """Guessing costs the next block's router product and a ranking: where that block's experts are all held
    there is nothing to read ahead, and no guess is made; where they are not, it is."""
    from shardstream.stream import experts as module

    _, store = _top_4_store(tmp_path, "qwen3_moe", head_dim=8)
    guessed, real = [], module.OnDemandExperts._guessed

    def counting(self, layer, *args):
        guessed.append(layer)
        return real(self, layer, *args)

    monkeypatch.setattr(module.OnDemandExperts, "_guessed", counting)
    for budget in (None, 2 * TOP_4_EXPERT_BYTES):
        with StreamingModel(store, experts="on_demand", max_resident_memory=0, max_expert_memory=budget) as model:
            model(torch.arange(3, 60).view(1, -1))   # every expert of each block routed to
            held = {block: model.experts.cache.held_in(block) for block in model.experts._blocks}
            guessed.clear()
            model(torch.tensor([[5]]))
        if budget is None:
            assert set(held.values()) == {8} and not guessed
        else:
            assert max(held.values()) < 8 and guessed


def test_guesses_rank_experts_by_their_routing_weight():
    """A token's likeliest expert is guessed first, whatever its number; over many tokens, the experts that take
    most of the routing weight; another module's experts (a tensor-parallel rank's share) are left out."""
    from shardstream.stream.experts import _ranked

    assert _ranked(torch.tensor([[5, 3]]), torch.tensor([[0.7, 0.3]]), 8) == [5, 3]
    assert _ranked(torch.tensor([[3, 5]]), torch.tensor([[0.6, 0.4]]), 8) == [3, 5]
    picks = torch.tensor([[1, 2], [2, 6], [1, 7]])
    weights = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4]])
    assert _ranked(picks, weights, 8) == [1, 6, 7, 2]
    assert _ranked(picks, weights, 4) == [1, 2]
    assert _ranked(torch.tensor([[4, 0]]), torch.tensor([[1.0, 0.0]]), 8) == [4, 0]   # picked with no weight: last


def _watched(reference) -> tuple:
    """An `_Entering` watching blocks 0 and 1 of `reference`, a dict its hooks fill with block 0's experts'
    outputs (`outputs`) and block 1's router input (`router`), and the hooks to remove."""
    from shardstream.stream.experts import _Entering

    entering, seen, layers = _Entering(), {}, reference.model.layers
    hooks = [*entering.watch(0, reference, "model.layers.0.mlp.experts"),
             *entering.watch(1, reference, "model.layers.1.mlp.experts"),
             layers[0].mlp.register_forward_hook(lambda module, args, out: seen.update(outputs=out)),
             layers[1].mlp.gate.register_forward_pre_hook(lambda module, args: seen.update(router=args[0]))]
    return entering, seen, hooks


def test_guesses_see_the_next_blocks_router_input_as_far_as_known(placed):
    """The next block's router is run on this block's residual stream plus the experts' outputs so far, through
    the next block's post-attention norm: with the next block's attention writing nothing, that is exactly its
    router's input once every output is in. An output waiting for a lower expert's counts."""
    from shardstream.stream.experts import _InExpertOrder

    reference = copy.deepcopy(placed[0])
    layers = reference.model.layers
    with torch.no_grad():
        layers[1].self_attn.o_proj.weight.zero_()
    entering, seen, hooks = _watched(reference)
    ids = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        reference(ids)
    for hook in hooks:
        hook.remove()
    residual = entering.residual(0)
    assert residual is not None and entering.residual(0) is None   # the pass's to keep, then let go of
    outputs = seen["outputs"].reshape(-1, residual.shape[-1])
    state = entering.state(1, residual, outputs)
    assert torch.allclose(state, seen["router"].float(), atol=1e-5)
    assert not torch.allclose(entering.state(1, residual, torch.zeros_like(outputs)), state, atol=1e-3)
    assert entering.state(2, residual, outputs) is None   # block 2 not watched: no norm kept, no guess from it

    out = _InExpertOrder(torch.zeros(2, 3), [0, 1])
    out.add(1, torch.tensor([0]), torch.ones(1, 3))
    assert out.total.abs().sum() == 0 and torch.equal(out.so_far(), torch.tensor([[1.0] * 3, [0.0] * 3]))


def test_decode_guesses_add_the_next_blocks_attention_output_of_the_token_before(placed):
    """In a decode step the next block's attention output is not known yet; its output for the token before
    stands in for it. With that output the same at every step, the guess is the router's input exactly; a
    pass of many rows (a prompt) has no row of the pass before to add."""
    reference = copy.deepcopy(placed[0])
    layers = reference.model.layers
    fixed = torch.randn(reference.config.hidden_size, generator=torch.Generator().manual_seed(7))

    def attend_fixed(module, args, out):   # block 1's attention writes the same vector for every token
        return (fixed.to(out[0].dtype).expand_as(out[0]).clone(), *out[1:])

    fixing = layers[1].self_attn.register_forward_hook(attend_fixed)   # before the watch's: it sees the fixed output
    entering, seen, hooks = _watched(reference)
    hooks.append(fixing)
    ids = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(5))

    def guessed() -> tuple[torch.Tensor, torch.Tensor]:
        residual = entering.residual(0)
        return entering.state(1, residual, seen["outputs"].reshape(-1, residual.shape[-1])), seen["router"].float()

    with torch.no_grad():
        past = reference(ids, use_cache=True).past_key_values
        prompt_state, prompt_router = guessed()
        kept = entering._attended[1]   # the prompt's last row only, not its whole output
        assert kept.shape == (1, reference.config.hidden_size) and kept.untyped_storage().nbytes() == kept.numel() * 4
        reference(ids[:, -1:], past_key_values=past, use_cache=True)
        step_state, step_router = guessed()
    for hook in hooks:
        hook.remove()
    assert not torch.allclose(prompt_state, prompt_router, atol=1e-3)   # the prompt's pass: no attention term
    assert torch.allclose(step_state, step_router, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_tokens_output_is_added_with_the_bits_of_index_add(dtype):
    """A decode step's expert output goes into its token's row by an in-place add, not `index_add_` (the
    transformers way, much slower on the CPU for one row): the same bits, in float32 and in bfloat16."""
    from shardstream.stream.experts import _InExpertOrder

    generator = torch.Generator().manual_seed(0)
    start = torch.randn(3, 64, generator=generator).to(dtype)
    outputs = {expert: torch.randn(1, 64, generator=generator) for expert in (7, 2, 5)}
    expected = start.clone()
    for expert in sorted(outputs):
        expected.index_add_(0, torch.tensor([1]), outputs[expert].to(dtype))
    order = _InExpertOrder(start.clone(), list(outputs))
    for expert, output in outputs.items():   # out of expert order: each waits for the lower ones
        order.add(expert, 1, output)
    assert torch.equal(order.total, expected)
