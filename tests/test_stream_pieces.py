"""Blocks streamed piece by piece (stream/pieces.py): the read order is every family's forward order,
results stay exact through mapping and O_DIRECT (quantized stores too), checksums still fail on the
first token, the buffers stay within the pieces in flight, and an out-of-order piece is read again
(slowly, with a warning) instead of going wrong.

The tiny models' modules are far below the 1 MiB a real piece takes, so these tests lower the
threshold to 1 KiB: every Linear (and fused experts module) is then a piece of its own, while norms,
routers and q/k norms (at most 512 bytes here) stay in piece 0, as they do at full size.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from shardstream.convert import convert
from shardstream.errors import StoreCorrupt
from shardstream.shard import place_experts
from shardstream.store import open_store
from shardstream.stream import StreamingModel, pieces, prefetch, quant_linear
from shardstream.stream.loader import BlockLoader
from shardstream.switches import DIRECT_IO, QUANT_KERNEL
from tiny_models import CONFIGS, save_checkpoint

IDS = torch.tensor([[5, 9, 2, 7, 11, 3], [8, 4, 6, 10, 12, 13]])
TOLERANCE = 1e-5
SMALL = 1024   # bytes: the tiny models' Linears are 2-16 KiB, their norms and routers at most 512 bytes


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch):
    """Every tiny Linear is a piece of its own (grouping is tested on its own below)."""
    monkeypatch.setattr(pieces, "MIN_PIECE_BYTES", SMALL)
    monkeypatch.setattr(pieces, "PIECE_BYTES", SMALL)


def _store(tmp_path, family="llama", compression=None):
    reference = save_checkpoint(family, tmp_path / "ckpt")
    convert(tmp_path / "ckpt", tmp_path / "store", compression=compression, progress=False)
    return reference, open_store(tmp_path / "store")


def _recorded(monkeypatch, cls: type, method: str) -> list:
    """The keys `cls.method(key)` is called with from now on (a reader's `get`, a loader's `load_piece`)."""
    keys = []
    real = getattr(cls, method)

    def recording(self, key):
        keys.append(key)
        return real(self, key)

    monkeypatch.setattr(cls, method, recording)
    return keys


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_forward_order_is_the_read_order(tmp_path, monkeypatch, family, caplog):
    """The first pass teaches the reader the order; every later pass asks for exactly that order, each
    piece once, so nothing read ahead is dropped (Phi-3 runs qkv_proj before the o_proj it defines first;
    Qwen2-MoE and Qwen3-MoE run their router before the experts they define first)."""
    reference, store = _store(tmp_path, family)
    with StreamingModel(store, max_resident_memory=0) as model:
        assert all(len(p) > 2 for p in model.pieces.values())  # really split
        with caplog.at_level(logging.WARNING, logger="shardstream.stream.prefetch"), torch.no_grad():
            got = model(IDS).logits
            every = [(k, i) for k, ps in model.pieces.items() for i in range(len(ps))]
            report = model.report()
            assert sorted(report.read_order) == every   # learned: each piece once
            # read ahead from the start, where the named order is the forward order
            guessed = family not in ("phi3", "qwen2_moe", "qwen3_moe")
            assert report.read_ahead == ("guessed order" if guessed else "learned order")
            asked = _recorded(monkeypatch, prefetch.Prefetcher, "get")
            model(IDS)
            assert tuple(asked) == report.read_order
            tokens = model.generate(IDS, max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert not caplog.records   # nothing read ahead was dropped
        with torch.no_grad():
            assert (got - reference(IDS).logits).abs().max().item() <= TOLERANCE
        assert torch.equal(tokens, reference.generate(IDS, max_new_tokens=3, do_sample=False, pad_token_id=0))


@pytest.mark.parametrize("compression", [None, "4bit", "8bit"])
def test_direct_and_mapped_pieces_match_whole_blocks(tmp_path, monkeypatch, compression):
    _, store = _store(tmp_path, compression=compression)
    assert any(r.quant for r in store.manifest.tensors.values()) == bool(compression)   # pieces carry their scales
    results = {}
    for split, mode in [(False, "off"), (True, "off"), (True, "on")]:
        monkeypatch.setattr(pieces, "MIN_PIECE_BYTES", SMALL if split else 1 << 40)
        monkeypatch.setenv(DIRECT_IO.name, mode)
        with StreamingModel(store, max_resident_memory=0) as model:
            assert (model.reading == "direct") == (mode == "on")
            assert all((len(p) > 2) == split for p in model.pieces.values())
            with torch.no_grad():
                results[split, mode] = model(IDS).logits
            # however many pieces were read: 2 pieces in flight (+ their dequantization buffers) and,
            # read directly, their read buffers and 2 held pieces 0 (norms: never quantized)
            decoded = 2 if compression else 0
            assert model.report().read_buffers <= decoded + (4 if mode == "on" else 0)
    assert torch.equal(results[True, "off"], results[False, "off"])
    assert torch.equal(results[True, "on"], results[False, "off"])


@pytest.mark.parametrize("mode", ["off", "on"])
def test_a_corrupt_block_fails_its_checksum_on_the_first_token(tmp_path, monkeypatch, mode):
    _, store = _store(tmp_path)
    name = store.manifest.parts["mid/2"].files[0]
    data = bytearray((store.root / name).read_bytes())
    data[-1] ^= 0xFF   # the end of the file: a tensor no piece 0 reads
    (store.root / name).write_bytes(bytes(data))
    monkeypatch.setenv(DIRECT_IO.name, mode)
    with StreamingModel(store, max_resident_memory=0) as model:
        with pytest.raises(StoreCorrupt, match=r"mid/2/.* fails its checksum; re-run `shardstream convert`"):
            model(IDS)


def test_working_set_counts_pieces_not_blocks(tmp_path, monkeypatch):
    _, store = _store(tmp_path)
    monkeypatch.setattr(pieces, "MIN_PIECE_BYTES", 1 << 40)
    with StreamingModel(store, max_resident_memory=0) as whole:
        block = max(whole.report().block_bytes)
        assert whole.stream_working_set == 2 * block
    monkeypatch.setattr(pieces, "MIN_PIECE_BYTES", SMALL)
    with StreamingModel(store, max_resident_memory=0) as split:
        largest = max(p.nbytes for ps in split.pieces.values() for p in ps[1:])
        assert split.stream_working_set == 2 * largest + 2 * max(ps[0].nbytes for ps in split.pieces.values())
        assert split.stream_working_set < block


def test_a_piece_asked_for_out_of_order_is_read_again_with_a_warning(tmp_path, caplog):
    """A module run outside the read order (here k_proj of block 0, on its own): the reader drops what
    it read ahead until that piece comes round, with a warning, and the next pass is still exact."""
    reference, store = _store(tmp_path)
    with StreamingModel(store, max_resident_memory=0) as model:
        k_proj = model.model.model.layers[0].self_attn.k_proj
        index = next(i for i, p in enumerate(model.pieces[0]) if k_proj in p.modules)
        with torch.no_grad():
            model(IDS)   # the reader has learned the order and reads ahead
        with caplog.at_level(logging.WARNING, logger="shardstream.stream.prefetch"), torch.no_grad():
            k_proj(torch.ones(1, model.config.hidden_size))
            got = model(IDS).logits
        messages = [r.getMessage() for r in caplog.records]
        assert any(f"wanted block 0 piece {index} but had read block 0 piece 0" in m for m in messages), messages
        with torch.no_grad():
            assert (got - reference(IDS).logits).abs().max().item() <= TOLERANCE


def test_pieces_loaded_ahead_by_the_computing_thread_stay_exact(tmp_path, monkeypatch):
    """Where loading a piece only queues its copy to the GPU (every piece kept page-locked), the computing
    thread loads the pieces ahead itself (prefetch.CopyAhead): the CPU runs the same logic when told so.
    Each piece is loaded once a pass, `depth` ahead, and a module run out of order restarts the cycle."""
    reference, store = _store(tmp_path)
    monkeypatch.setattr(BlockLoader, "copies_only", lambda self, keys: True)
    loaded = _recorded(monkeypatch, BlockLoader, "load_piece")
    with StreamingModel(store, max_resident_memory=0, prefetch_depth=2) as model:
        with torch.no_grad():
            want = reference(IDS).logits
            model(IDS)   # the first pass learns the order, read by the reader threads
            assert model.report().read_ahead == "copy ahead"
            loaded.clear()
            assert (model(IDS).logits - want).abs().max().item() <= TOLERANCE
            order = list(model.report().read_order)
            assert loaded == order + order[:2]   # each piece once, then the next pass's first two ahead
            model.model.model.layers[0].self_attn.k_proj(torch.ones(1, model.config.hidden_size))
            assert (model(IDS).logits - want).abs().max().item() <= TOLERANCE


def test_on_demand_experts_stream_with_pieces_and_leave_nothing_behind(tmp_path):
    """The fused experts filled on demand are no piece the reader reads; they still go with their block."""
    reference, store = _store(tmp_path, "mixtral")
    place_experts(store, {"hot": ".", "cold": str(tmp_path / "cold")}, placement={(0, 1): "cold", (2, 2): "cold"})
    with StreamingModel(store, experts="on_demand", max_resident_memory=0) as model:
        assert all(len(p) > 2 for p in model.pieces.values())   # attention Linears still pieces
        assert not any(layer.mlp.experts in p.modules for layer in model.model.model.layers
                       for ps in model.pieces.values() for p in ps)
        with torch.no_grad():
            got = model(IDS).logits
            assert (got - reference(IDS).logits).abs().max().item() <= TOLERANCE
        left = [n for n, p in model.model.model.layers.named_parameters() if p.device.type != "meta"]
        assert left == []


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_consecutive_modules_of_one_parent_share_a_piece(tmp_path, monkeypatch, family, caplog):
    """Up to PIECE_BYTES, sibling Linears are one piece: filled when the first of them starts, emptied
    when all have run, in whatever order they run (Phi-3 defines o_proj before qkv_proj)."""
    monkeypatch.setattr(pieces, "PIECE_BYTES", 1 << 40)
    reference, store = _store(tmp_path, family)
    with caplog.at_level(logging.WARNING), StreamingModel(store, max_resident_memory=0) as model:
        block = model.model.model.layers[0]
        groups = [tuple(type(m).__name__ for m in p.modules) for p in model.pieces[0][1:]]
        assert len(groups) == 2 and all(len(g) >= 2 for g in groups), groups   # attention's, the MLP's
        assert {m for p in model.pieces[0][1:] for m in p.modules} >= set(block.self_attn.children())
        with torch.no_grad():
            for _ in range(2):   # the second pass reads ahead in the learned order
                got = model(IDS).logits
                assert (got - reference(IDS).logits).abs().max().item() <= TOLERANCE
        assert all(p.device.type == "meta" for p in block.parameters())
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_batch_engines_model_streams_smaller_pieces(tmp_path, monkeypatch):
    """`serve` and `generate --prompts-file` open the model with `command_options(flags, batch_size=N)`: for
    N > 1 its pieces are cut at BATCH_PIECE_BYTES (memory for the KV caches), for one sequence at PIECE_BYTES."""
    from shardstream.front.cli import command_options, open_model
    from shardstream.options import ConversionOptions, EngineFlags

    _, store = _store(tmp_path)
    monkeypatch.setattr(pieces, "PIECE_BYTES", 1 << 40)
    monkeypatch.setattr(pieces, "BATCH_PIECE_BYTES", SMALL)
    counts = {}
    for batch_size in (1, 4):
        options = command_options(EngineFlags(max_resident_memory="0"), batch_size=batch_size)
        with open_model(str(store.root), ConversionOptions(), options, "cpu", progress=False) as model:
            counts[batch_size] = {len(p) for p in model.pieces.values()}
    assert counts == {1: {3}, 4: {8}}   # piece 0, attention's Linears, the MLP's; or piece 0 and each Linear


@pytest.fixture
def dequantizing(monkeypatch):
    """Quantized Linears dequantized on every pass, as without the kernel (quant_linear.py)."""
    monkeypatch.setenv(QUANT_KERNEL.name, "0")
    quant_linear._library.cache_clear()
    yield
    quant_linear._library.cache_clear()


@pytest.mark.parametrize("mode", ["off", "on"])
def test_a_compute_bound_pass_dequantizes_on_the_computing_thread(tmp_path, monkeypatch, mode, dequantizing):
    """A pass of COMPUTE_BOUND_ROWS token rows or more dequantizes its quantized pieces where it computes,
    a smaller one on the readers; both give the same logits, mapped and O_DIRECT, and every buffer of
    a deferred piece still goes back to the pool (the count stays at the pieces in flight)."""
    from shardstream import quant
    from shardstream.stream import model as streaming

    _, store = _store(tmp_path, compression="4bit")
    monkeypatch.setenv(DIRECT_IO.name, mode)
    threads: list[str] = []
    real = quant.dequantize

    def dequantize(data, absmax, meta, out=None):
        threads.append(threading.current_thread().name)
        return real(data, absmax, meta, out)

    monkeypatch.setattr(quant, "dequantize", dequantize)
    many = IDS.repeat(2, 2)   # 4 x 12 = 48 rows
    assert many.numel() >= streaming.COMPUTE_BOUND_ROWS > IDS[:1, :1].numel()
    with StreamingModel(store, max_resident_memory=0) as model, torch.no_grad():
        # the pieces read ahead during a pass are decoded as that pass decided, so each kind runs twice
        for ids, where in [(many, threading.current_thread().name), (IDS[:1, :1], "shardstream-prefetch")] * 2:
            model(ids)
            threads.clear()
            model(ids)
            assert threads and set(threads) == {where}
        deferred = model(many).logits
        allocated = model.report().read_buffers
        monkeypatch.setattr(streaming, "COMPUTE_BOUND_ROWS", 10 ** 6)
        model(many)
        threads.clear()
        in_readers = model(many).logits
        assert threads and set(threads) == {"shardstream-prefetch"}
        assert model.report().read_buffers == allocated
    assert torch.equal(deferred, in_readers)


def test_a_dequantization_that_fails_on_the_computing_thread_gives_its_piece_back(tmp_path, monkeypatch,
                                                                                  dequantizing):
    """An error while a compute-bound pass dequantizes a piece reaches the caller, and the piece goes
    back as a failed read does (its buffers to the pool, its slot to the readers): only the pieces of the
    block the pass stopped in stay handed out (until the next pass empties it, as for any aborted pass),
    and the next pass gives the same logits with no more buffers."""
    from shardstream import quant

    _, store = _store(tmp_path, compression="4bit")
    monkeypatch.setenv(DIRECT_IO.name, "on")
    many = IDS.repeat(2, 2)
    with StreamingModel(store, max_resident_memory=0) as model, torch.no_grad():
        model(many)
        want = model(many).logits
        allocated = model.report().read_buffers
        real, failures = quant.dequantize, []

        def dequantize(data, absmax, meta, out=None):
            if not failures and threading.current_thread() is threading.main_thread():
                failures.append(meta)
                raise OSError("injected")
            return real(data, absmax, meta, out)

        monkeypatch.setattr(quant, "dequantize", dequantize)
        with pytest.raises(OSError, match="injected"):
            model(many)
        report = model.report()   # handed out now: only the pieces of the block left in place
        assert failures and report.in_place and report.handed_out == report.in_place
        model(many)
        assert torch.equal(model(many).logits, want)
        report = model.report()
        assert report.handed_out == report.in_place == frozenset()
        assert report.read_buffers <= allocated
